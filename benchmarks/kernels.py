"""Throughput of the calibration kernels next to the memory-bandwidth floor, per instruction set.

What a calibration step does per tensor: the observer's fused pass (`observe`: min/max and the
histogram at the current range in one read), plain min/max, the exact clamping histogram, and the
KL / MSE threshold searches on a 2048-bin |x| histogram. The floor is numpy's `np.sum` over the
same array (one read, no work to speak of). Each kernel runs on every instruction set this CPU has
(forced with `set_cpu_isa`), on 1 thread and on all threads.

INT4 weights: the per-block MSE clipping search (`block_mse_search`, what `method: mse` runs) on
a [K, N] weight with blocks along K, against its numpy reference `int4._mse_search_numpy` (same
results bit for bit), in weight elements per second (each element is tried once per grid factor).

Throughput is G elements per second of wall time and per CPU-second (`time.process_time`, all
threads of this process): on a shared machine the second is the per-core figure that other
processes disturb least. CUDA rows (copies included) appear when a GPU is usable. Prints a table
and writes JSON (default benchmarks/results/kernels.json).

`--compare-lib OLD.so` adds the rows of another build of libqtool_cpu.so (a copy of
qtool/_lib/libqtool_cpu.so from before a kernel change), measured in the same process on the same
arrays, alternating with this build `--rounds` times (best of all): before/after figures that the
load of a shared machine disturbs alike.

    python -m benchmarks.kernels [--elements 100000000] [--repeats 5] [--dists normal,relu]
    python -m benchmarks.kernels --compare-lib /tmp/old.so --threads 1 --isas avx2,avx512
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import qtool.kernels as k

RESULTS = Path(__file__).resolve().parent / "results"
NBINS = 4096  # the observer's default: 2 x calibration.bins (2048)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _measure(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """Best wall time and best CPU time (all threads) over `repeats` runs, after a warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {"wall_s": min(walls), "cpu_s": min(cpus)}


