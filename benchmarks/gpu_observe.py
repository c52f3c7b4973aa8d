"""Throughput of the CUDA observe pass against the same GPU's copy bandwidth, every design.

What calibration runs per tensor and batch is `observe`: min/max, and the histogram at the
current range (4096 bins over [-R, R], R a power of two above max |x|). It must read the tensor
once, so its floor is the tensor's bytes over the memory bandwidth. This benchmark measures, in
one run on one GPU:

- the device-to-device copy bandwidth (torch's `copy_` of a buffer of the benchmark's size,
  counting bytes read plus bytes written), the ceiling the observe figures are compared with;
- every observe design of kernels/cuda.cu (`kernels.cuda_variants()`) on realistic activations
  of a few GB generated on the GPU: Gaussian, ReLU outputs (half exact zeros) and Student-t(3)
  heavy tails, timed with CUDA events around `--calls` back-to-back calls of the library's
  `qt_cuda_observe` (memset, pass and final merge included, as calibration calls it), median of
  `--repeats`; throughput = tensor bytes / time, and that as a share of the copy bandwidth;
- min/max alone (the observer's first call per tensor) with the default design, the read-only
  floor of the same loop;
- blocks per multiprocessor for the fastest designs (`--grid`);
- every design's result on the full tensor against the CPU kernels' (`device="cpu"`) on the same
  values, bit for bit: min, max (as float32 bits), non-finite count, decision and all 4096 counts.

Prints a table, and writes every number to JSON (`--json`, default
benchmarks/results/gpu_observe.json). Exits 1 when any design differs from the CPU, 2 when no
CUDA device is usable. The target is observe at >= 70% of the copy bandwidth.

    python -m benchmarks.gpu_observe [--gib 4] [--repeats 7] [--calls 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import qtool.kernels as k

RESULTS = Path(__file__).resolve().parent / "results"
NBINS = 4096  # the observer's: 2 x calibration.bins (2048)
TARGET = 0.70
DISTRIBUTIONS = ("normal", "relu", "t3")


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _gpu_info(torch) -> dict:
    props = torch.cuda.get_device_properties(0)
    info = {
        "name": props.name,
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        "compute_capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "build": json.loads(k.BUILD_INFO.read_text()).get("cuda", {}),
    }
    try:
        query = "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem"
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        info["driver"], info["max_sm_clock"], info["max_mem_clock"] = out.split(", ")
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        info["driver"] = f"unknown ({exc})"
    return info


def _time_ms(torch, fn, calls: int, repeats: int) -> list[float]:
    """Milliseconds per call of `fn`, one sample per `calls` back-to-back calls between two CUDA
    events (so the host's launch work overlaps the device's), after one warm-up sample."""
    samples = []
    for i in range(repeats + 1):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        if i:
            samples.append(start.elapsed_time(stop) / calls)
    return samples


def copy_bandwidth(torch, nbytes: int, calls: int, repeats: int) -> dict:
    """Device-to-device copy of `nbytes`, in bytes read + written per second (GB = 1e9)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(torch, lambda: dst.copy_(src), calls, repeats)
    assert torch.equal(dst, src)
    med = statistics.median(ms)
    return {
        "bytes": nbytes,
        "ms_median": med,
        "ms_all": ms,
        "gb_per_s": 2 * nbytes / med / 1e6,
        "gb_per_s_best": 2 * nbytes / min(ms) / 1e6,
    }


def make_data(torch, kind: str, n: int):
    """Activation-like float32 data on the GPU, seeded."""
    gen = torch.Generator(device="cuda").manual_seed(1234 + DISTRIBUTIONS.index(kind))
    x = torch.randn(n, device="cuda", generator=gen)
    if kind == "relu":
        x.clamp_(min=0)
    elif kind == "t3":  # z / sqrt(chi2_3 / 3), in place: three more normals squared
        chi2 = torch.zeros_like(x)
        for _ in range(3):
            chi2.add_(torch.randn(n, device="cuda", generator=gen).square_())
        x.div_(chi2.div_(3).sqrt_())
        del chi2
    return x


def _half_range(x_host: np.ndarray) -> float:
    """The observer's R for this tensor: the smallest power of two above max |x|."""
    lo, hi, _ = k.tensor_minmax(x_host, device="cpu")
    return float(2.0 ** (math.floor(math.log2(max(abs(lo), abs(hi)))) + 1))


