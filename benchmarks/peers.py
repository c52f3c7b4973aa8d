"""Accuracy side by side against the peer quantizers: NNCF, Neural Compressor, ModelOpt, Quark.

accuracy.py compares qtool with ONNX Runtime's quantize_static; this one adds the other PTQ tools
a user could pick instead. Every tool starts from the same float graph (the `model.fp32.onnx`
qtool writes for the example), calibrates on the same batches (qtool's reader, saved as one
.npz) and is judged on the same evaluation set by the same code
(`qtool.metrics.evaluate.evaluate_models`,
fused ORT_ENABLE_ALL and unfused ORT_DISABLE_ALL) in this interpreter. Each peer runs in its own
virtual environment under benchmarks/.peers/<name>/ (they pin other onnx/onnxruntime versions;
none is a qtool dependency), created and filled with pip on first use, through a small runner
script (benchmarks/peer_runners/run_<name>.py) that uses the peer's recommended settings for the
model type and writes them, with its versions and CPU seconds, to a JSON. A peer that fails to
install or run is a row with its one-line reason. See benchmarks/README.md.

    python -m benchmarks.peers --examples ocr_cls,digits --peers ort,nncf,inc,modelopt,quark
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import qtool
from benchmarks.accuracy import (
    EXAMPLES,
    RunLog,
    _csv,
    _failure,
    _finish,
    _log_traceback,
    _number,
    _timed,
    algorithm_label,
    calibration_batches,
    example_info,
    run_qtool,
    score_against,
    score_cells,
    score_title,
    table_columns,
    timing_cell,
    versions,
    with_algorithms,
)
from benchmarks.calibration import save_json
from benchmarks.peer_runners._handoff import save_batches
from qtool.config.recipe import Recipe, load_recipe

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
RUNNERS = REPO / "benchmarks" / "peer_runners"
PEER_ROOT = REPO / "benchmarks" / ".peers"
# A peer that needs torch gets this one first: the CPU wheel on local disk, never the CUDA build.
TORCH_PIN = "torch==2.13.0"
KINDS = {"digits": "cnn", "ocr_cls": "cnn", "effnet_lite": "cnn", "minilm": "transformer"}
# A peer whose resident memory passes this is killed and reported, not left to the kernel's OOM
# killer on a machine shared with other jobs (ORT's percentile calibrator, which keeps every
# activation of every batch, reached 19 GB on effnet_lite). Override with --max-rss-gb.
MAX_RSS_GB = 12.0
RSS_POLL_S = 0.25


@dataclasses.dataclass(frozen=True)
class Peer:
    """One tool: what pip installs into its venv, and its runner script."""

    name: str
    title: str
    packages: tuple[str, ...]  # pip requirement strings; () = runs in qtool's own interpreter
    needs_torch: bool = False

    @property
    def runner(self) -> Path:
        return RUNNERS / f"run_{self.name}.py"


PEERS = {
    p.name: p
    for p in (
        # the stand-in: ORT's quantize_static through the same hand-off, in qtool's interpreter
        Peer("ort", "ORT quantize_static", ()),
        Peer("nncf", "NNCF", ("nncf", "onnx", "onnxruntime")),
        # onnx-neural-compressor 1.0 imports prettytable and scipy without declaring them
        Peer("inc", "Neural Compressor", ("onnx-neural-compressor", "prettytable", "scipy")),
        Peer("modelopt", "ModelOpt", ("nvidia-modelopt[onnx]",), needs_torch=True),
        Peer("quark", "Quark", ("amd-quark", "onnxruntime"), needs_torch=True),
    )
}


@dataclasses.dataclass(frozen=True)
class QtoolRun:
    """One qtool row: a recipe, optionally with its method or algorithm set replaced."""

    label: str
    recipe: Path
    method: str | None = None  # None: the recipe's own
    algorithms: tuple[str, ...] | None = None  # None: the recipe's own


_MINILM_SQ = REPO / "examples" / "minilm" / "recipe-int8-smoothquant.yaml"
QTOOL_RUNS = {
    "digits": (QtoolRun("qtool recipe (mse)", EXAMPLES["digits"]),),
    "ocr_cls": (
        QtoolRun("qtool recipe (minmax)", EXAMPLES["ocr_cls"]),
        QtoolRun("qtool minmax + bias_correction", EXAMPLES["ocr_cls"], None, ("bias_correction",)),
        QtoolRun("qtool entropy", EXAMPLES["ocr_cls"], "entropy", ()),
    ),
    # the recipe (minmax), and the best configuration measured against the original float model
    # (README, "Accuracy algorithms on real models"; ~260 CPU s)
    "effnet_lite": (
        QtoolRun("qtool recipe (minmax)", EXAMPLES["effnet_lite"]),
        QtoolRun("qtool mse + adaround", EXAMPLES["effnet_lite"], "mse", ("adaround",)),
    ),
    "minilm": (
        QtoolRun("qtool recipe (minmax)", EXAMPLES["minilm"]),
        QtoolRun("qtool int8 + SmoothQuant + int8 tables", _MINILM_SQ),
    ),
}


# --------------------------------------------------------------------------- peer venvs


def _last_line(text: str) -> str:
    """The most telling line of a pip or runner log: its last ERROR line, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR") or "Error" in ln]
    return (errors or lines or ["(no output)"])[-1][:300]


