"""Provenance: which float model, recipe and calibration data a quantized model came from.

`qtool evaluate --fp32 A --quant B` compares whatever two files it is given; a quantized model from
another float model prints a 97.78% -> 12.78% "drop" that is really a mix-up. The writer stamps
these keys into the quantized model's metadata_props and evaluate checks them.

The calibration data key holds the stats file's `data_sha256`: a multiset fingerprint of the
samples (calibration/data_digest.py), so a run split over processes, machines or shard files
records the value a single process records over the same samples, whatever the batch size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx

VERSION = "qtool.version"
FLOAT_MODEL_SHA256 = "qtool.float_model_sha256"  # model.fp32.onnx beside it (+ its .data)
SOURCE_MODEL_SHA256 = "qtool.source_model_sha256"  # the model as loaded, before preparation
# Its size: the user's ONNX file (+ external data), or a PyTorch model as exported. Sizes are
# reported against it: the prepared model.fp32.onnx may differ (a tied table stored twice by
# an exporter is stored once there, so a ratio against it would understate or overstate).
SOURCE_MODEL_BYTES = "qtool.source_model_bytes"
RECIPE_SHA256 = "qtool.recipe_sha256"
CALIBRATION_DATA_SHA256 = "qtool.calibration_data_sha256"
KEYS = (
    VERSION,
    FLOAT_MODEL_SHA256,
    SOURCE_MODEL_SHA256,
    SOURCE_MODEL_BYTES,
    RECIPE_SHA256,
    CALIBRATION_DATA_SHA256,
)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Streamed, so a multi-GB model is never read into memory at once."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_model(path: Path, model: onnx.ModelProto | None = None) -> str:
    """A model's SHA-256 over its file and the external data files it references (what the stats
    fingerprint of a model over 2 GB is): sha256_file(path) for a model without external data.
    `model`: the file's proto when already read (without external data)."""
    from qtool.model.external_data import model_sha256

    return model_sha256(path, model)


def stamp(model: onnx.ModelProto, values: dict[str, str]) -> None:
    """Set qtool's keys in metadata_props (replacing earlier ones), in the fixed KEYS order."""
    kept = [p for p in model.metadata_props if p.key not in KEYS]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key in KEYS:
        if key in values:
            entry = model.metadata_props.add()
            entry.key, entry.value = key, values[key]


def source_bytes(recorded: dict[str, str]) -> int | None:
    """The source model's size a quantized model records (None: written before qtool did)."""
    value = recorded.get(SOURCE_MODEL_BYTES)
    return int(value) if value is not None and value.isdigit() else None


def read(model: onnx.ModelProto) -> dict[str, str]:
    """qtool's provenance keys present in a model (empty for models qtool did not write)."""
    return {p.key: p.value for p in model.metadata_props if p.key in KEYS}
