"""Measured subprocesses for the calibration benchmark, and the child entries they run.

Each tool runs in its own process so that its wall time includes the cost a user pays (interpreter
start, imports, model load) and so that its peak RSS is its own: `os.wait4` returns the child's
rusage, whose ru_maxrss is the kernel's high-water mark of that process (no polling, nothing
missed between samples, no psutil dependency). See run_measured for why a launcher is needed.

The child entries (`python -m benchmarks._measure ort-preprocess|ort-quantize|latency ...`) live
here rather than in calibration.py because that module imports torch (to export the models): a
child importing it would add torch's ~0.3 GB and seconds of import time to ONNX Runtime's numbers.
This module imports only the standard library at the top; each entry imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Measured:
    """Outcome of one measured subprocess. `status` is "ok", "failed: <reason>" or "timeout"."""

    status: str
    wall_s: float
    peak_mb: float
    returncode: int | None
    log: str
    cpu_s: float = 0.0  # user + system CPU seconds of the child and everything it waited for

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)


def _last_line(path: Path) -> str:
    """The last non-empty line of a log: for a Python traceback that is the exception."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:200] if lines else "no output"


# Run by `python -S -c` (no site imports, ~10 MB): spawns the command in its own session with
# stdout+stderr to the log, reaps it with wait4, kills the session on timeout, prints one JSON line.
_LAUNCHER = """
import json, os, signal, sys, time
timeout, log, cwd, cmd = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
os.chdir(cwd)
acts = [(os.POSIX_SPAWN_OPEN, 1, log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2)]
t0 = time.perf_counter()
pid = os.posix_spawnp(cmd[0], cmd, os.environ, file_actions=acts, setsid=True)
timed_out = False
while True:
    done, status, ru = os.wait4(pid, os.WNOHANG)
    if done == pid:
        break
    if time.perf_counter() - t0 > timeout:
        timed_out = True
        os.killpg(pid, signal.SIGKILL)
        _, status, ru = os.wait4(pid, 0)
        break
    time.sleep(0.02)
print(json.dumps({"wall_s": time.perf_counter() - t0, "rc": os.waitstatus_to_exitcode(status),
                  "maxrss_kb": ru.ru_maxrss, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "timed_out": timed_out}))
"""


def run_measured(cmd: list[str], log: Path, timeout_s: float, cwd: Path | None = None) -> Measured:
    """Run `cmd` through a minimal launcher process and return its time and peak RSS.

    Why the launcher: Linux carries a process's RSS high-water mark across fork and exec, so a
    child forked straight from this (torch-importing, model-exporting) process would report at
    least this process's RSS as its own peak. The launcher is a bare `python -S` (~10 MB), so
    what leaks into the child's ru_maxrss is below a bare interpreter's own footprint. The
    child's output goes to `log` (ORT's calibrator prints a lot; a pipe could fill and block).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    launcher = [
        sys.executable,
        "-S",
        "-c",
        _LAUNCHER,
        str(timeout_s),
        str(log.resolve()),
        str((cwd or Path.cwd()).resolve()),
        *cmd,
    ]
    done = subprocess.run(launcher, capture_output=True, text=True, timeout=timeout_s + 120)
    if done.returncode != 0:
        err = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Measured(f"failed: launcher: {err[:200]}", 0.0, 0.0, None, str(log))
    r = json.loads(done.stdout)
    rc = r["rc"]
    if r["timed_out"]:
        status = f"timeout after {timeout_s:.0f} s"
    elif rc != 0:
        reason = f"signal {-rc}" if rc < 0 else _last_line(log)
        status = f"failed: {reason}"
    else:
        status = "ok"
    return Measured(status, r["wall_s"], r["maxrss_kb"] / 1024.0, rc, str(log), r["cpu_s"])


# --------------------------------------------------------------------------- child entries


def _batches(npz_path: str, batch_size: int) -> list[dict]:
    """Split the .npz (arrays keyed by input name, leading dim = samples) into batches, the same
    batch size qtool is given, so both tools run the FP32 model the same number of times."""
    import numpy as np

    with np.load(npz_path) as data:
        arrays = {k: data[k] for k in data.files if k != "labels"}
    n = len(next(iter(arrays.values())))
    return [{k: v[i : i + batch_size] for k, v in arrays.items()} for i in range(0, n, batch_size)]


def _ort_preprocess(args: argparse.Namespace) -> None:
    """ORT's documented first step before quantize_static (shape inference + graph optimisation);
    qtool has no equivalent step, so its cost is counted on ORT's side."""
    from onnxruntime.quantization import quant_pre_process

    quant_pre_process(args.model, args.out)


