"""CPU vs CUDA time of the calibration kernels on one large activation-sized tensor.

Times what a calibration step does per tensor: min/max, a histogram of the values, and the KL /
MSE threshold searches on a 2048-bin |x| histogram. CUDA times include the host-to-device copies
the numpy API makes. Prints a table and one JSON line (machine-readable for CI logs).

    python benchmarks/kernels.py [--elements 67108864] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np

import qtool.kernels as k


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: library load, CUDA context
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 26)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    x = np.random.default_rng(0).standard_t(4, size=args.elements).astype(np.float32)
    lo, hi, _ = k.tensor_minmax(x)
    half = max(abs(lo), abs(hi))
    sym = np.zeros(4096, np.int64)
    k.histogram_accumulate(x, half, sym)
    hist = sym[2048:] + sym[:2048][::-1]  # fold [-R, R] into |x| over [0, R]

    devices = ["cpu"] + (["cuda"] if k.default_device() == "cuda" else [])
    cases: dict[str, Callable[[str], object]] = {
        "tensor_minmax": lambda d: k.tensor_minmax(x, device=d),
        "histogram_4096": lambda d: k.histogram_accumulate(x, half, np.zeros(4096, np.int64), d),
        "kl_2048": lambda d: k.kl_threshold_bins(hist, 128, device=d),
        "mse_2048": lambda d: k.mse_threshold_bins(hist, 127, device=d),
    }
    results: dict[str, dict[str, float]] = {}
    for name, fn in cases.items():
        results[name] = {d: _median_ms(lambda d=d, fn=fn: fn(d), args.repeats) for d in devices}
    results["histogram+kl"] = {
        d: results["histogram_4096"][d] + results["kl_2048"][d] for d in devices
    }

    print(f"{args.elements:,} float32 elements, median of {args.repeats} runs (ms)")
    print(
        f"{'kernel':<16}"
        + "".join(f"{d:>12}" for d in devices)
        + (f"{'speedup':>10}" if "cuda" in devices else "")
    )
    for name, row in results.items():
        line = f"{name:<16}" + "".join(f"{row[d]:>12.2f}" for d in devices)
        if "cuda" in devices:
            line += f"{row['cpu'] / row['cuda']:>9.1f}x"
        print(line)
    print(json.dumps({"elements": args.elements, "backends": k.backends(), "ms": results}))


if __name__ == "__main__":
    main()
