"""Calibration benchmark: qtool vs the inference floor and vs ONNX Runtime's quantizer.

One run measures, on the same exported ONNX models and the same calibration inputs, each in its
own process, the wall time, CPU seconds and peak RSS of
- `qtool quantize RECIPE` (calibrate + quantize);
- the inference floor: plain FP32 ONNX Runtime over the same batches, on qtool's prepared model
  with the tensors qtool observes exposed as outputs, and without them (benchmarks/_floor.py);
- `onnxruntime.quantization.quantize_static` (unless --skip-ort);
then the batch-1 CPU latency of the FP32 model and of both quantized models, and the statistics
kernels' throughput next to the bandwidth floor (np.sum over the same array).

The ratios are the point: qtool's CPU seconds over the floor's (what calibration adds to the
inference it cannot avoid), qtool's peak memory over that of an ORT session exposing the same
outputs, and ORT's quantizer over qtool (its histogram calibrators keep every activation of every
batch, so its memory grows with the sample count; qtool's observers stream). See
benchmarks/README.md for how to run it and read it.

    python -m benchmarks.calibration --models cnn --samples 8,16 --small --skip-ort
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from benchmarks._measure import Measured, run_measured
from benchmarks.kernels import bench_streaming
from benchmarks.models import BUILDERS, BenchModel, calibration_inputs

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
OP_TYPES = ["Conv", "Gemm", "MatMul"]
BATCH_SIZE = 16
PERCENTILE = 99.99
DATA_SEED = 1234


def machine_info() -> dict:
    """Enough to tell whether two result files are comparable."""
    import onnx
    import onnxruntime
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = next(
            int(ln.split()[1])
            for ln in Path("/proc/meminfo").read_text().splitlines()
            if ln.startswith("MemTotal")
        )
    except (OSError, StopIteration):
        mem_kb = 0
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gb": round(mem_kb / 1024**2, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
    }


def qtool_command() -> list[str]:
    """The installed `qtool` console script when it sits next to this interpreter (what a user
    runs), else the same Typer app through `python -c`. The JSON records which one ran."""
    script = Path(sys.executable).with_name("qtool")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from qtool.cli import app; sys.exit(app())"]


def write_calibration_data(model: BenchModel, counts: list[int], work: Path) -> dict[int, Path]:
    """One seeded draw of max(counts) samples, sliced, so the 64-sample set is the first 64 of
    the 256-sample set, and both tools read the very same file."""
    full = calibration_inputs(model, max(counts), DATA_SEED)
    paths = {}
    for n in counts:
        path = work / model.name / f"calib_{n}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **{k: v[:n] for k, v in full.items()})
        paths[n] = path
    return paths


def write_recipe(model: BenchModel, data: Path, method: str, out_dir: Path) -> Path:
    """A recipe per run, following the schema in qtool/recipe.py, with absolute paths."""
    inputs = {
        name: list(shape) if dtype == "float32" else {"shape": list(shape), "dtype": dtype}
        for name, (shape, dtype) in model.inputs.items()
    }
    calibration: dict = {"data": {"npz": str(data)}, "batch_size": BATCH_SIZE, "method": method}
    if method == "percentile":
        calibration["percentile"] = PERCENTILE
    recipe = {
        "seed": 0,
        "model": {"onnx": str(model.onnx_path)},
        "inputs": inputs,
        "calibration": calibration,
        "quantization": {"target": "ort-cpu", "per_channel": True, "op_types": OP_TYPES},
        "output": {"dir": str(out_dir / "qtool")},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _child(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks._measure", *args]


def _fresh(path: Path) -> Path:
    """Delete a previous run's output so that only this run's file can count as success."""
    path.unlink(missing_ok=True)
    return path


def _expect_file(m: Measured, path: Path) -> Measured:
    """A zero exit without the output file is a failure too."""
    if m.ok and not path.exists():
        m.status = f"failed: exited 0 but wrote no {path.name}"
    return m


def run_qtool(
    model: BenchModel, data: Path, method: str, run_dir: Path, timeout: float, command: str
) -> dict:
    """`qtool quantize` (calibrate + quantize), or `qtool calibrate` alone (prepare, calibration,
    stats file), which isolates what this benchmark's floor compares against."""
    # A clean output folder: a stats file left by an earlier run must not be reused.
    shutil.rmtree(run_dir / "qtool", ignore_errors=True)
    recipe = write_recipe(model, data, method, run_dir)
    cmd = [*qtool_command(), command, str(recipe)]
    m = run_measured(cmd, run_dir / f"qtool_{command}.log", timeout, cwd=REPO)
    out = run_dir / "qtool" / ("model.int8.onnx" if command == "quantize" else "stats.npz")
    return {**_expect_file(m, out).to_dict(), "cmd": cmd, "model_out": str(out)}


