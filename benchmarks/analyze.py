"""Sensitivity analysis cost and automatic mixed precision, per model, in one run.

    python -m benchmarks.analyze --models digits,cnn,minilm

For each model, the mixed-precision stage of `qtool quantize --auto` runs on a fresh output
folder (nothing cached): the one-at-a-time analysis (seconds per node and in total), the knapsack,
verify and promote. Then the float model, the all-int8 model, the int4 model (int8 where int4 is
not a candidate) and the chosen plan are compared: the budget's metric on the evaluation set,
file size, and batch-1 latency (`qtool evaluate`'s timing loop, sessions alternated).

`--objective latency` minimises the profiled per-node time instead of the bytes (digits and
minilm then run their recipe-auto-latency.yaml); the table gives each plan's speed vs float and
vs all-int8 either way.

- digits: examples/digits/recipe-auto.yaml (accuracy within 0.5 points, int4/int8/float);
- minilm: examples/minilm/recipe-auto.yaml (cosine >= 0.99; needs `qtool[minilm]`);
- cnn: the ResNet-18 of benchmarks/calibration.py at 224x224, random weights, N(0, 1) inputs
  (64 to calibrate, 32 held out), opset 17 (int8/float), cosine >= 0.999 (random weights make
  top-1 meaningless).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from benchmarks.calibration import machine_info, write_calibration_data, write_recipe
from benchmarks.models import build_cnn, calibration_inputs
from qtool.app import settings
from qtool.app.common import prepare
from qtool.config.recipe import Recipe, load_recipe
from qtool.ort.sessions import create_session
from qtool.runtime.latency import measure_latency
from qtool.search.mixed import search
from qtool.search.spec import MixedPrecisionSpec

REPO = Path(__file__).resolve().parent.parent
MODELS = ("digits", "cnn", "minilm")
CNN_MIN_COSINE = 0.999


def _recipe(name: str, work: Path, objective: str = "size") -> Recipe:
    out = work / name
    if name in ("digits", "minilm"):
        file = "recipe-auto.yaml" if objective == "size" else f"recipe-auto-{objective}.yaml"
        return load_recipe(REPO / "examples" / name / file, out)
    model = build_cnn(work / "models", small=False)
    data = write_calibration_data(model, [64], work / "data")[64]
    held_out = work / "data" / "cnn_eval.npz"
    np.savez(held_out, **calibration_inputs(model, 32, seed=1))
    path = write_recipe(model, data, "entropy", out)
    raw = yaml.safe_load(path.read_text())
    raw["evaluation"] = {"data": {"npz": str(held_out)}, "batch_size": 8}
    raw["mixed_precision"] = {
        "objective": objective,
        "budget": {"min_cosine": CNN_MIN_COSINE},
        "samples": 16,
    }
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_recipe(path, out)


def _feed(recipe: Recipe) -> dict[str, np.ndarray]:
    from qtool.data.batches import iter_batches

    spec = recipe.evaluation
    batch = next(iter(iter_batches(spec.data, recipe.inputs, 1, 1, recipe.seed)))
    return batch.inputs


def run_model(
    name: str, work: Path, threads: int, runs: int, console: Console, objective: str = "size"
) -> dict:
    recipe = _recipe(name, work, objective)
    start = time.perf_counter()
    prepared = prepare(recipe)
    outcome = search(
        prepared,
        settings.job(recipe),
        recipe.mixed_precision or MixedPrecisionSpec(),
        None,
        progress=False,
        console=console,
        keep_models=True,
    )
    seconds = time.perf_counter() - start
    block = outcome.block
    order = [k for k in ("float", "int8", "int4", "chosen") if k in outcome.models]
    sessions = [create_session(outcome.models[k], threads=threads) for k in order]
    timings = measure_latency(sessions, _feed(recipe), runs)
    nodes = len(block["nodes"])
    metrics = {k: block["references"][k]["metric"] for k in block["references"]}
    metrics["chosen"] = block["measured"]["metric"]
    rows = {
        key: {
            "size_bytes": len(outcome.models[key]),
            "metric": metrics[key],
            "latency_ms_median": timings[i][0],
            "latency_ms_p90": timings[i][1],
        }
        for i, key in enumerate(order)
    }
    return {
        "model": name,
        "recipe": str(recipe.path),
        "objective": objective,
        "passed": block["passed"],
        "budget": block["budget"],
        "metric": block["metric"]["name"],
        "analysis": {
            "nodes": nodes,
            "samples": block["analysis"]["samples"],
            "candidates": block["analysis"]["candidates"],
            "seconds": block["analysis"]["seconds"],
            "seconds_per_node": block["analysis"]["seconds"] / max(nodes, 1),
        },
        "iterations": len(block["iterations"]),
        "counts": block["counts"],
        "stage_seconds": seconds,
        "threads": threads,
        "latency_runs": runs,
        "rows": rows,
    }


def _metric(name: str, value: float) -> str:
    return f"{value:.2f}%" if name in ("accuracy", "agreement") else f"{value:.5f}"


def print_tables(console: Console, results: list[dict], machine: dict) -> None:
    cost = Table(title=f"Analysis cost (one-at-a-time, measured on {machine['cpu']})")
    for column in ("model", "nodes", "samples", "candidates", "total s", "s per node", "plans"):
        cost.add_column(column, justify="left" if column == "model" else "right")
    for r in results:
        a = r["analysis"]
        cost.add_row(
            r["model"],
            str(a["nodes"]),
            str(a["samples"]),
            ",".join(a["candidates"]),
            f"{a['seconds']:.1f}",
            f"{a['seconds_per_node']:.2f}",
            str(r["iterations"]),
        )
    console.print(cost)
    plans = Table(title="Mixed precision vs uniform plans (batch-1 latency; speed vs float, int8)")
    for column in ("model", "plan", "metric", "size", "latency ms", "vs float", "vs int8"):
        plans.add_column(column, justify="left" if column in ("model", "plan") else "right")
    for r in results:
        base = r["rows"]["float"]["latency_ms_median"]
        int8 = r["rows"].get("int8", {}).get("latency_ms_median")
        for key, row in r["rows"].items():
            label = {"int4": "int4 (else int8)", "int8": "all int8"}.get(key, key)
            if key == "chosen":
                counts = ", ".join(f"{n} {p}" for p, n in r["counts"].items())
                label = f"chosen ({r['objective']}): {counts}"
            plans.add_row(
                r["model"],
                label,
                _metric(r["metric"], row["metric"]),
                f"{row['size_bytes'] / 1e6:.2f} MB",
                f"{row['latency_ms_median']:.3f}",
                f"{base / row['latency_ms_median']:.2f}x",
                f"{int8 / row['latency_ms_median']:.2f}x" if int8 else "",
            )
    console.print(plans)


def _csv(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list from {', '.join(MODELS)}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_csv, default=list(MODELS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument(
        "--objective",
        choices=("size", "latency"),
        default="size",
        help="mixed_precision.objective (digits and minilm: recipe-auto-latency.yaml)",
    )
    p.add_argument("--work", type=Path, default=REPO / "benchmarks" / "results" / "analyze")
    p.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "analyze.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    machine = machine_info()
    results = []
    for name in args.models:
        folder = args.work / name
        if folder.exists():  # a fresh folder: the analysis cache must not answer
            for path in sorted(folder.rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
        results.append(run_model(name, args.work, args.threads, args.runs, console, args.objective))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=2) + "\n")
    print_tables(console, results, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