class DeviceObserve:
    """qt_cuda_observe on a torch tensor with device-side counts and outputs."""

    def __init__(self, torch, x, half_range: float) -> None:
        self.torch = torch
        self.x = x
        self.half_range = half_range
        self.counts = torch.zeros(NBINS, dtype=torch.int64, device="cuda")
        self.out = torch.zeros(24, dtype=torch.uint8, device="cuda")

    def __call__(self, half_range: float | None = None) -> None:
        r = self.half_range if half_range is None else half_range
        k.observe_on_device(
            self.x.data_ptr(), self.x.numel(), r, self.counts.data_ptr(), NBINS,
            self.out.data_ptr(),
        )  # fmt: skip

    def result(self) -> tuple:
        raw = self.out.cpu().numpy()
        lo, hi = raw[:8].view(np.float32)
        return lo, hi, int(raw[8:16].view(np.int64)[0]), bool(raw[16]), self.counts.cpu().numpy()


def _same(gpu: tuple, cpu: tuple) -> bool:
    lo, hi, nf, acc, counts = gpu
    c_lo, c_hi, c_nf, c_acc, c_counts = cpu
    bits = np.float32(lo).view(np.uint32) == np.float32(c_lo).view(np.uint32)
    bits = bits and np.float32(hi).view(np.uint32) == np.float32(c_hi).view(np.uint32)
    return bool(bits and nf == c_nf and acc == c_acc and np.array_equal(counts, c_counts))


def bench_distribution(torch, kind: str, n: int, calls: int, repeats: int, copy: dict) -> dict:
    x = make_data(torch, kind, n)
    t0 = time.perf_counter()
    host = x.cpu().numpy()
    r = _half_range(host)
    c_counts = np.zeros(NBINS, np.int64)
    lo, hi, nf, acc = k.observe(host, r, c_counts, device="cpu")
    cpu = (np.float32(lo), np.float32(hi), nf, acc, c_counts)
    cpu_s = time.perf_counter() - t0
    del host
    rows, checks = [], {}
    nbytes = 4 * n
    for name in k.cuda_variants():
        k.set_cuda_variant(name)
        obs = DeviceObserve(torch, x, r)
        obs()
        torch.cuda.synchronize()
        checks[name] = _same(obs.result(), cpu)
        ms = _time_ms(torch, obs, calls, repeats)
        rows.append(_row(kind, name, 0, ms, nbytes, copy, checks[name]))
    k.set_cuda_variant(None)
    obs = DeviceObserve(torch, x, r)
    ms = _time_ms(torch, lambda: obs(0.0), calls, repeats)  # min/max only
    rows.append(_row(kind, f"minmax-only ({k.default_cuda_variant()})", 0, ms, nbytes, copy, None))
    return {"kind": kind, "half_range": r, "cpu_reference_s": cpu_s, "rows": rows, "same": checks}


def _row(kind, name, blocks_per_sm, ms, nbytes, copy, same) -> dict:
    med = statistics.median(ms)
    gbs = nbytes / med / 1e6
    return {
        "data": kind,
        "variant": name,
        "blocks_per_sm": blocks_per_sm,
        "ms_median": med,
        "ms_all": ms,
        "gb_per_s": gbs,
        "share_of_copy": gbs / copy["gb_per_s"],
        "bit_exact_vs_cpu": same,
    }


def bench_grid(torch, names: list[str], n: int, calls: int, repeats: int, copy: dict) -> list:
    """Blocks per multiprocessor for `names`, each on every distribution (results checked
    against the design's own default-grid result, which the CPU check covered)."""
    rows = []
    for kind in DISTRIBUTIONS:
        x = make_data(torch, kind, n)
        r = _half_range(x.cpu().numpy())
        for name in names:
            k.set_cuda_variant(name)
            ref = DeviceObserve(torch, x, r)
            ref()
            reference = ref.result()
            for blocks in (1, 2, 3, 4, 8, 16):
                k.set_cuda_variant(name, blocks_per_sm=blocks)
                obs = DeviceObserve(torch, x, r)
                obs()
                same = _same(obs.result(), reference)
                ms = _time_ms(torch, obs, calls, repeats)
                rows.append(_row(kind, name, blocks, ms, 4 * n, copy, same))
        x = None
        torch.cuda.empty_cache()
    k.set_cuda_variant(None)
    return rows