def write_floor_models(model: BenchModel, data: Path, work: Path) -> dict:
    """qtool's prepared float model as is and with the tensors qtool observes as extra outputs:
    what the floor runs, so both sides run the very same graph."""
    from qtool.app.common import prepare
    from qtool.calibration.collect import save_with_extra_outputs
    from qtool.config.recipe import load_recipe

    out = work / model.name / "floor"
    recipe = write_recipe(model, data, "entropy", out)
    prepared = prepare(load_recipe(recipe))
    tensors = prepared.layout.stats_tensors()
    plain, exposed = out / "plain.onnx", out / "exposed.onnx"
    plain.write_bytes(prepared.model.serialized)
    save_with_extra_outputs(prepared.model.model, tensors, exposed)
    return {"plain": str(plain), "exposed": str(exposed), "observed_tensors": len(tensors)}


def run_floor(models: dict, data: Path, run_dir: Path, timeout: float) -> dict:
    """Both floor variants over `data`, each in its own measured process."""
    out = {}
    for variant in ("exposed", "plain"):
        result = _fresh(run_dir / f"floor_{variant}.json")
        cmd = [
            sys.executable,
            "-m",
            "benchmarks._floor",
            "--model",
            models[variant],
            "--data",
            str(data),
            "--batch-size",
            str(BATCH_SIZE),
            "--json",
            str(result),
        ]
        m = _expect_file(
            run_measured(cmd, run_dir / f"floor_{variant}.log", timeout, cwd=REPO), result
        )
        out[variant] = {**m.to_dict(), **(json.loads(result.read_text()) if m.ok else {})}
    return out


def best_of(runs: list[dict]) -> dict:
    """The last run's record with the fastest wall and CPU time and the highest peak of all runs
    (time noise only adds, so the minimum is the estimate; memory is reported conservatively).
    Any failed run fails the result."""
    failed = [r for r in runs if r.get("status") != "ok"]
    if failed or not runs:
        return failed[0] if failed else {"status": "not run"}
    best = dict(runs[-1])
    best.update(
        wall_s=min(r["wall_s"] for r in runs),
        cpu_s=min(r["cpu_s"] for r in runs),
        peak_mb=max(r["peak_mb"] for r in runs),
        runs=[{k: r[k] for k in ("wall_s", "cpu_s", "peak_mb")} for r in runs],
    )
    return best


def run_ort_preprocess(model: BenchModel, work: Path, timeout: float) -> tuple[Measured, Path]:
    out = _fresh(work / model.name / "ort_preprocessed.onnx")
    cmd = _child("ort-preprocess", "--model", str(model.onnx_path), "--out", str(out))
    m = run_measured(cmd, work / model.name / "ort_preprocess.log", timeout, cwd=REPO)
    return _expect_file(m, out), out


