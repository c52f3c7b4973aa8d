"""The stats file: a zip of .npy arrays plus a JSON index, written byte-for-byte reproducibly.

numpy's savez stamps the current time into the zip, so two identical calibrations would differ;
this writer fixes every zip timestamp so the same data gives the same file (checked by tests).
"""

from __future__ import annotations

import io
import json
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
    atomic_write_bytes(path, buffer.getvalue())


def load_stats(path: Path) -> tuple[dict[str, TensorStats], str]:
    """Return the per-tensor stats and the fingerprint of the model they were collected on."""
    if not path.is_file():
        raise CalibrationError(f"{path}: stats file not found (run `qtool calibrate` first)")
    try:
        with zipfile.ZipFile(path) as archive:
            index = json.loads(archive.read("index.json"))
            if index.get("format") != FORMAT:
                raise CalibrationError(f"{path}: not a qtool stats file ({index.get('format')!r})")
            stats = {}
            for entry in index["tensors"]:
                counts = np.load(io.BytesIO(archive.read(entry["counts"])), allow_pickle=False)
                stats[entry["name"]] = TensorStats(
                    entry["name"],
                    float(entry["min"]),
                    float(entry["max"]),
                    float(entry["half_range"]),
                    counts,
                    int(entry["samples"]),
                )
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise CalibrationError(f"{path}: corrupt stats file ({exc})") from None
    return stats, str(index["model_sha256"])


def stats_data_sha256(path: Path) -> str | None:
    """The calibration data fingerprint a stats file records (None for files that have none)."""
    try:
        with zipfile.ZipFile(path) as archive:
            value = json.loads(archive.read("index.json")).get("data_sha256")
    except (zipfile.BadZipFile, KeyError, ValueError, OSError) as exc:
        raise CalibrationError(f"{path}: corrupt stats file ({exc})") from None
    return value if isinstance(value, str) else None