def peer_python(peer: Peer, root: Path, timeout: float) -> Path:
    """The peer's interpreter, installing its venv on first use (RuntimeError: why it cannot).

    A finished install leaves `installed.json`; a venv without it is rebuilt from scratch, so a
    failed or interrupted install never counts as one."""
    if not peer.packages:
        return Path(sys.executable)
    folder = root / peer.name
    python = folder / "venv" / "bin" / "python"
    if (folder / "installed.json").is_file() and python.is_file():
        return python
    shutil.rmtree(folder / "venv", ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    steps = [[sys.executable, "-m", "venv", str(folder / "venv")]]
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    if peer.needs_torch:
        steps.append([*pip, TORCH_PIN])
    steps.append([*pip, *peer.packages])
    with open(folder / "install.log", "w") as log:
        for step in steps:
            log.write(f"$ {' '.join(step)}\n")
            log.flush()
            try:
                done = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(f"install timed out after {timeout:.0f} s") from exc
            if done.returncode != 0:
                log.flush()
                reason = _last_line((folder / "install.log").read_text())
                raise RuntimeError(f"pip install {' '.join(peer.packages)} failed: {reason}")
    (folder / "installed.json").write_text(json.dumps({"packages": peer.packages}))
    return python


def rss_bytes(pid: int) -> int:
    """Peak resident memory of a live process since its exec (VmHWM), 0 once it is gone.

    The high-water mark rather than the current VmRSS: a sample taken after a short peak still
    sees it, so polling misses nothing but a peak in the last interval before exit."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((ln for ln in status.splitlines() if ln.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else 0


def wait_capped(
    process: subprocess.Popen, timeout: float, max_rss: float, poll: float = RSS_POLL_S
) -> int:
    """Wait for `process`, killing it past `timeout` seconds or `max_rss` bytes of resident
    memory; returns the peak RSS seen. Polling (not RLIMIT_AS) because torch and ORT reserve far
    more address space than they touch, so an address-space limit would fail healthy runs."""
    deadline = time.monotonic() + timeout
    peak = 0
    interval = min(poll, 0.005)  # fast at first: a quick runner (0.2 s) still gets sampled
    while process.poll() is None:
        peak = max(peak, rss_bytes(process.pid))
        if peak > max_rss:
            process.kill()
            process.wait()
            raise RuntimeError(
                f"killed at {peak / 2**30:.1f} GB resident memory (cap {max_rss / 2**30:.1f} GB)"
            )
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(f"timed out after {timeout:.0f} s")
        time.sleep(interval)
        interval = min(poll, interval * 1.5)
    return peak


def run_runner(
    peer: Peer,
    python: Path,
    fp32: Path,
    data: Path,
    folder: Path,
    kind: str,
    timeout: float,
    max_rss: float = MAX_RSS_GB * 2**30,
    extra: tuple[str, ...] = (),
) -> tuple[Path, dict, float]:
    """Run the peer's runner as a subprocess: (quantized model, its result JSON, wall seconds).

    The result JSON gets `peak_rss_bytes` (sampled every RSS_POLL_S from outside). `extra`: the
    runner's own options (benchmarks/float_types.py's ModelOpt runner takes --mode, --method)."""
    out, result = folder / "model.quant.onnx", folder / "runner.json"
    command = [str(python), str(peer.runner), "--model", str(fp32), "--data", str(data)]
    command += ["--out", str(out), "--kind", kind, "--result", str(result), *extra]
    # The runner must import its own packages, never this checkout's or qtool's venv's.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    wall = time.perf_counter()
    with open(folder / "runner.log", "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder
        )
        peak = wait_capped(process, timeout, max_rss)
    wall = time.perf_counter() - wall
    if not result.is_file():
        raise RuntimeError(f"runner died: {_last_line((folder / 'runner.log').read_text())}")
    info = json.loads(result.read_text())
    info["peak_rss_bytes"] = peak
    if info.get("status") != "ok":
        raise RuntimeError(info.get("status", "failed").removeprefix("failed: "))
    return out, info, wall


# --------------------------------------------------------------------------- the runs


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_qtool_variant(
    example: str,
    spec: QtoolRun,
    batch_size: int,
    work: Path,
    args,
    original: Path | None = None,
) -> tuple[dict, Recipe | None]:
    """qtool in-process with one QtoolRun, evaluated against `original` (the first row's float
    model, which every peer starts from; None: the float model this run wrote)."""
    folder = work / example / spec.label.replace(" ", "_").replace("+", "p")
    shutil.rmtree(folder, ignore_errors=True)
    run: dict = {"example": example, "quantizer": "qtool", "label": spec.label}
    run["versions"] = {"qtool": qtool.__version__}
    try:
        recipe = load_recipe(spec.recipe, output_dir=folder)
        calibration = dataclasses.replace(recipe.calibration, batch_size=batch_size)
        if spec.method:
            calibration = dataclasses.replace(calibration, method=spec.method)
        recipe = dataclasses.replace(recipe, calibration=calibration)
        if spec.algorithms is not None:
            recipe = with_algorithms(recipe, spec.algorithms)
        run["method"] = recipe.calibration.method
        run["algorithms"] = list(recipe.algorithms.names())
        run["settings"] = {
            "recipe": str(spec.recipe.relative_to(REPO)),
            "method": recipe.calibration.method,
            "algorithms": algorithm_label(tuple(run["algorithms"])),
            "target": recipe.quantization.target,
        }
        (fp32, model), wall, cpu = _timed(run_qtool, recipe)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        run["status"] = _failure(exc)
        _log_traceback(folder / "error.txt")
        return run, None
    scored, foreign = score_against(run, fp32, original)
    return _finish(run, scored, model, (wall, cpu), recipe, args, folder, foreign), recipe


def run_peer(
    example: str, peer: Peer, fp32: Path, data: Path, recipe: Recipe, work: Path, args
) -> dict:
    """One peer on one example: venv, runner subprocess, then qtool's evaluation."""
    folder = work / example / f"peer-{peer.name}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    kind = KINDS[example]
    run: dict = {"example": example, "quantizer": peer.name, "label": peer.title, "kind": kind}
    try:
        python = peer_python(peer, args.peer_root, args.install_timeout)
    except RuntimeError as exc:
        run["status"] = f"install failed: {exc}"[:300]
        return run
    try:
        model, info, wall = run_runner(
            peer, python, fp32, data, folder, kind, args.timeout, args.max_rss_gb * 2**30
        )
    except RuntimeError as exc:
        run["status"] = f"failed: {exc}"[:300]
        return run
    finally:
        result = folder / "runner.json"
        if result.is_file():  # a failed run's settings too; `info` keeps run_runner's peak
            reported = json.loads(result.read_text())
            run.update(settings=reported.get("settings"), versions=reported.get("versions"))
    run["fp32_sha256"] = _sha256(fp32)
    run["calibration_samples"] = info.get("calibration_samples")
    run["peak_rss_bytes"] = info.get("peak_rss_bytes")
    return _finish(run, fp32, model, (wall, info["cpu_s"]), recipe, args, folder)


