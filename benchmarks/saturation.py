"""Weight formats for CPUs without VNNI, side by side: accuracy fused and unfused, and speed.

On x86 without VNNI, ONNX Runtime's fused uint8 x int8 kernels add pairs of products in saturating
16-bit sums (qtool/quantize/weight_format.py). This benchmark quantizes each model once per
`quantization.saturation` policy with `quantization.cpu: avx2` — so the formats are the ones an
AVX2 deployment gets, whatever CPU runs the benchmark — and measures, in one run:

- output SQNR of the quantized model against FP32, fused (ORT_ENABLE_ALL, what deploys) and
  unfused (ORT_DISABLE_ALL, the QDQ semantics), plus top-1 accuracy or embedding cosine;
- batch-1 latency of FP32 and of the fused quantized model, interleaved, as a speed-up.

Only a CPU without VNNI shows the saturation itself (fused far below unfused for `ignore`); the
machine is printed with the table and stored in the JSON.

    python -m benchmarks.saturation --models digits,cnn,minilm
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.calibration import machine_info, save_json, write_calibration_data, write_recipe
from benchmarks.models import build_cnn, calibration_inputs
from qtool.app.quantize import quantize
from qtool.config.recipe import Recipe, load_recipe
from qtool.data.batches import iter_batches
from qtool.metrics.evaluate import evaluate_models

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
POLICIES = ("ignore", "pair-safe", "reduce-range", "uint8-weights")
FORMAT_OF = {
    "ignore": "s8",
    "pair-safe": "s8-pairsafe",
    "reduce-range": "s7",
    "uint8-weights": "u8",
}
MODELS = ("digits", "cnn", "minilm")


def _recipe_for(name: str, work: Path) -> tuple[Recipe, list[tuple[dict, np.ndarray | None]]]:
    """The model's recipe and its evaluation batches (inputs, labels or None)."""
    if name in ("digits", "minilm"):
        recipe = load_recipe(REPO / "examples" / name / "recipe.yaml", work / name)
        spec = recipe.evaluation
        batches = iter_batches(spec.data, recipe.inputs, spec.batch_size, None, recipe.seed)
        return recipe, [(b.inputs, b.labels) for b in batches]
    model = build_cnn(work / "models", small=False)
    data = write_calibration_data(model, [64], work / "data")[64]
    recipe = load_recipe(write_recipe(model, data, "entropy", work / name), None)
    held_out = calibration_inputs(model, 32, seed=1)
    batches = [({k: v[i : i + 8] for k, v in held_out.items()}, None) for i in range(0, 32, 8)]
    return recipe, batches


def _with_policy(recipe: Recipe, policy: str, out: Path) -> Recipe:
    spec = dataclasses.replace(recipe.quantization, cpu="avx2", saturation=policy)
    return dataclasses.replace(recipe, quantization=spec, output_dir=out)


def measure(fp32: Path, quant: Path, batches: list, threads: int, runs: int) -> dict:
    """qtool's own evaluation: fused and unfused in one pass, latency of FP32 vs fused."""
    result = evaluate_models(
        fp32, quant, batches, threads=threads, latency_runs=runs, progress=False
    )
    first = result.outputs[0]
    row = {
        "sqnr_fused_db": first.fused.sqnr_db,
        "sqnr_unfused_db": first.unfused.sqnr_db,
        "cosine_fused": first.fused.cosine,
        "fp32_ms": result.fp32.latency_ms_median,
        "quant_ms": result.quant.latency_ms_median,
        "speedup": result.speedup(),
    }
    if first.fused.accuracy is not None:
        row["accuracy_fp32"] = first.fp32_accuracy
        row["accuracy_fused"] = first.fused.accuracy
    return row


def run(models: list[str], threads: int, runs: int, work: Path) -> list[dict]:
    rows = []
    for name in models:
        recipe, batches = _recipe_for(name, work)
        stats = None
        for policy in POLICIES:
            variant = _with_policy(recipe, policy, work / name / policy)
            start = time.process_time()
            result = quantize(variant, stats, progress=False)
            seconds = time.process_time() - start
            stats = Path(result.report["files"]["stats"])  # calibrate once per model
            fp32 = Path(result.report["files"]["float_model"])
            row = {"model": name, "policy": policy, "format": FORMAT_OF[policy]}
            row["weight_formats"] = result.report["summary"]["weight_formats"]
            row["quantize_cpu_s"] = seconds
            row.update(measure(fp32, result.model_path, batches, threads, runs))
            rows.append(row)
            print(
                f"{name:7s} {policy:14s} fused {row['sqnr_fused_db']:6.2f} dB  "
                f"unfused {row['sqnr_unfused_db']:6.2f} dB  speed-up {row['speedup']:.2f}x"
            )
    return rows


def print_table(console: Console, rows: list[dict], machine: dict) -> None:
    table = Table(title=f"Weight formats for CPUs without VNNI (measured on {machine['cpu']})")
    for column in (
        "model",
        "saturation",
        "formats written",
        "SQNR fused",
        "SQNR unfused",
        "accuracy / cosine (fused)",
        "speed-up vs FP32",
    ):
        table.add_column(column, justify="left" if column in ("model", "saturation") else "right")
    for row in rows:
        quality = (
            f"{row['accuracy_fused'] * 100:.2f}%"
            if "accuracy_fused" in row
            else f"{row['cosine_fused']:.4f}"
        )
        formats = ", ".join(f"{k} {v}" for k, v in row["weight_formats"].items())
        table.add_row(
            row["model"],
            row["policy"],
            formats,
            f"{row['sqnr_fused_db']:.1f} dB",
            f"{row['sqnr_unfused_db']:.1f} dB",
            quality,
            f"{row['speedup']:.2f}x",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=100, help="latency runs per model")
    parser.add_argument("--json", type=Path, default=RESULTS / "saturation.json")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    with tempfile.TemporaryDirectory(prefix="qtool-saturation-") as tmp:
        rows = run(models, args.threads, args.runs, Path(tmp))
    machine = machine_info()
    print_table(Console(), rows, machine)
    save_json({"machine": machine, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
