"""Stand-in peer: ONNX Runtime's own quantize_static, run through the same hand-off as the peers.

It needs nothing beyond onnxruntime, so the test of benchmarks/peers.py can run a real quantizer
in a real subprocess without any peer venv (the interpreter is qtool's own). Settings: QDQ, uint8
activations, per-channel int8 weights, MinMax, every other option at ORT's default.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _handoff  # noqa: E402


def quantize(fp32: Path, batches: list, out: Path, kind: str) -> dict:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quantize_static(
        str(fp32),
        str(out),
        _handoff.BatchReader(batches),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
    )
    return {
        "api": "onnxruntime.quantization.quantize_static",
        "quant_format": "QDQ",
        "activations": "uint8 asymmetric, per tensor",
        "weights": "int8 symmetric, per channel",
        "calibration": "MinMax",
        "op_types": "ORT default (all it supports)",
    }


if __name__ == "__main__":
    sys.exit(_handoff.main(quantize, ("onnxruntime", "onnxruntime-gpu", "onnx", "numpy")))
