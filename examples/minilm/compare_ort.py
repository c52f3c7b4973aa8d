"""ONNX Runtime's quantize_static on the float model qtool wrote, judged like qtool's (README).

Same float graph (`model.fp32.onnx` from a qtool run of a MiniLM recipe), the same calibration
batches (qtool's reader, in equal batches: ORT's percentile calibrator needs them) and the same
98 evaluation sentences through `qtool.evaluate.evaluate_models`. ORT's settings are those of
benchmarks/accuracy.py (QDQ, uint8 activations, int8 per-channel weights); `--gather` adds Gather
to its op types so that it quantizes the embedding tables too, as the qtool recipes here do.
ORT's own SmoothQuant option needs Intel Neural Compressor, which this environment lacks.

    PYTHONPATH=$PWD python examples/minilm/compare_ort.py \
        examples/minilm/recipe-int8-smoothquant.yaml --gather
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from benchmarks.accuracy import PERCENTILE, calibration_batches, equal_batch_size, evaluation_pairs
from qtool.evaluate import evaluate_models
from qtool.recipe import load_recipe


def run_ort(fp32: Path, batches: list, method: str, op_types: list[str], out: Path) -> Path:
    """benchmarks/accuracy.py's ORT flow, but quant_pre_process without ORT's symbolic shape
    inference, which fails on the opset-21 graph (an Expand) that int8 tables need."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(batches)

        def get_next(self) -> dict | None:
            batch = next(self._it, None)
            return None if batch is None else batch.inputs

    calibrate_method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[method]
    extra = {"CalibPercentile": PERCENTILE} if method == "percentile" else {}
    out.mkdir(parents=True, exist_ok=True)
    pre, model = out / "model.preprocessed.onnx", out / "model.int8.onnx"
    with open(out / "ort.log", "w") as log, contextlib.redirect_stdout(log):
        quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
        quantize_static(
            str(pre),
            str(model),
            Reader(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=op_types,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=calibrate_method,
            extra_options=extra,
        )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path, help="a MiniLM recipe already run by qtool quantize")
    parser.add_argument("--methods", default="minmax,entropy,percentile")
    parser.add_argument("--gather", action="store_true", help="also quantize Gather (tables)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/minilm-ort"))
    args = parser.parse_args()
    recipe = load_recipe(args.recipe)
    fp32 = recipe.float_model_path
    if not fp32.is_file():
        raise SystemExit(f"{fp32}: not found; run `qtool quantize {args.recipe}` first")
    samples = sum(len(b) for b in calibration_batches(recipe, recipe.calibration.batch_size))
    batches = calibration_batches(recipe, equal_batch_size(samples, recipe.calibration.batch_size))
    op_types = ["MatMul", "Gemm"] + (["Gather"] if args.gather else [])
    rows = []
    for method in args.methods.split(","):
        start = time.perf_counter()
        model = run_ort(fp32, batches, method, op_types, args.out / method)
        seconds = time.perf_counter() - start
        result = evaluate_models(
            fp32, model, evaluation_pairs(recipe), latency_runs=5, progress=False
        )
        gated = result.to_dict()["outputs"][0]
        rows.append(
            {
                "method": method,
                "op_types": op_types,
                "quantize_s": round(seconds, 1),
                "file_mb": round(model.stat().st_size / 1e6, 2),
                "cosine_fused": gated["fused"]["cosine"],
                "cosine_unfused": gated["unfused"]["cosine"],
                "sqnr_db_fused": gated["fused"]["sqnr_db"],
            }
        )
        print(json.dumps(rows[-1]))
    (args.out / "results.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
