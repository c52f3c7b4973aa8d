"""AMD Quark's ONNX quantizer (`quark.onnx.ModelQuantizer`) with its CPU config U8S8_AAWS.

U8S8_AAWS is Quark's default config for ONNX Runtime's CPU provider (XINT8/A8W8 are its NPU
configs, with power-of-two or symmetric int8 activations): QDQ, uint8 asymmetric activations,
int8 symmetric weights, percentile calibration; per-channel weights turned on to match the
other tools. The same config for CNNs and transformers.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _handoff  # noqa: E402


def quantize(fp32: Path, batches: list, out: Path, kind: str) -> dict:
    from quark.onnx import ModelQuantizer
    from quark.onnx.quantization.config.config import QConfig

    config = QConfig.get_default_config("U8S8_AAWS")  # a Config of the legacy fields
    config.global_quant_config.per_channel = True
    ModelQuantizer(config).quantize_model(str(fp32), str(out), _handoff.BatchReader(batches))
    g = config.global_quant_config
    return {
        "api": "quark.onnx.ModelQuantizer.quantize_model",
        "config": "U8S8_AAWS",
        "quant_format": str(g.quant_format),
        "activations": f"{g.activation_type} asymmetric, per tensor",
        "weights": f"{g.weight_type} symmetric, per channel",
        "calibration": str(g.calibrate_method),
        "extra_options": {k: str(v) for k, v in (g.extra_options or {}).items()},
    }


if __name__ == "__main__":
    sys.exit(_handoff.main(quantize, ("amd-quark", "onnx", "onnxruntime", "torch", "numpy")))
