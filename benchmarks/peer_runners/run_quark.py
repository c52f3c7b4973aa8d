"""AMD Quark's ONNX quantizer (`quark.onnx.ModelQuantizer`) with its named default configs.

CNNs: U8S8_AAWS, Quark's config for ONNX Runtime's CPU provider (XINT8/A8W8 are its NPU
configs, with power-of-two or symmetric int8 activations): QDQ, uint8 asymmetric activations,
int8 symmetric weights, percentile calibration, every op type it can quantize. Transformers:
INT8_TRANSFORMER_DEFAULT, its named transformer default (MinMax with a moving average, uint8
activations, int8 weights, its transformer quantization scheme). Per-channel weights turned on
for CNNs, to match the other tools; Quark 0.13's transformer quantizer fails with them, so its
transformer weights stay per tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _handoff  # noqa: E402


def quantize(fp32: Path, batches: list, out: Path, kind: str) -> dict:
    from quark.onnx import ModelQuantizer
    from quark.onnx.quantization.config.config import QConfig

    name = "INT8_TRANSFORMER_DEFAULT" if kind == "transformer" else "U8S8_AAWS"
    config = QConfig.get_default_config(name)  # a Config of the legacy fields
    # Quark 0.13's transformer quantizer has no per-channel path (AttributeError:
    # 'TransformerQDQQuantizer' object has no attribute 'quantize_weight_per_channel').
    per_channel = kind != "transformer"
    config.global_quant_config.per_channel = per_channel
    ModelQuantizer(config).quantize_model(str(fp32), str(out), _handoff.BatchReader(batches))
    g = config.global_quant_config
    return {
        "api": "quark.onnx.ModelQuantizer.quantize_model",
        "config": name,
        "quant_format": str(g.quant_format),
        "activations": f"{g.activation_type} asymmetric, per tensor",
        "weights": f"{g.weight_type} symmetric, per {'channel' if per_channel else 'tensor'}",
        "calibration": str(g.calibrate_method),
        "extra_options": {k: str(v) for k, v in (g.extra_options or {}).items()},
        "enable_npu_transformer": bool(getattr(g, "enable_npu_transformer", False)),
    }


if __name__ == "__main__":
    sys.exit(_handoff.main(quantize, ("amd-quark", "onnx", "onnxruntime", "torch", "numpy")))
