"""Intel Neural Compressor for ONNX (`onnx-neural-compressor`): static QDQ quantization.

Its documented static recipe: `StaticQuantConfig` (MinMax calibration, uint8 activations, int8
weights) in QDQ format with per-channel weights; for transformers its `SmoothQuantConfig`
(SmoothQuant, alpha 0.5, folded, then the same static quantization), the recipe its docs give
for transformer/LLM models. Calibration reads every saved batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _handoff  # noqa: E402


def quantize(fp32: Path, batches: list, out: Path, kind: str) -> dict:
    from onnx_neural_compressor import data_reader
    from onnx_neural_compressor.quantization import config
    from onnx_neural_compressor.quantization import quantize as inc_quantize
    from onnxruntime.quantization import QuantFormat

    class Reader(data_reader.CalibrationDataReader):
        def __init__(self) -> None:
            self.rewind()

        def get_next(self):
            return next(self._it, None)

        def rewind(self) -> None:
            self._it = iter(batches)

    samples = _handoff.sample_count(batches)
    common = dict(
        calibration_data_reader=Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        calibration_sampling_size=samples,
        execution_provider="CPUExecutionProvider",
    )
    notes = []
    if kind == "transformer":
        # quantize() runs SmoothQuant only when extra_options says so, whatever the config class
        smooth = {"extra_options": {"SmoothQuant": True}}
        try:
            inc_quantize(str(fp32), str(out), config.SmoothQuantConfig(**common, **smooth))
            algorithm = "SmoothQuantConfig (alpha 0.5, folding) + static QDQ"
        except ValueError as exc:  # its folding into a scalar Mul constant (GELU's 0.5) fails
            notes.append(f"folding=True failed: {exc}"[:200])
            common["calibration_data_reader"].rewind()
            quant_config = config.SmoothQuantConfig(**common, **smooth, folding=False)
            inc_quantize(str(fp32), str(out), quant_config)
            algorithm = "SmoothQuantConfig (alpha 0.5, folding=False) + static QDQ"
    else:
        inc_quantize(str(fp32), str(out), config.StaticQuantConfig(**common))
        algorithm = "StaticQuantConfig"
    return {
        "notes": notes,
        "api": "onnx_neural_compressor.quantization.quantize",
        "config": algorithm,
        "quant_format": "QDQ",
        "activations": "uint8 asymmetric, per tensor (default)",
        "weights": "int8 symmetric, per channel",
        "calibration": "MinMax (default)",
        "op_types": "INC's default QDQ list for the CPU provider",
        "calibration_sampling_size": samples,
    }


if __name__ == "__main__":
    sys.exit(_handoff.main(quantize, ("onnx-neural-compressor", "onnx", "onnxruntime", "numpy")))
