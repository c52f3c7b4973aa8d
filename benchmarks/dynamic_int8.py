"""Dynamic INT8 on all-MiniLM-L6-v2: qtool's dynamic forms next to ONNX Runtime's quantize_dynamic.

One run, the same FP32 graph (the `model.fp32.onnx` qtool prepares from the model in its pip
wheel, examples/minilm) and the same held-out sentences for every row:

* `qtool int8-dynamic`: every MatMul with a weight quantized at run time (the preset);
* `qtool int8-dynamic, per-token ranges`: the same with `dynamic_ranges: per-token` (one range
  per token, unfused MatMulInteger);
* `qtool int8-dynamic-transformer`: Q and K projections (and the rest) dynamic, V static;
* `qtool int8-transformer`: the static INT8 preset (SmoothQuant, int8 embedding tables);
* `ORT quantize_dynamic`: ORT's defaults, and with `per_channel=True`.

Calibration (only the static ranges use it: V's input, and the static preset) reads the
example's own calibration sentences (examples/minilm/sentences.txt); the reported figures come
from held-out text of another source: fortunes from Debian's `fortunes` package
(benchmarks/llm_text.py: its `test` part), tokenized to the model's 128 tokens. Cosine and SQNR
of the sentence embeddings against FP32 (qtool.metrics.signal, fused, as ORT runs the model),
file size, and batch-1 latency: median over interleaved runs of every model at the same
thread count, with ratios to FP32 and to ORT's quantize_dynamic (default settings). Also what
ORT runs each model's MatMuls as (its optimized graph).

    python -m benchmarks.dynamic_int8 --sentences 256 --runs 200 --threads 1

Writes benchmarks/results/dynamic_int8.json and prints the table (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from benchmarks.calibration import machine_info
from qtool.app.quantize import quantize
from qtool.config.recipe import load_recipe
from qtool.metrics.signal import SignalQuality, json_float
from qtool.ort.sessions import create_session
from qtool.runtime.fusion import optimized_graph
from qtool.runtime.latency import measure_latency

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "minilm"
RESULTS = REPO / "benchmarks" / "results"
ORT_DEFAULT = "ORT quantize_dynamic (defaults)"
# ORT kernels worth naming in the "runs as" column
KERNELS = (
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "QLinearMatMul",
    "MatMulInteger",
    "MatMul",
    "FusedMatMul",
    "GatherBlockQuantized",
)


def _example_module():
    """examples/minilm/data.py (tokenizer, calibration split), loaded by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("minilm_data", EXAMPLE / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held_out_inputs(count: int) -> tuple[dict[str, np.ndarray], dict]:
    """The first `count` fortunes of the `test` part (another source than the calibration
    sentences), tokenized like the example; and where they came from."""
    from benchmarks.llm_text import SEED, fortunes, split_documents

    docs = split_documents(fortunes(), SEED)["test"][:count]
    tokens = _example_module().tokenize(docs)
    info = {
        "source": "fortunes (Debian package), test part of benchmarks/llm_text.split_documents",
        "sentences": len(docs),
        "tokens_per_sentence": int(tokens["input_ids"].shape[1]),
        "truncated": int(np.sum(tokens["attention_mask"][:, -1] == 1)),
    }
    return tokens, info


def _recipe(work: Path, name: str, body: dict) -> Path:
    """A recipe file in `work` (absolute paths to the example's model and data)."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def qtool_rows(work: Path) -> tuple[Path, dict[str, tuple[Path, float]]]:
    """Quantize MiniLM with each qtool preset; returns the FP32 file and {label: (model, s)}."""
    common = {
        "seed": 0,
        "inputs": {
            "input_ids": {"shape": [1, 128], "dtype": "int64"},
            "attention_mask": {"shape": [1, 128], "dtype": "int64"},
        },
        "calibration": {"data": {"python": f"{EXAMPLE / 'data.py'}:calibration_batches"}},
    }
    first = {
        "base": "int8-dynamic",
        "model": {"pytorch": f"{EXAMPLE / 'model.py'}:make_model", "opset": 17},
        **common,
        "output": {"dir": str(work / "qtool-dynamic")},
    }
    rows: dict[str, tuple[Path, float]] = {}
    started = time.perf_counter()
    result = quantize(load_recipe(_recipe(work, "dynamic", first)), progress=False)
    rows["qtool int8-dynamic"] = (result.model_path, time.perf_counter() - started)
    fp32 = work / "qtool-dynamic" / "model.fp32.onnx"
    per_token = {"quantization": {"dynamic_ranges": "per-token"}}
    for label, preset, folder, extra in (
        ("qtool int8-dynamic, per-token ranges", "int8-dynamic", "token", per_token),
        (
            "qtool int8-dynamic-transformer (Q/K dyn, V static)",
            "int8-dynamic-transformer",
            "qk",
            {},
        ),
        ("qtool int8-transformer (static, SmoothQuant)", "int8-transformer", "static", {}),
    ):
        body = {
            "base": preset,
            "model": {"onnx": str(fp32)},
            **common,
            **extra,
            "output": {"dir": str(work / f"qtool-{folder}")},
        }
        started = time.perf_counter()
        result = quantize(load_recipe(_recipe(work, folder, body)), progress=False)
        rows[label] = (result.model_path, time.perf_counter() - started)
    return fp32, rows


def ort_rows(fp32: Path, work: Path) -> dict[str, tuple[Path, float]]:
    """ORT's quantize_dynamic on the same FP32 file: its defaults, and per channel."""
    from onnxruntime.quantization import quantize_dynamic

    rows = {}
    for label, options in (
        (ORT_DEFAULT, {}),
        ("ORT quantize_dynamic (per_channel=True)", {"per_channel": True}),
    ):
        out = work / ("ort-default.onnx" if not options else "ort-per-channel.onnx")
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            quantize_dynamic(str(fp32), str(out), **options)
        rows[label] = (out, time.perf_counter() - started)
    return rows


def runs_as(model: Path) -> dict[str, int]:
    """How many of each MatMul kernel ORT's CPU provider runs in the model's optimized graph."""
    counts = collections.Counter(n.op_type for n in optimized_graph(model).graph.node)
    return {k: counts[k] for k in KERNELS if counts[k]}


def score(
    fp32: Path, models: dict[str, Path], tokens: dict[str, np.ndarray], threads: int, batch: int
) -> dict[str, dict]:
    """Cosine and SQNR of every model's embeddings against FP32's, on the held-out tokens."""
    reference = create_session(fp32, threads=threads)
    sessions = {label: create_session(path, threads=threads) for label, path in models.items()}
    quality = {label: SignalQuality(cosine="rows") for label in models}
    total = len(tokens["input_ids"])
    for start in range(0, total, batch):
        feed = {name: array[start : start + batch] for name, array in tokens.items()}
        expected = reference.run(None, feed)[0]
        for label, session in sessions.items():
            quality[label].update(expected, session.run(None, feed)[0])
    return {label: {"cosine": q.cosine(), "sqnr_db": q.sqnr_db()} for label, q in quality.items()}


def latencies(
    fp32: Path, models: dict[str, Path], tokens: dict[str, np.ndarray], threads: int, runs: int
) -> dict[str, float]:
    """Batch-1 median ms of FP32 and every model, runs interleaved (qtool.runtime.latency)."""
    labels = ["FP32", *models]
    paths = [fp32, *models.values()]
    sessions = [create_session(path, threads=threads) for path in paths]
    feed = {name: np.ascontiguousarray(array[:1]) for name, array in tokens.items()}
    measured = measure_latency(sessions, feed, runs)
    return {label: median for label, (median, _) in zip(labels, measured, strict=True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=256, help="held-out fortunes scored")
    parser.add_argument("--runs", type=int, default=200, help="latency runs per model")
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op threads, every model")
    parser.add_argument("--work", type=Path, default=RESULTS / "dynamic_int8")
    parser.add_argument("--json", type=Path, default=RESULTS / "dynamic_int8.json")
    args = parser.parse_args(argv)
    args.work = args.work.resolve()  # ORT's quantize_dynamic fails on a relative path
    args.work.mkdir(parents=True, exist_ok=True)

    tokens, data = held_out_inputs(args.sentences)
    fp32, made = qtool_rows(args.work)
    made.update(ort_rows(fp32, args.work))
    models = {label: path for label, (path, _) in made.items()}
    quality = score(fp32, models, tokens, args.threads, batch=32)
    latency = latencies(fp32, models, tokens, args.threads, args.runs)

    rows = []
    for label in ["FP32", *models]:
        path = fp32 if label == "FP32" else models[label]
        ms = latency[label]
        rows.append(
            {
                "model": label,
                "file": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
                "cosine": 1.0 if label == "FP32" else quality[label]["cosine"],
                "sqnr_db": json_float(np.inf if label == "FP32" else quality[label]["sqnr_db"]),
                "size_mb": path.stat().st_size / 1e6,
                "latency_ms": ms,
                "vs_fp32": latency["FP32"] / ms,
                "vs_ort_dynamic": latency[ORT_DEFAULT] / ms,
                "quantize_s": None if label == "FP32" else made[label][1],
                "runs_as": runs_as(path),
            }
        )
    result = {
        "benchmark": "dynamic_int8",
        "command": "python -m benchmarks.dynamic_int8 " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(),
        "threads": args.threads,
        "latency_runs": args.runs,
        "held_out": data,
        "calibration": "examples/minilm/sentences.txt, calibration split (196 sentences)",
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")

    table = Table(title=f"MiniLM dynamic INT8, {data['sentences']} held-out fortunes")
    for column in ("model", "cosine", "SQNR dB", "MB", "ms (b=1)", "x FP32", "x ORT dyn"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for row in rows:
        sqnr = row["sqnr_db"]
        table.add_row(
            row["model"],
            f"{row['cosine']:.5f}",
            sqnr if isinstance(sqnr, str) else f"{sqnr:.2f}",
            f"{row['size_mb']:.2f}",
            f"{row['latency_ms']:.2f}",
            f"{row['vs_fp32']:.2f}",
            f"{row['vs_ort_dynamic']:.2f}",
        )
    console = Console(width=140)
    console.print(table)
    for row in rows:
        console.print(f"{row['model']}: runs as {row['runs_as']}")
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