def run_ort(
    pre: Measured, pre_model: Path, data: Path, method: str, run_dir: Path, timeout: float
) -> dict:
    """ORT's time is pre-processing + quantize_static, its peak the larger of the two processes:
    quant_pre_process is a step ORT's docs require and qtool does not have."""
    out = _fresh(run_dir / "ort.onnx")
    if not pre.ok:
        return {"status": f"pre-process {pre.status}", "preprocess": pre.to_dict()}
    cmd = _child(
        "ort-quantize",
        "--model",
        str(pre_model),
        "--data",
        str(data),
        "--out",
        str(out),
        "--method",
        method,
        "--percentile",
        str(PERCENTILE),
        "--batch-size",
        str(BATCH_SIZE),
        "--op-types",
        ",".join(OP_TYPES),
    )
    q = _expect_file(run_measured(cmd, run_dir / "ort.log", timeout, cwd=REPO), out)
    return {
        "status": q.status,
        "wall_s": pre.wall_s + q.wall_s,
        "peak_mb": max(pre.peak_mb, q.peak_mb),
        "preprocess": pre.to_dict(),
        "quantize": {**q.to_dict(), "cmd": cmd},
        "model_out": str(out),
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def add_ratios(row: dict, floor: dict) -> None:
    q, o = row["qtool"], row["ort"]
    both = q.get("status") == "ok" and o.get("status") == "ok"
    row["time_ratio_ort_over_qtool"] = _ratio(o["wall_s"], q["wall_s"]) if both else None
    row["memory_ratio_ort_over_qtool"] = _ratio(o["peak_mb"], q["peak_mb"]) if both else None
    for variant in ("exposed", "plain"):
        f = floor.get(variant, {})
        ok = q.get("status") == "ok" and f.get("status") == "ok"
        row[f"cpu_ratio_qtool_over_floor_{variant}"] = (
            _ratio(q["cpu_s"], f["cpu_s"]) if ok else None
        )
        row[f"memory_ratio_qtool_over_floor_{variant}"] = (
            _ratio(q["peak_mb"], f["peak_mb"]) if ok else None
        )


# --------------------------------------------------------------------------- output


_SHORT = ("timeout", "no model", "pre-process", "latency run")


def _cell(side: dict, key: str, fmt: str) -> str:
    """A number, or the first word of a failure; the full reason is listed under the table."""
    if not side:
        return "-"
    status = side.get("status", "skipped")
    if status != "ok":
        short = next((w for w in _SHORT if status.startswith(w)), "failed")
        return f"[red]{short}[/red]"
    return fmt.format(side[key])


def _rcell(x: float | None) -> str:
    return "-" if x is None else f"[bold]{x:.2f}x[/bold]"


def print_tables(console: Console, report: dict) -> None:
    t = Table(title="Calibrate + quantize: qtool vs ONNX Runtime (ORT time includes pre-process)")
    for col in (
        "model",
        "method",
        "samples",
        "qtool s",
        "ORT s",
        "ORT/qtool time",
        "qtool peak MB",
        "ORT peak MB",
        "ORT/qtool mem",
    ):
        t.add_column(col, justify="left" if col in ("model", "method") else "right")
    for r in report["runs"]:
        t.add_row(
            r["model"],
            r["method"],
            str(r["samples"]),
            _cell(r["qtool"], "wall_s", "{:.1f}"),
            _cell(r["ort"], "wall_s", "{:.1f}"),
            _rcell(r["time_ratio_ort_over_qtool"]),
            _cell(r["qtool"], "peak_mb", "{:.0f}"),
            _cell(r["ort"], "peak_mb", "{:.0f}"),
            _rcell(r["memory_ratio_ort_over_qtool"]),
        )
    console.print(t)
    print_floor_table(console, report)
    for name, info in report["models"].items():
        pre = info.get("ort_preprocess")
        if pre and pre["status"] == "ok":
            console.print(
                f"  {name}: ORT quant_pre_process {pre['wall_s']:.1f} s, "
                f"{pre['peak_mb']:.0f} MB (in every ORT row; per-step numbers in JSON)"
            )
    notes = [
        f"  {r['model']} {r['method']} {r['samples']} {tool}: {r[tool]['status']}"
        for r in report["runs"]
        for tool in ("qtool", "ort")
        if r[tool] and r[tool].get("status") != "ok"
    ]
    notes += [
        f"  latency {r['model']} {r['variant']}: {r['status']}"
        for r in report["latency"]
        if r["status"] != "ok"
    ]
    if notes:
        console.print("[red]Failures (logs under the work folder):[/red]")
        for line in notes:
            console.print(line, markup=False)
    if not report["latency"]:
        return
    lt = Table(title="ORT CPU latency, batch 1 (lower is better; speedup = FP32 / model)")
    for col in (
        "model",
        "variant",
        "from",
        "median ms",
        "p90 ms",
        "speedup vs FP32",
        "cosine vs FP32",
        "SQNR dB",
    ):
        lt.add_column(col, justify="left" if col in ("model", "variant", "from") else "right")
    for r in report["latency"]:
        fid = r.get("cosine_vs_fp32")
        sq = r.get("sqnr_db_vs_fp32")
        lt.add_row(
            r["model"],
            r["variant"],
            r.get("source", "-"),
            _cell(r, "median_ms", "{:.2f}"),
            _cell(r, "p90_ms", "{:.2f}"),
            _rcell(r.get("speedup_vs_fp32")),
            "-" if fid is None else f"{fid:.4f}",
            "-" if sq is None else f"{sq:.1f}",
        )
    console.print(lt)


def floor_ratios(floor: dict) -> dict:
    """qtool calibrate over the floor with outputs exposed (and over the plain floor)."""
    c = floor.get("qtool_calibrate", {})
    out = {}
    for variant in ("exposed", "plain"):
        f = floor.get(variant, {})
        ok = c.get("status") == "ok" and f.get("status") == "ok"
        out[f"cpu_{variant}"] = _ratio(c["cpu_s"], f["cpu_s"]) if ok else None
        out[f"memory_{variant}"] = _ratio(c["peak_mb"], f["peak_mb"]) if ok else None
    return out


def print_floor_table(console: Console, report: dict) -> None:
    ft = Table(
        title="Inference floor (FP32 ORT over the same batches, observed tensors exposed / plain) "
        "vs qtool calibrate (prepare + calibration + stats file); CPU s = user+sys of the process"
    )
    for col in (
        "model",
        "samples",
        "floor CPU s",
        "plain CPU s",
        "calibrate CPU s",
        "calibrate/floor CPU",
        "floor peak MB",
        "plain peak MB",
        "calibrate peak MB",
        "calibrate/floor mem",
    ):
        ft.add_column(col, justify="left" if col == "model" else "right")
    for key, floor in report["floor"].items():
        name, n = key.split("/")
        ex, pl, cal = (floor.get(v, {}) for v in ("exposed", "plain", "qtool_calibrate"))
        ratios = floor.get("ratios", {})
        ft.add_row(
            name,
            n,
            _cell(ex, "cpu_s", "{:.1f}"),
            _cell(pl, "cpu_s", "{:.1f}"),
            _cell(cal, "cpu_s", "{:.1f}"),
            _rcell(ratios.get("cpu_exposed")),
            _cell(ex, "peak_mb", "{:.0f}"),
            _cell(pl, "peak_mb", "{:.0f}"),
            _cell(cal, "peak_mb", "{:.0f}"),
            _rcell(ratios.get("memory_exposed")),
        )
    console.print(ft)
    qt = Table(title="qtool quantize (calibrate + quantize) vs the inference floor, same batches")
    for col in (
        "model",
        "method",
        "samples",
        "qtool wall s",
        "qtool CPU s",
        "qtool/floor CPU",
        "qtool/plain CPU",
        "qtool peak MB",
        "qtool/floor mem",
    ):
        qt.add_column(col, justify="left" if col in ("model", "method") else "right")
    for r in report["runs"]:
        qt.add_row(
            r["model"],
            r["method"],
            str(r["samples"]),
            _cell(r["qtool"], "wall_s", "{:.1f}"),
            _cell(r["qtool"], "cpu_s", "{:.1f}"),
            _rcell(r.get("cpu_ratio_qtool_over_floor_exposed")),
            _rcell(r.get("cpu_ratio_qtool_over_floor_plain")),
            _cell(r["qtool"], "peak_mb", "{:.0f}"),
            _rcell(r.get("memory_ratio_qtool_over_floor_exposed")),
        )
    console.print(qt)
    kern = report.get("kernels")
    if kern:
        kt = Table(title=f"Statistics kernels, {kern['elements']:,} float32 ({kern['data']})")
        for col in ("kernel", "isa", "threads", "wall G/s", "G/CPU-s", "x np.sum"):
            kt.add_column(col, justify="left" if col in ("kernel", "isa") else "right")
        for row in kern["rows"]:
            per_cpu = row["g_per_cpu_s"]
            kt.add_row(
                row["kernel"],
                row["isa"],
                str(row["threads"]),
                f"{row['g_per_s']:.2f}",
                "-" if per_cpu is None else f"{per_cpu:.2f}",
                f"{row['vs_floor']:.2f}x",
            )
        console.print(kt)


def run_kernels(elements: int, repeats: int) -> dict:
    """The observer's kernels on N(0, 1) float32 next to np.sum over the same array, with every
    vector instruction set this CPU has (AVX2, AVX-512: each path is a separate kernel), 1 thread
    and all."""
    import qtool.kernels as k

    x = np.random.default_rng(0).standard_normal(elements, dtype=np.float32)
    threads = sorted({1, k.cpu_threads()})
    isas = [isa for isa in k.supported_cpu_isas() if isa != "scalar"] or ["scalar"]
    rows = bench_streaming(x, repeats, threads, isas=isas)
    return {"elements": elements, "data": "N(0, 1)", "isa": k.cpu_isa(), "rows": rows}


def save_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


# --------------------------------------------------------------------------- main


def _csv(kind: type, choices: set | None = None):
    def parse(text: str) -> list:
        items = [kind(x) for x in text.split(",") if x]
        if not items or (choices and not set(items) <= choices):
            raise argparse.ArgumentTypeError(f"expected a comma list from {sorted(choices or [])}")
        return items

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.calibration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", type=_csv(str, set(BUILDERS)), default=["cnn", "bert"])
    p.add_argument("--samples", type=_csv(int), default=[64, 256])
    p.add_argument(
        "--methods", type=_csv(str, {"entropy", "percentile"}), default=["entropy", "percentile"]
    )
    p.add_argument("--small", action="store_true", help="ResNet-18 at 112x112 instead of 224")
    p.add_argument("--skip-ort", action="store_true", help="run only qtool")
    p.add_argument("--skip-qtool", action="store_true", help="run only ONNX Runtime")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-floor", action="store_true", help="no inference-floor runs")
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="interleaved repeats of qtool and the floor; the best time of each is reported",
    )
    p.add_argument(
        "--kernel-elements",
        type=int,
        default=100_000_000,
        help="array size for the kernel throughput rows (0: skip them)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per subprocess")
    p.add_argument("--latency-runs", type=int, default=50)
    p.add_argument("--threads", type=int, default=2, help="ORT intra-op threads for latency")
    p.add_argument("--json", type=Path, default=RESULTS / "calibration.json")
    p.add_argument("--work", type=Path, default=RESULTS, help="models, data, logs, outputs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console.width = 140  # piped into a log: do not wrap the tables at 80 columns
    work = args.work.resolve()
    samples = sorted(set(args.samples))
    report: dict = {
        "machine": machine_info(),
        "settings": {
            "models": args.models,
            "samples": samples,
            "methods": args.methods,
            "small": args.small,
            "batch_size": BATCH_SIZE,
            "percentile": PERCENTILE,
            "op_types": OP_TYPES,
            "data_seed": DATA_SEED,
            "timeout_s": args.timeout,
            "latency": {"threads": args.threads, "runs": args.latency_runs, "batch": 1},
            "runs": args.runs,
            "qtool_cmd": None if args.skip_qtool else qtool_command(),
            "ort": "quant_pre_process + quantize_static(QDQ, QUInt8 activations, QInt8 "
            "per-channel weights, same op types)",
        },
        "models": {},
        "runs": [],
        "floor": {},
        "latency": [],
    }
    for name in args.models:
        with console.status(f"exporting {name}"):
            model = BUILDERS[name](work / "models", args.small)
        data = write_calibration_data(model, samples, work / "runs")
        report["models"][name] = {
            "onnx": str(model.onnx_path),
            "inputs": {k: {"shape": list(s), "dtype": d} for k, (s, d) in model.inputs.items()},
        }
        floor_models = None
        if not args.skip_floor:
            with console.status(f"{name}: floor models"):
                floor_models = write_floor_models(model, data[samples[0]], work / "runs")
            report["models"][name]["floor"] = floor_models
        pre, pre_model = (None, None)
        if not args.skip_ort:
            with console.status(f"{name}: ORT quant_pre_process"):
                pre, pre_model = run_ort_preprocess(model, work / "runs", args.timeout)
            report["models"][name]["ort_preprocess"] = pre.to_dict()
        for n in samples:
            # Interleaved repeats: floor, plain floor, qtool per method, again; noise from other
            # processes then hits every side alike, and the best of each is reported.
            floors: list[dict] = []
            qtools: dict[str, list[dict]] = {m: [] for m in args.methods}
            calibrates: list[dict] = []
            for rep in range(args.runs):
                if floor_models is not None:
                    with console.status(f"{name} {n}: inference floor ({rep + 1}/{args.runs})"):
                        floor_dir = work / "runs" / name / f"floor_{n}"
                        floors.append(run_floor(floor_models, data[n], floor_dir, args.timeout))
                if args.skip_qtool:
                    continue
                for method in args.methods:
                    run_dir = work / "runs" / name / f"{method}_{n}"
                    with console.status(f"{name} {method} {n}: qtool ({rep + 1}/{args.runs})"):
                        qtools[method].append(
                            run_qtool(model, data[n], method, run_dir, args.timeout, "quantize")
                        )
                if floor_models is not None:  # the stats do not depend on the method
                    calib_dir = work / "runs" / name / f"calibrate_{n}"
                    with console.status(f"{name} {n}: qtool calibrate ({rep + 1}/{args.runs})"):
                        calibrates.append(
                            run_qtool(
                                model,
                                data[n],
                                args.methods[0],
                                calib_dir,
                                args.timeout,
                                "calibrate",
                            )
                        )
            floor = (
                {v: best_of([f[v] for f in floors]) for v in ("exposed", "plain")} if floors else {}
            )
            if calibrates:
                floor["qtool_calibrate"] = best_of(calibrates)
                floor["ratios"] = floor_ratios(floor)
            report["floor"][f"{name}/{n}"] = floor
            for method in args.methods:
                run_dir = work / "runs" / name / f"{method}_{n}"
                row: dict = {"model": name, "method": method, "samples": n, "qtool": {}, "ort": {}}
                if qtools[method]:
                    row["qtool"] = best_of(qtools[method])
                if not args.skip_ort:
                    with console.status(f"{name} {method} {n}: ORT"):
                        row["ort"] = run_ort(pre, pre_model, data[n], method, run_dir, args.timeout)
                add_ratios(row, floor)
                report["runs"].append(row)
                save_json(report, args.json)
                console.log(
                    f"{name} {method} {n}: qtool {row['qtool'].get('status', '-')}, "
                    f"ORT {row['ort'].get('status', '-')}"
                )
        if not args.skip_latency:
            report["latency"] += latency_rows(model, report["runs"], data, work, args)
            save_json(report, args.json)
    if args.kernel_elements > 0:
        with console.status("kernels"):
            report["kernels"] = run_kernels(args.kernel_elements, repeats=3)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save_json(report, args.json)
    print_tables(console, report)
    console.print(f"JSON: {args.json}")
    return 0


def latency_rows(
    model: BenchModel, runs: list[dict], data: dict[int, Path], work: Path, args: argparse.Namespace
) -> list[dict]:
    """FP32, ORT's and qtool's models from the entropy/64 run (or the first method and the
    smallest sample count when those were not run), measured in one child process (interleaved
    rounds; see benchmarks/_measure.py), so a model that crashes ORT is a row, not an abort."""
    method = "entropy" if "entropy" in args.methods else args.methods[0]
    n = 64 if 64 in data else min(data)
    row = next(
        r for r in runs if r["model"] == model.name and r["method"] == method and r["samples"] == n
    )
    rows = {"fp32": {"model": model.name, "variant": "fp32", "source": "-"}}
    specs = [f"fp32={model.onnx_path}"]
    for tool in ("ort", "qtool"):
        if not row[tool]:
            continue
        rows[tool] = {"model": model.name, "variant": tool, "source": f"{method}/{n}"}
        if row[tool]["status"] == "ok":
            specs.append(f"{tool}={row[tool]['model_out']}")
            rows[tool]["path"] = row[tool]["model_out"]
        else:
            rows[tool]["status"] = f"no model ({row[tool]['status']})"
    log_dir = work / "runs" / model.name
    out = _fresh(log_dir / "latency.json")
    cmd = _child(
        "latency",
        "--data",
        str(data[n]),
        "--json",
        str(out),
        "--threads",
        str(args.threads),
        "--runs",
        str(args.latency_runs),
        *[x for spec in specs for x in ("--model", spec)],
    )
    m = _expect_file(run_measured(cmd, log_dir / "latency.log", args.timeout, cwd=REPO), out)
    measured = json.loads(out.read_text()) if m.ok else {}
    for tag, r in rows.items():
        if "status" not in r:
            r.update(measured.get(tag, {"status": f"latency run {m.status}"}))
    fp32 = rows["fp32"].get("median_ms")
    for r in rows.values():
        r["speedup_vs_fp32"] = _ratio(fp32, r.get("median_ms")) if r["status"] == "ok" else None
    return list(rows.values())


if __name__ == "__main__":
    sys.exit(main())
