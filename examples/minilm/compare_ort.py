"""ONNX Runtime's quantize_static on the float model qtool wrote, judged like qtool's (README).

Same float graph (`model.fp32.onnx` from a qtool run of a MiniLM recipe), the same calibration
batches (qtool's reader, in equal batches: ORT's percentile calibrator needs them) and the same
98 evaluation sentences through `qtool.metrics.evaluate.evaluate_models`. ORT's settings are those
of
benchmarks/accuracy.py (QDQ, uint8 activations, int8 per-channel weights); `--gather` adds Gather
to its op types so that it quantizes the embedding tables too, as the qtool recipes here do.
ORT's own SmoothQuant option needs Intel Neural Compressor, which this environment lacks.

    PYTHONPATH=$PWD python examples/minilm/compare_ort.py \
        examples/minilm/recipe-int8-smoothquant.yaml --gather
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.accuracy import calibration_batches, equal_batch_size, evaluation_pairs, run_ort
from qtool.config.recipe import load_recipe
from qtool.metrics.evaluate import evaluate_models


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
        # ORT's symbolic shape inference fails on the opset-21 graph int8 tables need.
        model = run_ort(
            fp32, batches, method, op_types, args.out / method, skip_symbolic_shape=True
        )
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
