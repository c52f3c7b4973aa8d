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
import math
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.calibration import machine_info, save_json, write_calibration_data, write_recipe
from benchmarks.models import build_cnn, calibration_inputs
from qtool.data import iter_batches
from qtool.ort_session import create_session
from qtool.pipeline import quantize
from qtool.recipe import Recipe, load_recipe

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


def _sqnr(ref: np.ndarray, test: np.ndarray) -> float:
    noise = float(np.sum((ref.astype(np.float64) - test) ** 2))
    signal = float(np.sum(ref.astype(np.float64) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def _cosine(ref: np.ndarray, test: np.ndarray) -> float:
    a = ref.reshape(len(ref), -1).astype(np.float64)
    b = test.reshape(len(test), -1).astype(np.float64)
    dot = np.sum(a * b, axis=1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return float(np.mean(dot / np.maximum(norms, 1e-30)))


def _latency_ms(sessions: list, feed: dict, runs: int) -> list[float]:
    for session in sessions:
        for _ in range(5):
            session.run(None, feed)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(runs):
        for k, session in enumerate(sessions):
            start = time.perf_counter_ns()
            session.run(None, feed)
            times[k].append((time.perf_counter_ns() - start) / 1e6)
    return [float(np.median(t)) for t in times]


def measure(fp32: Path, quant: Path, batches: list, threads: int, runs: int) -> dict:
    reference = create_session(fp32, threads=threads)
    fused = create_session(quant, threads=threads)
    unfused = create_session(quant, threads=threads, optimize=False)
    outputs = {"ref": [], "fused": [], "unfused": []}
    labels = []
    for inputs, label in batches:
        outputs["ref"].append(reference.run(None, inputs)[0])
        outputs["fused"].append(fused.run(None, inputs)[0])
        outputs["unfused"].append(unfused.run(None, inputs)[0])
        if label is not None:
            labels.append(label)
    ref, out_f, out_u = (np.concatenate(outputs[k]) for k in ("ref", "fused", "unfused"))
    row = {
        "sqnr_fused_db": _sqnr(ref, out_f),
        "sqnr_unfused_db": _sqnr(ref, out_u),
        "cosine_fused": _cosine(ref, out_f),
    }
    if labels:
        truth = np.concatenate(labels)
        row["accuracy_fp32"] = float(np.mean(np.argmax(ref, -1) == truth))
        row["accuracy_fused"] = float(np.mean(np.argmax(out_f, -1) == truth))
    feed = {k: np.ascontiguousarray(v[:1]) for k, v in batches[0][0].items()}
    fp32_ms, quant_ms = _latency_ms([reference, fused], feed, runs)
    row.update(fp32_ms=fp32_ms, quant_ms=quant_ms, speedup=fp32_ms / quant_ms)
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
