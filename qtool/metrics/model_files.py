"""The two model files evaluate compares: their graphs (without weights) and sizes on disk."""

from __future__ import annotations

from pathlib import Path

import onnx

from qtool.errors import ModelError


def read_proto(path: Path) -> onnx.ModelProto:
    """The model graph without its external data (evaluate needs metadata and sizes only)."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for a corrupt file
        raise ModelError(f"cannot read {path}: {exc}") from exc


def model_bytes(path: Path, proto: onnx.ModelProto) -> int:
    """Size on disk including external-data files, so >2 GB models are not reported as tiny."""
    total = path.stat().st_size
    files = set()
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    files.add(path.parent / entry.value)
    for file in files:
        if not file.is_file():
            raise ModelError(f"{path}: external data file {file} does not exist")
        total += file.stat().st_size
    return total