def _print(copy: dict, results: list[dict], grid: list[dict], best: dict) -> None:
    print(f"\ndevice-to-device copy: {copy['gb_per_s']:.0f} GB/s (read + write, median)")
    print(f"{'data':7s} {'variant':32s} {'bl/SM':>5s} {'ms':>8s} {'GB/s':>7s} {'copy%':>6s} exact")
    for res in results:
        for row in res["rows"]:
            _print_row(row)
    for row in grid:
        _print_row(row)
    print(
        f"\nfastest design (mean time over {', '.join(DISTRIBUTIONS)}): {best['variant']} "
        f"(blocks/SM {best['blocks_per_sm'] or 'auto'}), worst share of copy bandwidth "
        f"{best['worst_share']:.1%}: {'meets' if best['worst_share'] >= TARGET else 'misses'} "
        f"the {TARGET:.0%} target"
    )


def _print_row(row: dict) -> None:
    exact = {True: "yes", False: "NO", None: "-"}[row["bit_exact_vs_cpu"]]
    print(
        f"{row['data']:7s} {row['variant']:32s} {row['blocks_per_sm'] or 'auto':>5} "
        f"{row['ms_median']:8.3f} {row['gb_per_s']:7.0f} {row['share_of_copy']:6.1%} {exact}"
    )


def _best(rows: list[dict]) -> dict:
    """The (design, grid) with the least mean time over the distributions."""
    by_key: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["variant"].startswith("minmax-only"):
            continue
        by_key.setdefault((row["variant"], row["blocks_per_sm"]), []).append(row)
    complete = {key: rs for key, rs in by_key.items() if len(rs) == len(DISTRIBUTIONS)}
    key = min(complete, key=lambda kk: sum(r["ms_median"] for r in complete[kk]))
    return {
        "variant": key[0],
        "blocks_per_sm": key[1],
        "worst_share": min(r["share_of_copy"] for r in complete[key]),
        "shares": {r["data"]: r["share_of_copy"] for r in complete[key]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="tensor size in GiB (float32)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="back-to-back calls per sample")
    parser.add_argument("--grid", type=int, default=2, help="sweep blocks/SM for the N fastest")
    parser.add_argument("--json", type=Path, default=RESULTS / "gpu_observe.json")
    args = parser.parse_args(argv)
    torch = _torch()
    state = k.backends()["cuda"]
    if torch is None or not state.startswith("loaded"):
        print(f"no usable CUDA device (torch: {torch is not None}; qtool CUDA backend {state})")
        return 2
    n = int(args.gib * 2**30) // 4 // 4 * 4
    started = time.perf_counter()
    info = _gpu_info(torch)
    copy = copy_bandwidth(torch, 4 * n, args.calls, args.repeats)
    torch.cuda.empty_cache()
    results = []
    for kind in DISTRIBUTIONS:  # one tensor on the device at a time
        results.append(bench_distribution(torch, kind, n, args.calls, args.repeats, copy))
        torch.cuda.empty_cache()
    rows = [row for res in results for row in res["rows"]]
    ranked = sorted(
        {r["variant"] for r in rows if not r["variant"].startswith("minmax-only")},
        key=lambda v: sum(r["ms_median"] for r in rows if r["variant"] == v),
    )
    grid = bench_grid(torch, ranked[: args.grid], n, args.calls, args.repeats, copy)
    best = _best(rows + grid)
    exact = all(res["same"][v] for res in results for v in res["same"])
    exact = exact and all(r["bit_exact_vs_cpu"] for r in grid)
    _print(copy, results, grid, best)
    report = {
        "machine": {"host": platform.node(), "python": sys.version.split()[0], **info},
        "elements": n,
        "bins": NBINS,
        "copy": copy,
        "distributions": results,
        "grid": grid,
        "default_variant": k.default_cuda_variant(),
        "fastest": best,
        "target_share_of_copy": TARGET,
        "all_bit_exact": exact,
        "seconds": time.perf_counter() - started,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"all designs bit-exact against the CPU: {'yes' if exact else 'NO'}; wrote {args.json}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