def _data(name: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if name == "normal":  # LayerNorm outputs, most pre-activation tensors
        return rng.standard_normal(n, dtype=np.float32)
    if name == "relu":  # CNN activations: half exact zeros
        return np.maximum(rng.standard_normal(n, dtype=np.float32), 0)
    if name == "t4":  # heavy tails: the range grows now and then
        return rng.standard_t(4, size=n).astype(np.float32)
    raise SystemExit(f"unknown distribution {name!r}")


def _power_of_two_above(x: np.ndarray) -> float:
    lo, hi, _ = k.tensor_minmax(x)
    return float(2.0 ** (np.floor(np.log2(max(abs(lo), abs(hi)))) + 1))


def bench_streaming(
    x: np.ndarray, repeats: int, thread_counts: list[int], isas: list[str] | None = None
) -> list[dict]:
    """Rows: one per (instruction set, threads, kernel), and the np.sum floor first."""
    r = _power_of_two_above(x)
    counts = np.zeros(NBINS, np.int64)
    cases: dict[str, Callable[[], object]] = {
        "observe (fused)": lambda: k.observe(x, r, counts),
        "tensor_minmax": lambda: k.tensor_minmax(x),
        "histogram_accumulate": lambda: k.histogram_accumulate(x, r, counts),
    }
    rows = []
    floor = _measure(lambda: np.sum(x), repeats)  # single-threaded in numpy
    rows.append({"kernel": "np.sum (floor)", "isa": "numpy", "threads": 1, **floor})
    try:
        for isa in isas or k.supported_cpu_isas():
            k.set_cpu_isa(isa)
            for threads in thread_counts:
                k.set_cpu_threads(threads)
                for name, fn in cases.items():
                    m = _measure(fn, repeats if isa != "scalar" else 1)
                    rows.append({"kernel": name, "isa": isa, "threads": threads, **m})
    finally:
        k.set_cpu_isa(None)
        k.set_cpu_threads(None)
    for row in rows:
        row["g_per_s"] = x.size / row["wall_s"] / 1e9
        row["g_per_cpu_s"] = x.size / row["cpu_s"] / 1e9 if row["cpu_s"] > 0 else None
        row["vs_floor"] = floor["wall_s"] / row["wall_s"]
    return rows


@contextmanager
def _library(path: Path | None) -> Iterator[None]:
    """Kernels from another build of the CPU library while inside (None: this build)."""
    if path is None:
        yield
        return
    saved = k.CPU_LIB
    k.CPU_LIB, k._cpu = path, None
    try:
        yield
    finally:
        k.CPU_LIB, k._cpu = saved, None


def bench_compared(
    x: np.ndarray,
    repeats: int,
    thread_counts: list[int],
    baseline: Path,
    rounds: int,
    isas: list[str] | None = None,
) -> list[dict]:
    """bench_streaming for this build and `baseline`, alternated `rounds` times; each row keeps
    its best round and says which build it is."""
    best: dict[tuple, dict] = {}
    for _ in range(rounds):
        for build, path in (("baseline", baseline), ("this", None)):
            with _library(path):
                for row in bench_streaming(x, repeats, thread_counts, isas):
                    key = ("floor" if row["isa"] == "numpy" else build, row["kernel"], row["isa"])
                    key = (*key, row["threads"])
                    if key not in best or row["cpu_s"] < best[key]["cpu_s"]:
                        best[key] = {**row, "build": key[0]}
    rows = list(best.values())
    floor = min(r["wall_s"] for r in rows if r["isa"] == "numpy")
    for row in rows:
        row["vs_floor"] = floor / row["wall_s"]
    order = {"floor": 0, "baseline": 1, "this": 2}
    return sorted(rows, key=lambda r: (order[r["build"]], r["isa"], r["threads"]))


def bench_searches(x: np.ndarray, repeats: int) -> dict[str, dict[str, float]]:
    """KL and MSE searches (and CPU vs CUDA for everything when a GPU is usable), in ms."""
    r = _power_of_two_above(x)
    sym = np.zeros(NBINS, np.int64)
    k.histogram_accumulate(x, r, sym)
    hist = sym[NBINS // 2 :] + sym[: NBINS // 2][::-1]  # fold [-R, R] into |x| over [0, R]
    devices = ["cpu"] + (["cuda"] if k.default_device() == "cuda" else [])
    cases: dict[str, Callable[[str], object]] = {
        "kl_2048": lambda d: k.kl_threshold_bins(hist, 128, device=d),
        "mse_2048": lambda d: k.mse_threshold_bins(hist, 127, device=d),
    }
    if "cuda" in devices:
        cases["observe"] = lambda d: k.observe(x, r, np.zeros(NBINS, np.int64), device=d)
        cases["tensor_minmax"] = lambda d: k.tensor_minmax(x, device=d)
    return {
        name: {d: 1e3 * _measure(lambda d=d, fn=fn: fn(d), repeats)["wall_s"] for d in devices}
        for name, fn in cases.items()
    }


def bench_block_search(
    shape: tuple[int, int], block: int, repeats: int, thread_counts: list[int]
) -> list[dict]:
    """Rows: the numpy reference, then the kernel per (instruction set, threads), CUDA last."""
    from qtool.write import int4

    grid = int4._check_grid("mse", int4.DEFAULT_MSE_GRID)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape, dtype=np.float32)
    w[rng.uniform(size=shape) < 0.01] *= np.float32(10.0)  # some outliers, so clipping pays
    rows, columns = shape
    blocks = np.zeros((-(-rows // block) * block, columns), np.float32)
    blocks[:rows] = w
    blocks = blocks.reshape(-1, block, columns)
    ref = int4._mse_search_numpy(blocks, 4, True, grid)
    cases: list[tuple[str, int, str, Callable[[], object]]] = [
        ("numpy", 1, "numpy", lambda: int4._mse_search_numpy(blocks, 4, True, grid))
    ]

    def kernel(device: str) -> Callable[[], object]:
        return lambda: k.block_mse_search(
            w, block, grid, qmin=-8, qmax=7, symmetric=True, device=device
        )

    for isa in k.supported_cpu_isas():
        for threads in thread_counts:
            cases.append((isa, threads, "cpu", kernel("cpu")))
    if k.default_device() == "cuda":
        cases.append(("cuda", 0, "cuda", kernel("cuda")))
    rows_out = []
    try:
        for isa, threads, device, fn in cases:
            if device == "cpu":
                k.set_cpu_isa(isa)
                k.set_cpu_threads(threads)
                found = fn()
                assert np.array_equal(found.best_index, ref[3]), f"{isa}: differs from numpy"
            m = _measure(fn, repeats if isa not in ("numpy", "scalar") else 1)
            rows_out.append({"impl": isa, "threads": threads, **m})
    finally:
        k.set_cpu_isa(None)
        k.set_cpu_threads(None)
    for row in rows_out:
        row["m_elements_per_s"] = w.size / row["wall_s"] / 1e6
        row["vs_numpy"] = rows_out[0]["wall_s"] / row["wall_s"]
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dists", default="normal,relu,t4")
    parser.add_argument("--threads", default="1,all", help="thread counts; 'all' = the default")
    parser.add_argument("--json", type=Path, default=RESULTS / "kernels.json")
    parser.add_argument("--weight", default="1536x384", help="INT4 MSE search weight K x N")
    parser.add_argument("--block", type=int, default=32, help="INT4 MSE search block (along K)")
    parser.add_argument("--compare-lib", type=Path, help="another libqtool_cpu.so build to compare")
    parser.add_argument("--rounds", type=int, default=2, help="alternations with --compare-lib")
    parser.add_argument("--isas", help="instruction sets, comma-separated (default: all)")
    args = parser.parse_args()

    default_threads = k.cpu_threads()
    isas = args.isas.split(",") if args.isas else None
    thread_counts = sorted(
        {default_threads if t == "all" else int(t) for t in args.threads.split(",")}
    )
    report: dict = {
        "machine": {
            "cpu": _cpu_name(),
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
            "supported_isas": k.supported_cpu_isas(),
            "default_threads": default_threads,
        },
        "elements": args.elements,
        "nbins": NBINS,
        "repeats": args.repeats,
        "backends": k.backends(),
        "streaming": {},
    }
    print(f"{_cpu_name()}; ISAs {k.supported_cpu_isas()}; load average {os.getloadavg()[0]:.1f}")
    print(f"{args.elements:,} float32 elements, {NBINS} bins, best of {args.repeats}")
    if args.compare_lib is not None:
        report["compare_lib"] = str(args.compare_lib)
    build_col = f"{'build':<9}" if args.compare_lib is not None else ""
    header = f"{'dist':<7}{build_col}{'kernel':<22}{'isa':<8}{'thr':>4}{'wall G/s':>10}"
    print(header + f"{'G/cpu-s':>9}{'x floor':>9}")
    for dist in args.dists.split(","):
        x = _data(dist, args.elements)
        if args.compare_lib is None:
            rows = bench_streaming(x, args.repeats, thread_counts, isas)
        else:
            rows = bench_compared(
                x, args.repeats, thread_counts, args.compare_lib, args.rounds, isas
            )
        report["streaming"][dist] = rows
        for row in rows:
            per_cpu = "-" if row["g_per_cpu_s"] is None else f"{row['g_per_cpu_s']:.2f}"
            build = f"{row['build']:<9}" if args.compare_lib is not None else ""
            print(
                f"{dist:<7}{build}{row['kernel']:<22}{row['isa']:<8}{row['threads']:>4}"
                f"{row['g_per_s']:>10.2f}{per_cpu:>9}{row['vs_floor']:>8.2f}x"
            )
        if dist == args.dists.split(",")[0]:
            report["searches_ms"] = bench_searches(x, args.repeats)
        del x
    print("searches (ms):", json.dumps(report["searches_ms"]))
    shape = tuple(int(d) for d in args.weight.lower().split("x"))
    if len(shape) != 2:
        raise SystemExit(f"--weight must be K x N, got {args.weight!r}")
    rows = bench_block_search(shape, args.block, args.repeats, thread_counts)
    report["block_mse_search"] = {"weight": list(shape), "block": args.block, "rows": rows}
    print(f"INT4 MSE search, weight {shape[0]}x{shape[1]}, block {args.block}, grid 21")
    print(f"{'impl':<8}{'thr':>4}{'ms':>10}{'M elem/s':>10}{'x numpy':>9}")
    for row in rows:
        print(
            f"{row['impl']:<8}{row['threads']:>4}{1e3 * row['wall_s']:>10.2f}"
            f"{row['m_elements_per_s']:>10.1f}{row['vs_numpy']:>8.1f}x"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
