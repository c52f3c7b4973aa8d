"""`qtool evaluate`: the float and quantized models compared on the evaluation set."""

from __future__ import annotations

from pathlib import Path

from qtool.errors import ModelError
from qtool.metrics.evaluate import EvalResult, evaluate_models


def evaluate(fp32_path: Path, quant_path: Path, batches, **options) -> EvalResult:
    """Evaluate data-source batches (qtool.data.batches.Batch); `options` go to evaluate_models."""
    for path in (fp32_path, quant_path):
        if not Path(path).is_file():
            raise ModelError(f"{path}: model file not found (run `qtool quantize` first)")
    pairs = ((batch.inputs, batch.labels) for batch in batches)
    return evaluate_models(Path(fp32_path), Path(quant_path), pairs, **options)
