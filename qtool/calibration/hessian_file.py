"""The Hessian file: each GPTQ layer input's XᵀX and row count, next to the stats file.

A zip of .npy arrays plus a JSON index, written byte-for-byte reproducibly like the stats file
(`archive.write_member`). XᵀX is symmetric, so only its upper triangle is stored (row by row,
diagonal included, float64): half the bytes of the full matrix (MiniLM's 1536 x 1536 FFN inputs
are 9.4 MB each this way instead of 18.9 MB). The triangles are stored, not deflated: on
MiniLM's Hessians deflate saved 4% of 67 MB and took 3 of the 4 seconds the save took.

Saving refuses a matrix that is not exactly symmetric rather than silently dropping its lower
half, and loading rebuilds an exactly symmetric matrix, so a Hessian read back has the same bytes
as the one collected and GPTQ gives the same model from either. (numpy computes `x.T @ x` with
BLAS syrk and mirrors one triangle, so accumulated sums are exactly symmetric; a test checks it.)

Shards (one file per process or per slice of the calibration set) merge with `merge_hessians`.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from qtool.calibration.archive import index_field, load_entries, write_member
from qtool.calibration.hessians import HessianAccumulator, pack_triangle, unpack_triangle
from qtool.errors import CalibrationError
from qtool.io import atomic_write_bytes, not_a_file
from qtool.zip_members import MAX_NPY_HEADER_BYTES, NpyMember

FORMAT = "qtool-hessians/1"
_KIND = "Hessian"
_LAYOUT = "upper triangle, row by row, float64"


def _check_storable(name: str, acc: HessianAccumulator) -> None:
    xtx = acc.xtx
    if xtx.dtype != np.float64 or xtx.shape != (acc.features, acc.features):
        raise CalibrationError(
            f"tensor {name!r}: XᵀX is {xtx.dtype} {xtx.shape}, expected float64 "
            f"({acc.features}, {acc.features})"
        )
    if not np.all(np.isfinite(xtx)):
        raise CalibrationError(f"tensor {name!r}: XᵀX contains NaN or Inf")
    if not np.array_equal(xtx, xtx.T):
        raise CalibrationError(
            f"tensor {name!r}: XᵀX is not exactly symmetric, so its upper triangle would not "
            "store it (accumulate it with HessianAccumulator.update)"
        )


def save_hessians(
    path: Path,
    accumulators: Mapping[str, HessianAccumulator],
    model_fingerprint: str,
    data_sha256: str | None = None,
) -> None:
    """Write `hessian_file_bytes(...)` to `path` atomically."""
    atomic_write_bytes(path, hessian_file_bytes(accumulators, model_fingerprint, data_sha256))


def hessian_file_bytes(
    accumulators: Mapping[str, HessianAccumulator],
    model_fingerprint: str,
    data_sha256: str | None = None,
) -> bytes:
    """The file's bytes (write_hessian_file into memory)."""
    buffer = io.BytesIO()
    write_hessian_file(buffer, accumulators, model_fingerprint, data_sha256)
    return buffer.getvalue()


def write_hessian_file(
    handle: BinaryIO,
    accumulators: Mapping[str, HessianAccumulator],
    model_fingerprint: str,
    data_sha256: str | None = None,
) -> None:
    """Write the file to `handle`, sorted by tensor name so its bytes do not depend on dict
    order; one packed matrix in memory at a time (a decoder's file is hundreds of MB: written
    to its staged file, not held as bytes until the commit).

    `model_fingerprint` is the prepared model's (as in the stats file); `data_sha256` fingerprints
    the calibration batches, for provenance.
    """
    names = sorted(accumulators)
    for name in names:
        _check_storable(name, accumulators[name])
    index = {
        "format": FORMAT,
        "layout": _LAYOUT,
        "model_sha256": model_fingerprint,
        "data_sha256": data_sha256,
        "tensors": [
            {
                "name": name,
                "features": accumulators[name].features,
                "rows": accumulators[name].rows,
                "xtx": f"xtx_{i}.npy",
            }
            for i, name in enumerate(names)
        ],
    }
    with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        write_member(archive, "index.json", json.dumps(index, indent=1, sort_keys=True).encode())
        for i, name in enumerate(names):  # one packed matrix in memory at a time
            array_bytes = io.BytesIO()
            np.save(array_bytes, pack_triangle(accumulators[name].xtx))
            write_member(archive, f"xtx_{i}.npy", array_bytes.getvalue(), zipfile.ZIP_STORED)


