"""Where the float model comes from: an ONNX file or a PyTorch factory plus weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    onnx: Path | None = None
    pytorch: str | None = None  # "path/to/file.py:factory" with the path resolved
    weights: Path | None = None
    opset: int = 17