def run_example(example: str, work: Path, args, record) -> dict:
    """qtool's rows, then every peer from the first qtool row's float model and batches."""
    base = load_recipe(EXAMPLES[example], output_dir=work / example / "unused")
    info = example_info(example, base)
    info["kind"] = KINDS[example]
    fp32: Path | None = None
    reference: Recipe | None = None
    for spec in QTOOL_RUNS[example]:
        if args.qtool == "first" and fp32 is not None:
            break
        run, recipe = run_qtool_variant(example, spec, info["batch_size"], work, args, fp32)
        record(run)
        if fp32 is None and run.get("status") == "ok" and recipe is not None:
            fp32, reference = Path(run["fp32_model"]), recipe
    if fp32 is None or reference is None:
        for name in args.peers:
            record(
                {
                    "example": example,
                    "quantizer": name,
                    "label": PEERS[name].title,
                    "status": "failed: no qtool float model to start from",
                }
            )
        return info
    data = work / example / "calibration.npz"
    batches = calibration_batches(reference, info["batch_size"])
    save_batches(data, [b.inputs for b in batches])
    info["fp32_model"] = str(fp32)
    info["calibration_npz"] = str(data)
    for name in args.peers:
        record(run_peer(example, PEERS[name], fp32, data, reference, work, args))
    return info