def read_back(path: Path, committed: Path, accumulators: Mapping[str, HessianAccumulator]) -> None:
    """Let every accumulator go and read its triangle back from `path`, the staged file this run
    has just written from them (`write_hessian_file`), or from `committed`, the name it has once
    the run's outputs are renamed into place. qtool's own bytes: each read checks only that the
    member is the triangle it wrote."""
    for i, name in enumerate(sorted(accumulators)):
        accumulator = accumulators[name]
        length = accumulator.features * (accumulator.features + 1) // 2

        def triangle(member: str = f"xtx_{i}.npy", length: int = length) -> np.ndarray:
            source = path if path.exists() else committed
            try:
                with zipfile.ZipFile(source) as archive, archive.open(member) as handle:
                    packed = np.lib.format.read_array(handle)
            except (OSError, zipfile.BadZipFile, KeyError) as exc:
                raise CalibrationError(
                    f"{source}: cannot read the Hessians this run wrote back ({exc})"
                ) from None
            if packed.dtype != np.float64 or packed.shape != (length,):
                raise CalibrationError(f"{source}: member {member} is not the triangle written")
            return packed

        accumulator.store(triangle)


def _read_entry(path: Path, archive: zipfile.ZipFile, entry: object) -> HessianAccumulator:
    """One tensor's accumulator, every field and the array checked against what XᵀX must be."""
    name = entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str):
        raise CalibrationError(f"{path}: corrupt Hessian file (a tensor entry without a name)")
    features, rows, member = entry.get("features"), entry.get("rows"), entry.get("xtx")
    if type(features) is not int or features < 1 or type(rows) is not int or rows < 0:
        raise CalibrationError(
            f"{path}: tensor {name!r}: features {features!r} and rows {rows!r} must be a positive "
            "and a non-negative integer"
        )
    if not isinstance(member, str):
        raise CalibrationError(f"{path}: tensor {name!r}: no array member named")
    expected = (features * (features + 1) // 2,)
    limit = MAX_NPY_HEADER_BYTES + expected[0] * 8
    where = f"tensor {name!r}: "
    with NpyMember(path, archive, member, where, limit=limit, error=CalibrationError) as npy:
        if npy.dtype != np.float64 or npy.shape != expected:
            raise CalibrationError(
                f"{path}: tensor {name!r}: XᵀX triangle is {npy.dtype} {npy.shape}, expected "
                f"float64 {expected} for {features} features (member {member!r})"
            )
        packed = npy.read()
    if not np.all(np.isfinite(packed)):
        raise CalibrationError(f"{path}: tensor {name!r}: XᵀX contains NaN or Inf")
    xtx = unpack_triangle(packed, features)
    diagonal = np.diag(xtx)
    if np.any(diagonal < 0):  # each (XᵀX)_ii is a sum of squares
        raise CalibrationError(f"{path}: tensor {name!r}: XᵀX has a negative diagonal entry")
    if rows == 0 and np.any(diagonal != 0):
        raise CalibrationError(f"{path}: tensor {name!r}: XᵀX is not zero but counts no rows")
    accumulator = HessianAccumulator.from_sum(xtx, rows, name)
    accumulator.pack()
    return accumulator


def load_hessians(path: Path, model_fingerprint: str) -> dict[str, HessianAccumulator]:
    """The accumulators of a Hessian file collected on the model with `model_fingerprint`."""
    path = Path(path)
    problem = not_a_file(path, "Hessian file")
    if problem is not None:
        advice = " (run `qtool calibrate` first)" if not path.exists() else ""
        raise CalibrationError(f"{path}: {problem}{advice}")

    def read(archive: zipfile.ZipFile, index: dict, entry: object) -> HessianAccumulator:
        if index.get("layout") != _LAYOUT:
            raise CalibrationError(f"{path}: corrupt Hessian file (layout {index.get('layout')!r})")
        return _read_entry(path, archive, entry)

    return load_entries(path, _KIND, FORMAT, model_fingerprint, read)


def hessian_data_sha256(path: Path) -> str | None:
    """The calibration data fingerprint a Hessian file records (None when it records none)."""
    value = index_field(Path(path), _KIND, FORMAT, "data_sha256")
    return value if isinstance(value, str) else None


def merge_hessians(
    shards: Sequence[Mapping[str, HessianAccumulator]],
) -> dict[str, HessianAccumulator]:
    """Sum shards (processes, files, slices of the calibration set) tensor by tensor.

    Plain float64 addition, left to right in the order given: the same shards in the same order
    (e.g. by rank) give the same bytes on every run. Against one process over all the batches the
    sums differ only by float64 rounding, since the additions are grouped differently. Every
    shard must hold the same tensors: a shard without one is from another configuration.
    """
    if not shards:
        raise CalibrationError("no Hessian shards to merge")
    names = list(shards[0])
    for number, shard in enumerate(shards):
        if set(shard) != set(names):
            odd = sorted(set(shard) ^ set(names))[0]
            raise CalibrationError(
                f"Hessian shard {number} and shard 0 disagree on tensor {odd!r} (one lacks it)"
            )
    merged = {}
    for name in names:
        first = shards[0][name]
        total = HessianAccumulator.from_sum(first.xtx, first.rows, name)
        for shard in shards[1:]:
            total = total.merge(shard[name])
        merged[name] = total
    return merged
