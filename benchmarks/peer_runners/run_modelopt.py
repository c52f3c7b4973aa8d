"""NVIDIA ModelOpt's ONNX PTQ (`modelopt.onnx.quantization.quantize`), int8, on the CPU provider.

Its defaults for int8: entropy calibration, symmetric int8 activations, per-channel int8 weights,
every operator it supports (made for TensorRT). Two departures, both needed for an ORT-CPU
comparison: `calibration_eps=["cpu"]` (no GPU here) and `high_precision_dtype="fp32"` (its default
converts the rest of the graph to fp16, which ORT's CPU provider does not run natively).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _handoff  # noqa: E402


def quantize(fp32: Path, batches: list, out: Path, kind: str) -> dict:
    from modelopt.onnx.quantization import quantize as mo_quantize

    mo_quantize(
        str(fp32),
        quantize_mode="int8",
        calibration_data_reader=_handoff.BatchReader(batches),
        calibration_eps=["cpu"],
        high_precision_dtype="fp32",
        output_path=str(out),
    )
    return {
        "api": "modelopt.onnx.quantization.quantize",
        "quantize_mode": "int8",
        "calibration_method": "entropy (int8 default)",
        "activations": "int8 symmetric, per tensor",
        "weights": "int8 symmetric, per channel",
        "calibration_eps": ["cpu"],
        "high_precision_dtype": "fp32 (default fp16)",
        "op_types": "default (all supported)",
    }


if __name__ == "__main__":
    packages = ("nvidia-modelopt", "onnx", "onnxruntime", "onnxruntime-gpu", "numpy")
    sys.exit(_handoff.main(quantize, packages))