def _ort_quantize(args: argparse.Namespace) -> None:
    """quantize_static with the settings the benchmark compares against qtool's ort-cpu target:
    QDQ, uint8 activations, int8 per-channel weights, the same op types."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self, batches: list[dict]) -> None:
            self._it = iter(batches)

        def get_next(self) -> dict | None:
            return next(self._it, None)

    method = {"entropy": CalibrationMethod.Entropy, "percentile": CalibrationMethod.Percentile}
    extra = {"CalibPercentile": args.percentile} if args.method == "percentile" else {}
    quantize_static(
        args.model,
        args.out,
        Reader(_batches(args.data, args.batch_size)),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=args.op_types.split(","),
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=method[args.method],
        extra_options=extra,
    )


def _latency(args: argparse.Namespace) -> None:
    """Batch-1 latency in ORT's CPU provider of several models, measured in interleaved rounds
    (a few runs of each model in turn) so that load from other processes on a shared machine
    hits every model alike instead of whichever ran during it. Also the output fidelity of each
    model vs the first (FP32) one on a few calibration samples (cosine, SQNR), which shows that
    a fast model is not a broken one. A model that ORT cannot load or run gets an error entry."""
    import numpy as np
    import onnxruntime as ort

    from qtool.metrics.signal import SignalQuality

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    batches = _batches(args.data, 1)
    feed = batches[: args.fidelity]
    sessions, results, outputs = {}, {}, {}
    for spec in args.model:
        tag, path = spec.split("=", 1)
        try:
            sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            outputs[tag] = np.concatenate([sess.run(None, b)[0].ravel() for b in feed])
            for _ in range(args.warmup):
                sess.run(None, batches[0])
        except Exception as exc:  # noqa: BLE001 - reported per model, the others still run
            results[tag] = {"status": f"failed: {type(exc).__name__}: {exc}"[:300]}
            continue
        sessions[tag] = sess
        results[tag] = {"status": "ok", "times": []}
    per_round = max(1, args.runs // args.rounds)
    for _ in range(args.rounds):
        for tag, sess in sessions.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                sess.run(None, batches[0])
                results[tag]["times"].append((time.perf_counter() - t0) * 1e3)
    ref_tag = args.model[0].split("=", 1)[0]
    want = outputs.get(ref_tag)
    for tag in sessions:
        r = results[tag]
        times = r.pop("times")
        r.update(
            median_ms=float(np.median(times)),
            p90_ms=float(np.percentile(times, 90)),
            runs=len(times),
            warmup=args.warmup,
            threads=args.threads,
        )
        if want is not None and tag != ref_tag:
            quality = SignalQuality(cosine="global")  # one cosine of all flattened outputs
            quality.update(want, outputs[tag])
            r["cosine_vs_fp32"] = quality.cosine()
            r["sqnr_db_vs_fp32"] = quality.sqnr_db() if quality.noise else None
            r["fidelity_samples"] = len(feed)
    Path(args.json).write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._measure")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ort-preprocess")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=_ort_preprocess)
    p = sub.add_parser("ort-quantize")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--method", choices=["entropy", "percentile"], required=True)
    p.add_argument("--percentile", type=float, default=99.99)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--op-types", default="Conv,Gemm,MatMul")
    p.set_defaults(fn=_ort_quantize)
    p = sub.add_parser("latency")
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="TAG=PATH; the first is the FP32 reference for fidelity",
    )
    p.add_argument("--data", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fidelity", type=int, default=8)
    p.set_defaults(fn=_latency)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
