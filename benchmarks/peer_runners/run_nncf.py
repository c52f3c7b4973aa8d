"""NNCF's ONNX backend (`nncf.quantize` on an onnx.ModelProto; needs only onnx + onnxruntime).

Its documented recommendation per model type: CNNs with the default preset (PERFORMANCE:
symmetric int8 activations and weights, per-channel weights) and fast bias correction (on by
default); transformers with `model_type=nncf.ModelType.TRANSFORMER`, which switches to the MIXED
preset (asymmetric activations) and turns on its SmoothQuant. `subset_size` = every calibration
sample, fed one sample per item (NNCF counts items).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _handoff  # noqa: E402


def quantize(fp32: Path, batches: list, out: Path, kind: str) -> dict:
    import nncf
    import onnx

    samples = _handoff.split_samples(batches)
    model = onnx.load(str(fp32))
    options: dict = {"subset_size": len(samples)}
    if kind == "transformer":
        options["model_type"] = nncf.ModelType.TRANSFORMER
    quantized = nncf.quantize(model, nncf.Dataset(samples), **options)
    onnx.save(quantized, str(out))
    return {
        "api": "nncf.quantize (ONNX backend)",
        "model_type": "TRANSFORMER" if kind == "transformer" else "default (None)",
        "preset": "MIXED (TRANSFORMER's default)" if kind == "transformer" else "PERFORMANCE",
        "activations": "int8/uint8 per tensor (preset)",
        "weights": "int8 symmetric, per channel (NNCF default)",
        "calibration": "NNCF default range estimators",
        "fast_bias_correction": True,
        "subset_size": len(samples),
        "target_device": "ANY (default)",
    }


if __name__ == "__main__":
    sys.exit(_handoff.main(quantize, ("nncf", "onnx", "onnxruntime", "numpy")))
