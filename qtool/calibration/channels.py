"""Per-input-channel statistics of MatMul/Gemm inputs, and their file (SmoothQuant's data).

SmoothQuant needs, for each layer input X [..., K], the per-channel extremes over every
calibration row (every leading dimension is a row) and a few rows of X itself, to search the
migration strength per layer. `ChannelObserver` collects both in the calibration pass
(`collect(..., channel_observers=...)`), in memory bounded by K and the sample size, never by the
number of calibration samples:

- min and max per channel (float32, exact whatever the batch size or order). Both, not just
  max |x|: the range of X / s for any positive s is then exactly [min_j(min_j / s_j),
  max_j(max_j / s_j)], which is what lets quantize take the smoothed input's min-max range from
  the unsmoothed model's single calibration pass.
- a uniform sample of `rows` rows without replacement (none when `rows` is 0; SmoothQuant now
  scores alpha on the tuning rows and asks for none): row r of the stream (counted across
  batches) is kept when its priority splitmix64(r) is among the `rows` smallest seen. The
  priority depends only on r, so the sample is the same for any batch size, and it spreads over
  the whole calibration set (the first rows of a padded transformer batch are one sentence and
  its padding).

The file (`channels.npz` beside the stats file) is a zip of .npy members plus a JSON index,
byte-for-byte reproducible like the stats and Hessian files, keyed by the prepared model's
SHA-256 and validated member by member on load.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qtool.calibration.archive import load_entries, write_member
from qtool.errors import CalibrationError, DataError
from qtool.io import atomic_write_bytes
from qtool.zip_members import MAX_NPY_HEADER_BYTES, NpyMember

FORMAT = "qtool-channels/1"
FILE_NAME = "channels.npz"
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def channels_path(stats_path: Path) -> Path:
    """Where the per-channel file of a stats file lives: beside it."""
    return Path(stats_path).parent / FILE_NAME


def _splitmix64(index: np.ndarray) -> np.ndarray:
    """A bijection on uint64 (Steele et al.'s SplitMix64 finaliser): distinct rows get distinct
    priorities, so the kept sample never depends on how ties are broken."""
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _MASK64


@dataclass
class ChannelStats:
    """One tensor's per-channel extremes, its row count and the sampled rows (float32)."""

    name: str
    minimum: np.ndarray  # [K]
    maximum: np.ndarray  # [K]
    rows: int
    sample: np.ndarray  # [n, K], n <= rows, in stream order
    sample_index: np.ndarray  # int64 [n]: each sampled row's position in the stream

    @property
    def channels(self) -> int:
        return int(self.minimum.shape[0])

    @property
    def absmax(self) -> np.ndarray:
        """max |x| per channel: SmoothQuant's activation statistic."""
        return np.maximum(np.abs(self.minimum), np.abs(self.maximum))


class ChannelObserver:
    """Running per-channel min/max and a bounded row sample of one tensor [..., K]."""

    def __init__(self, name: str, rows: int) -> None:
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        self.name = name
        self.keep = rows
        self.minimum: np.ndarray | None = None
        self.maximum: np.ndarray | None = None
        self.rows = 0
        self._sample = np.zeros((0, 0), np.float32)
        self._index = np.zeros(0, np.int64)
        self._priority = np.zeros(0, np.uint64)

    def update(self, values: np.ndarray) -> None:
        values = np.asarray(values)
        if values.ndim == 0 or values.shape[-1] < 1:
            raise CalibrationError(
                f"tensor '{self.name}' has shape {values.shape}; per-channel statistics need an "
                "input [..., K]"
            )
        flat = values.reshape(-1, values.shape[-1])
        if flat.shape[0] == 0:
            return
        if self.minimum is not None and flat.shape[1] != self.minimum.shape[0]:
            raise DataError(
                f"tensor '{self.name}': expected last dimension {self.minimum.shape[0]}, got "
                f"shape {values.shape}"
            )
        low = flat.min(axis=0).astype(np.float32)
        high = flat.max(axis=0).astype(np.float32)
        if not (np.all(np.isfinite(low)) and np.all(np.isfinite(high))):
            raise DataError(f"tensor '{self.name}' contains NaN or Inf")
        if self.minimum is None:
            self.minimum, self.maximum = low, high
            self._sample = np.zeros((0, flat.shape[1]), np.float32)
        else:
            self.minimum = np.minimum(self.minimum, low)
            self.maximum = np.maximum(self.maximum, high)
        self._sample_rows(flat)
        self.rows += flat.shape[0]

    def _sample_rows(self, flat: np.ndarray) -> None:
        if self.keep == 0:  # min/max only
            return
        index = np.arange(self.rows, self.rows + flat.shape[0], dtype=np.int64)
        priority = _splitmix64(index)
        if self._priority.size >= self.keep:  # only rows that beat the current worst can enter
            candidates = priority < self._priority.max()
            index, priority = index[candidates], priority[candidates]
        if index.size == 0:
            return
        rows = np.asarray(flat[index - self.rows], dtype=np.float32)
        priority = np.concatenate([self._priority, priority])
        index = np.concatenate([self._index, index])
        sample = np.concatenate([self._sample, rows])
        if priority.size > self.keep:
            chosen = np.argpartition(priority, self.keep - 1)[: self.keep]
            priority, index, sample = priority[chosen], index[chosen], sample[chosen]
        order = np.argsort(index, kind="stable")
        self._priority, self._index, self._sample = priority[order], index[order], sample[order]

    def result(self) -> ChannelStats:
        if self.minimum is None or self.maximum is None or self.rows == 0:
            raise CalibrationError(f"tensor '{self.name}' received no calibration data")
        return ChannelStats(
            self.name,
            self.minimum.copy(),
            self.maximum.copy(),
            self.rows,
            np.ascontiguousarray(self._sample),
            self._index.copy(),
        )


def save_channels(
    path: Path, stats: dict[str, ChannelStats], model_fingerprint: str, data_sha256: str | None
) -> None:
    atomic_write_bytes(path, channel_file_bytes(stats, model_fingerprint, data_sha256))


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def channel_file_bytes(
    stats: dict[str, ChannelStats], model_fingerprint: str, data_sha256: str | None = None
) -> bytes:
    """The file's bytes, tensors sorted by name so they do not depend on dict order."""
    names = sorted(stats)
    index = {
        "format": FORMAT,
        "model_sha256": model_fingerprint,
        "data_sha256": data_sha256,
        "tensors": [
            {
                "name": name,
                "channels": stats[name].channels,
                "rows": stats[name].rows,
                "sample_rows": int(stats[name].sample.shape[0]),
                "member": f"tensor_{i}",
            }
            for i, name in enumerate(names)
        ],
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        write_member(archive, "index.json", json.dumps(index, indent=1, sort_keys=True).encode())
        for i, name in enumerate(names):
            entry = stats[name]
            for part, array in (
                ("min", entry.minimum),
                ("max", entry.maximum),
                ("sample", entry.sample),
                ("sample_index", entry.sample_index),
            ):
                write_member(archive, f"tensor_{i}_{part}.npy", _npy(array), zipfile.ZIP_STORED)
    return buffer.getvalue()


def _array(
    path: Path,
    archive: zipfile.ZipFile,
    member: str,
    name: str,
    part: str,
    dtype: type,
    shape: tuple[int, ...],
) -> np.ndarray:
    """One part of a tensor's entry, its size and .npy header checked against what the index
    says (`dtype`, `shape`) before its data is read."""
    limit = MAX_NPY_HEADER_BYTES + math.prod(shape) * np.dtype(dtype).itemsize
    where = f"tensor {name!r}: "
    with NpyMember(path, archive, member, where, limit=limit, error=CalibrationError) as npy:
        if npy.dtype != dtype or npy.shape != shape:
            raise CalibrationError(
                f"{path}: tensor {name!r}: {part} is {npy.dtype} {npy.shape}, expected "
                f"{np.dtype(dtype)} {shape} (member {member!r})"
            )
        return npy.read()


def _read_entry(path: Path, archive: zipfile.ZipFile, entry: object) -> ChannelStats:
    name = entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str):
        raise CalibrationError(f"{path}: corrupt channel file (a tensor entry without a name)")
    channels, rows = entry.get("channels"), entry.get("rows")
    sample_rows, member = entry.get("sample_rows"), entry.get("member")
    counts = (channels, rows, sample_rows)
    if any(type(v) is not int for v in counts) or channels < 1 or rows < 1 or sample_rows < 0:
        raise CalibrationError(
            f"{path}: tensor {name!r}: channels {channels!r}, rows {rows!r} and sample_rows "
            f"{sample_rows!r} must be positive integers"
        )
    if sample_rows > rows:
        raise CalibrationError(f"{path}: tensor {name!r}: samples more rows than it counts")
    if not isinstance(member, str):
        raise CalibrationError(f"{path}: tensor {name!r}: no array member named")
    expected = {
        "min": (np.float32, (channels,)),
        "max": (np.float32, (channels,)),
        "sample": (np.float32, (sample_rows, channels)),
        "sample_index": (np.int64, (sample_rows,)),
    }
    arrays = {
        part: _array(path, archive, f"{member}_{part}.npy", name, part, dtype, shape)
        for part, (dtype, shape) in expected.items()
    }
    low, high, sample, where = (arrays[p] for p in ("min", "max", "sample", "sample_index"))
    for part in ("min", "max", "sample"):
        if not np.all(np.isfinite(arrays[part])):
            raise CalibrationError(f"{path}: tensor {name!r}: {part} contains NaN or Inf")
    if np.any(low > high):
        raise CalibrationError(f"{path}: tensor {name!r}: a channel's min exceeds its max")
    if sample_rows and (np.any(sample < low) or np.any(sample > high)):
        raise CalibrationError(f"{path}: tensor {name!r}: sampled rows fall outside min/max")
    if sample_rows and (np.any(np.diff(where) <= 0) or where[0] < 0 or where[-1] >= rows):
        raise CalibrationError(
            f"{path}: tensor {name!r}: sample row positions must increase within [0, rows)"
        )
    return ChannelStats(name, low, high, rows, sample, where)


def load_channels(
    path: Path, model_fingerprint: str, data_sha256: str | None = None
) -> dict[str, ChannelStats]:
    """The per-channel statistics of a file collected on the model with `model_fingerprint`
    (and, when `data_sha256` is given, on the calibration data the stats file records)."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(
            f"{path}: per-channel statistics not found (SmoothQuant needs the file `qtool "
            "calibrate` writes with this recipe; re-run it)"
        )

    def read(archive: zipfile.ZipFile, index: dict, entry: object) -> ChannelStats:
        return _read_entry(path, archive, entry)

    return load_entries(path, "channel", FORMAT, model_fingerprint, read, data_sha256)
