"""The stats file: a zip of .npy arrays plus a JSON index, written byte-for-byte reproducibly.

numpy's savez stamps the current time into the zip, so two identical calibrations would differ;
this writer fixes every zip timestamp so the same data gives the same file (checked by tests).

Besides the statistics the index records what they were collected on: the prepared model's
SHA-256, the histogram bins, and the calibration data as a mergeable multiset fingerprint
(`data_digest`, see calibration/data_digest.py; `data_sha256` is its digest). A file that covers
only some shards of the calibration set (`qtool calibrate --shard i/N`, or a merge of some of
them) also records which (`shard`: count, indices, and the batching that defines a shard), so
`qtool stats merge` can refuse overlapping shards; a file that covers the whole set records no
`shard`, which makes a complete merge byte-identical to a single run.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qtool.calibration.archive import MAX_INDEX_BYTES, write_member
from qtool.calibration.data_digest import DataDigest
from qtool.calibration.observers import TensorStats
from qtool.errors import CalibrationError
from qtool.io import atomic_write_bytes, not_a_file
from qtool.zip_members import (
    MAX_NPY_HEADER_BYTES,
    READ_ERRORS,
    NpyMember,
    damage,
    read_member,
)

FORMAT = "qtool-stats/1"
# The largest `bins` a stats file may record: recipe.MAX_BINS, the largest calibration.bins
# (a test checks that they agree; not imported, to keep the recipe's YAML loader out of the
# stats reader). It bounds every histogram member at 2 * MAX_BINS int64 counts = 256 KiB.
MAX_BINS = 16384


@dataclass(frozen=True)
class ShardRecord:
    """The part of the calibration set a file covers: batches b with b % count in indices.

    Batches are cut by batch_size from the first max_samples samples of the source (shuffled by
    seed where the source shuffles), so shards agree on what batch b is only when all three agree.
    """

    count: int
    indices: tuple[int, ...]
    batch_size: int
    max_samples: int | None
    seed: int

    @property
    def complete(self) -> bool:
        return self.indices == tuple(range(self.count))

    def describe(self) -> str:
        return f"{','.join(map(str, self.indices))}/{self.count}"

    def to_json(self) -> dict:
        return {
            "count": self.count,
            "indices": list(self.indices),
            "batch_size": self.batch_size,
            "max_samples": self.max_samples,
            "seed": self.seed,
        }

    @classmethod
    def from_json(cls, value: object, where: str) -> ShardRecord:
        def integer(key: str, minimum: int, optional: bool = False) -> int | None:
            item = value.get(key)
            if optional and item is None:
                return None
            if type(item) is not int or item < minimum:
                raise CalibrationError(f"{where}: shard {key} must be an integer >= {minimum}")
            return item

        if not isinstance(value, dict):
            raise CalibrationError(f"{where}: shard must be an object, got {value!r}")
        count = integer("count", 2)
        indices = value.get("indices")
        if (
            not isinstance(indices, list)
            or not indices
            or any(type(i) is not int or not 0 <= i < count for i in indices)
            or indices != sorted(set(indices))
        ):
            raise CalibrationError(
                f"{where}: shard indices must be distinct, sorted, in 0..{count - 1}"
            )
        return cls(
            count,
            tuple(indices),
            integer("batch_size", 1),
            integer("max_samples", 1, optional=True),
            integer("seed", -(2**63)),
        )


@dataclass
class StatsFile:
    """Everything a stats file holds, checked."""

    path: Path
    stats: list[TensorStats]  # in file order
    model_sha256: str
    bins: int
    data_sha256: str | None
    data_digest: DataDigest | None  # None in files written before the digest was mergeable
    shard: ShardRecord | None  # None: the whole calibration set


def save_stats(
    path: Path,
    stats: list[TensorStats],
    model_fingerprint: str,
    bins: int,
    data_sha256: str | None = None,
    *,
    data_digest: DataDigest | None = None,
    shard: ShardRecord | None = None,
) -> None:
    """`data_sha256` fingerprints the calibration batches, for the quantized model's provenance."""
    atomic_write_bytes(
        path,
        stats_file_bytes(
            stats, model_fingerprint, bins, data_sha256, data_digest=data_digest, shard=shard
        ),
    )


def stats_file_bytes(
    stats: list[TensorStats],
    model_fingerprint: str,
    bins: int,
    data_sha256: str | None = None,
    *,
    data_digest: DataDigest | None = None,
    shard: ShardRecord | None = None,
) -> bytes:
    """The stats file's content, for callers that commit it together with other outputs.

    With `data_digest`, `data_sha256` is its digest (passing both requires them to agree). A
    `shard` that is complete is not recorded: the file then covers the whole set.
    """
    if data_digest is not None:
        if data_sha256 is not None and data_sha256 != data_digest.hexdigest():
            raise CalibrationError("data_sha256 does not match the data digest (a qtool bug)")
        data_sha256 = data_digest.hexdigest()
    index = {
        "format": FORMAT,
        "model_sha256": model_fingerprint,
        "data_sha256": data_sha256,
        "bins": bins,
        "tensors": [
            {
                "name": s.name,
                "min": s.minimum,
                "max": s.maximum,
                "half_range": s.half_range,
                "samples": s.samples,
                "counts": f"counts_{i}.npy",
            }
            for i, s in enumerate(stats)
        ],
    }
    if data_digest is not None:
        index["data_digest"] = data_digest.to_json()
    if shard is not None and not shard.complete:
        index["shard"] = shard.to_json()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        write_member(archive, "index.json", json.dumps(index, indent=1, sort_keys=True).encode())
        for i, s in enumerate(stats):
            array_bytes = io.BytesIO()
            np.save(array_bytes, np.ascontiguousarray(s.counts, dtype=np.int64))
            write_member(archive, f"counts_{i}.npy", array_bytes.getvalue())
    return buffer.getvalue()