# --------------------------------------------------------------------------- output


def settings_text(run: dict) -> str:
    """The settings column: what the tool ran with, in a few words."""
    s = run.get("settings") or {}
    if run["quantizer"] == "qtool":
        return f"{s.get('method', '?')}, {s.get('algorithms', '?')}"
    keys = ("config", "model_type", "preset", "calibration", "calibration_method")
    words = [str(s[k]) for k in keys if k in s]
    if "weights" in s:
        words.append(str(s["weights"]).replace("symmetric, ", ""))
    return "; ".join(words)[:70]


_MAIN_PACKAGE = {
    "qtool": ("qtool",),
    "ort": ("onnxruntime", "onnxruntime-gpu"),
    "nncf": ("nncf",),
    "inc": ("onnx-neural-compressor",),
    "modelopt": ("nvidia-modelopt",),
    "quark": ("amd-quark",),
}


def version_text(run: dict) -> str:
    """The version of the tool itself (its runner reports every package it imports)."""
    v = run.get("versions") or {}
    return next((v[p] for p in _MAIN_PACKAGE.get(run["quantizer"], ()) if v.get(p)), "")


def print_tables(console: Console, report: dict) -> None:
    """One table per example: FP32, qtool's rows, then each peer (or its failure reason)."""
    for example, info in report["examples"].items():
        runs = [r for r in report["runs"] if r["example"] == example]
        fp32 = next((r["fp32"] for r in runs if "fp32" in r), None)
        columns = table_columns(fp32, example)
        t = Table(title=f"{example}: fused (ORT_ENABLE_ALL) | unfused (ORT_DISABLE_ALL) vs FP32")
        for title in ("quantizer", "version", "settings"):
            t.add_column(title, overflow="fold")
        for key, _ in columns:
            t.add_column(score_title(key), justify="right")
        t.add_column("size kB", justify="right")
        t.add_column("quantize s (CPU s)", justify="right")
        if fp32:
            accuracy = _number(fp32["accuracy"], "{:.2%}")
            cells = [accuracy if key == "accuracy" else "" for key, _ in columns]
            size = f"{fp32['size_bytes'] / 1e3:.1f}"
            t.add_row("FP32", "", "", *cells, size, "", end_section=True)
        for run in runs:
            head = [run["label"], version_text(run), settings_text(run)]
            if "scores" not in run:
                reason = f"[red]{run.get('status', 'failed')[:90]}[/red]"
                t.add_row(*head, reason, *[""] * (len(columns) + 1))
                continue
            size = f"{run['size_bytes'] / 1e3:.1f}"
            t.add_row(*head, *score_cells(run, columns), size, timing_cell(run))
        console.print(t)
        console.print(
            f"  {example}: {info['calibration_samples']} calibration samples in batches of "
            f"{info['batch_size']} for every tool, {fp32['samples'] if fp32 else '?'} evaluation "
            f"samples; peers' settings: the {info['kind']} recipe of each"
        )
    failures = [r for r in report["runs"] if r.get("status") != "ok"]
    if failures:
        console.print("[red]Not run (logs under the work folder):[/red]")
        for r in failures:
            console.print(f"  {r['example']} {r['label']}: {r['status']}", markup=False)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--examples", type=_csv(tuple(QTOOL_RUNS)), default=["digits", "ocr_cls"])
    p.add_argument("--peers", type=_csv(tuple(PEERS)), default=list(PEERS))
    p.add_argument(
        "--qtool",
        choices=("all", "first"),
        default="all",
        help="qtool rows: every variant of the example, or only the first (the recipe as is)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per peer run")
    p.add_argument(
        "--max-rss-gb",
        type=float,
        default=MAX_RSS_GB,
        help="kill a peer run past this much resident memory (GB) and report it",
    )
    p.add_argument("--install-timeout", type=float, default=1800.0, help="seconds per pip step")
    p.add_argument("--peer-root", type=Path, default=PEER_ROOT, help="the peers' venvs")
    p.add_argument("--latency-runs", type=int, default=3, help="per evaluation (not the point)")
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (evaluation)")
    p.add_argument("--json", type=Path, default=RESULTS / "peers.json")
    p.add_argument("--work", type=Path, default=RESULTS / "peers", help="models and outputs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console.width = 200  # piped into a log: do not wrap the tables
    work = args.work.resolve()
    report: dict = {
        "versions": versions(),
        "settings": {
            "examples": args.examples,
            "peers": args.peers,
            "qtool": [
                dataclasses.asdict(s) | {"recipe": str(s.recipe.relative_to(REPO))}
                for e in args.examples
                for s in QTOOL_RUNS[e]
            ],
            "scores": "gated output; fused = ORT_ENABLE_ALL (what deploys), unfused = "
            "ORT_DISABLE_ALL (the QDQ semantics); quantize_cpu_s = CPU seconds of the peer's "
            "process (imports included) or of qtool's in-process run",
            "peer_settings": "each run's `settings`, as its runner reported them",
        },
        "examples": {},
        "runs": [],
    }
    # peer runs are ok or failed, never n/a: RunLog's rule is theirs
    record = RunLog(report, args.json, console, lambda r: f"{r['example']} {r['label']}")
    failed = False

    for example in args.examples:
        try:
            report["examples"][example] = run_example(example, work, args, record)
        except Exception as exc:  # noqa: BLE001 - e.g. ocr_cls before its fetch.py
            report["examples"][example] = {"status": _failure(exc)}
            console.print(f"{example}: {_failure(exc)}", markup=False, style="red")
            failed = True
        save_json(report, args.json)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save_json(report, args.json)
    shown = {k: v for k, v in report["examples"].items() if "status" not in v}
    print_tables(console, {**report, "examples": shown})
    console.print(f"JSON: {args.json}")
    return 1 if failed or record.failed else 0


if __name__ == "__main__":
    sys.exit(main())
