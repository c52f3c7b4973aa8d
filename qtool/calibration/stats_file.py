"""The stats file: a zip of .npy arrays plus a JSON index, written byte-for-byte reproducibly.

numpy's savez stamps the current time into the zip, so two identical calibrations would differ;
this writer fixes every zip timestamp so the same data gives the same file (checked by tests).
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from pathlib import Path

import numpy as np

from qtool.calibration.archive import write_member
from qtool.calibration.observers import TensorStats
from qtool.errors import CalibrationError
from qtool.io import atomic_write_bytes

FORMAT = "qtool-stats/1"


def save_stats(
    path: Path,
    stats: list[TensorStats],
    model_fingerprint: str,
    bins: int,
    data_sha256: str | None = None,
) -> None:
    """`data_sha256` fingerprints the calibration batches, for the quantized model's provenance."""
    atomic_write_bytes(path, stats_file_bytes(stats, model_fingerprint, bins, data_sha256))


def stats_file_bytes(
    stats: list[TensorStats],
    model_fingerprint: str,
    bins: int,
    data_sha256: str | None = None,
) -> bytes:
    """The stats file's content, for callers that commit it together with other outputs."""
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

    Every tensor's entry is checked against what the observers write, because the range methods
    trust it: a histogram of another length would be read at the wrong bin width, and a NaN range
    would become a NaN scale in the model.
    """
    if not path.is_file():
        raise CalibrationError(f"{path}: stats file not found (run `qtool calibrate` first)")
    try:
        with zipfile.ZipFile(path) as archive:
            index = json.loads(archive.read("index.json"))
            if not isinstance(index, dict) or index.get("format") != FORMAT:
                found = index.get("format") if isinstance(index, dict) else None
                raise CalibrationError(f"{path}: not a qtool stats file ({found!r})")
            bins = index["bins"]
            if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2 or bins % 2:
                raise CalibrationError(f"{path}: index bins must be an even integer, got {bins!r}")
            stats = {}
            for entry in index["tensors"]:
                counts = np.load(io.BytesIO(archive.read(entry["counts"])), allow_pickle=False)
                tensor = _checked_tensor(path, entry, counts, bins)
                stats[tensor.name] = tensor
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError) as exc:
        raise CalibrationError(
            f"{path}: corrupt stats file ({type(exc).__name__}: {exc})"
        ) from None
    return stats, str(index["model_sha256"])


def _checked_tensor(path: Path, entry: dict, counts: np.ndarray, bins: int) -> TensorStats:
    """One index entry as TensorStats, refused unless it is what HistogramObserver.result() makes:
    2 * bins non-negative integer counts over [-R, R], finite min <= max inside it, samples >= 1."""
    name = str(entry["name"])

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
    if counts.ndim != 1 or counts.shape[0] != expected:
        raise fail(
            f"histogram has shape {list(counts.shape)}, but the file's bins ({bins}) make "
            f"{expected} bins"
        )
    if counts.dtype.kind not in "iu" or (counts < 0).any():
        raise fail(f"histogram counts must be non-negative integers, got dtype {counts.dtype}")
    samples = entry["samples"]
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise fail(f"samples must be a positive integer, got {samples!r}")
    return TensorStats(name, low, high, half_range, counts.astype(np.int64), samples)


def stats_data_sha256(path: Path) -> str | None:
    """The calibration data fingerprint a stats file records (None for files that have none)."""
    try:
        with zipfile.ZipFile(path) as archive:
            value = json.loads(archive.read("index.json")).get("data_sha256")
    except (zipfile.BadZipFile, KeyError, ValueError, OSError) as exc:
        raise CalibrationError(f"{path}: corrupt stats file ({exc})") from None
    return value if isinstance(value, str) else None