def load_stats(path: Path) -> tuple[dict[str, TensorStats], str]:
    """Return the per-tensor stats and the fingerprint of the model they were collected on.

    A file that covers only some shards of the calibration set is refused: ranges from part of
    the data would quietly differ from the whole set's (`qtool stats merge` the shards first).
    """
    loaded = read_stats_file(path)
    if loaded.shard is not None:
        raise CalibrationError(
            f"{path}: holds shard {loaded.shard.describe()} of the calibration set only; merge "
            "all the shards with `qtool stats merge` and use the merged file"
        )
    return {s.name: s for s in loaded.stats}, loaded.model_sha256


def read_stats_file(path: Path) -> StatsFile:
    """Every field of a stats file, checked.

    Every tensor's entry is checked against what the observers write, because the range methods
    trust it: a histogram of another length would be read at the wrong bin width, and a NaN range
    would become a NaN scale in the model.
    """
    path = Path(path)
    problem = not_a_file(path, "stats file")
    if problem is not None:
        advice = " (run `qtool calibrate` first)" if not path.exists() else ""
        raise CalibrationError(f"{path}: {problem}{advice}")
    try:
        with zipfile.ZipFile(path) as archive:
            index = json.loads(
                read_member(path, archive, "index.json", MAX_INDEX_BYTES, error=CalibrationError)
            )
            if not isinstance(index, dict) or index.get("format") != FORMAT:
                found = index.get("format") if isinstance(index, dict) else None
                raise CalibrationError(f"{path}: not a qtool stats file ({found!r})")
            bins = index["bins"]
            if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2 or bins % 2:
                raise CalibrationError(f"{path}: index bins must be an even integer, got {bins!r}")
            if bins > MAX_BINS:
                raise CalibrationError(
                    f"{path}: index bins is {bins}; calibration.bins is at most {MAX_BINS}"
                )
            stats = [_checked_tensor(path, archive, entry, bins) for entry in index["tensors"]]
    except READ_ERRORS as exc:
        raise CalibrationError(f"{path}: {damage(exc, 'stats file')}") from None
    except (KeyError, ValueError, TypeError, RecursionError) as exc:
        raise CalibrationError(
            f"{path}: corrupt stats file ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    names = [s.name for s in stats]
    if len(set(names)) != len(names):
        raise CalibrationError(f"{path}: a tensor is listed twice")
    data_sha256 = index.get("data_sha256")
    digest = None
    if "data_digest" in index:
        digest = DataDigest.from_json(index["data_digest"], str(path))
        if data_sha256 != digest.hexdigest():
            raise CalibrationError(f"{path}: data_sha256 does not match data_digest (edited?)")
    shard = ShardRecord.from_json(index["shard"], str(path)) if "shard" in index else None
    return StatsFile(
        path,
        stats,
        str(index["model_sha256"]),
        bins,
        data_sha256 if isinstance(data_sha256, str) else None,
        digest,
        shard,
    )


def _checked_tensor(path: Path, archive: zipfile.ZipFile, entry: dict, bins: int) -> TensorStats:
    """One index entry as TensorStats, refused unless it is what HistogramObserver.result() makes:
    2 * bins non-negative integer counts over [-R, R], finite min <= max inside it, samples >= 1.

    The counts member's size and .npy header are checked before its data is read (archive.py),
    so a tampered header or a zip bomb costs nothing."""
    name = str(entry["name"])[:200]
    member = entry["counts"]

    def fail(problem: str) -> CalibrationError:
        return CalibrationError(f"{path}: tensor '{name}': {problem}")

    values = {}
    for key in ("min", "max", "half_range"):
        value = entry[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise fail(f"{key} is {value} (ranges must be finite: a damaged or edited file?)")
        values[key] = float(value)
    low, high, half_range = values["min"], values["max"], values["half_range"]
    if low > high:
        raise fail(f"min {low} is above max {high}")
    if half_range <= 0 or max(abs(low), abs(high)) > half_range:
        raise fail(f"histogram half-range {half_range} does not cover [min, max] = [{low}, {high}]")
    expected = 2 * bins
    limit = MAX_NPY_HEADER_BYTES + expected * np.dtype(np.int64).itemsize
    where = f"tensor '{name}': "
    with NpyMember(path, archive, member, where, limit=limit, error=CalibrationError) as npy:
        if npy.shape != (expected,):
            raise fail(
                f"histogram has shape {list(npy.shape)}, but the file's bins ({bins}) make "
                f"{expected} bins (member {member!r})"
            )
        if npy.dtype.kind not in "iu":
            raise fail(
                f"histogram counts must be non-negative integers, got dtype {npy.dtype} "
                f"(member {member!r})"
            )
        counts = npy.read()
    if (counts < 0).any():
        raise fail(f"histogram counts must be non-negative integers, got dtype {counts.dtype}")
    samples = entry["samples"]
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise fail(f"samples must be a positive integer, got {samples!r}")
    return TensorStats(name, low, high, half_range, counts.astype(np.int64), samples)


def stats_data_sha256(path: Path) -> str | None:
    """The calibration data fingerprint a stats file records (None for files that have none)."""
    try:
        with zipfile.ZipFile(path) as archive:
            index = json.loads(
                read_member(path, archive, "index.json", MAX_INDEX_BYTES, error=CalibrationError)
            )
        value = index.get("data_sha256") if isinstance(index, dict) else None
    except (*READ_ERRORS, ValueError, RecursionError) as exc:
        raise CalibrationError(f"{path}: corrupt stats file ({str(exc)[:200]})") from None
    return value if isinstance(value, str) else None
