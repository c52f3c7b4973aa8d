"""CPU kernels against straightforward numpy references written here, independently of the C++.

The C++ and CUDA backends share one math header, so these tests also pin down the math the GPU
runs; tests/gpu/ only compares the two backends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import qtool.kernels as k
from qtool.errors import KernelError

# ---------------------------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------------------------


def ref_minmax(x: np.ndarray) -> tuple[float, float, int]:
    x = np.asarray(x, np.float32).ravel()
    finite = x[np.isfinite(x)]
    nonfinite = int(x.size - finite.size)
    if finite.size == 0:
        return float("nan"), float("nan"), nonfinite
    return float(finite.min()), float(finite.max()), nonfinite


def ref_kl_divergences(hist: np.ndarray, num_levels: int, eps: float = 1e-10) -> np.ndarray:
    """TensorRT entropy calibration, one candidate at a time, as specified."""
    hist = np.asarray(hist, np.float64)
    nbins = hist.size
    out = []
    for i in range(num_levels, nbins + 1):
        src = hist[:i]
        p = src.copy()
        p[i - 1] += hist[i:].sum()
        groups = (np.arange(i) * num_levels) // i
        group_sum = np.bincount(groups, weights=src, minlength=num_levels)
        group_nz = np.bincount(groups, weights=(src > 0).astype(np.float64), minlength=num_levels)
        q = np.zeros(i)
        nz = src > 0
        q[nz] = group_sum[groups[nz]] / group_nz[groups[nz]]
        p = p / p.sum()
        if q.sum() > 0:
            q = q / q.sum()
        q = np.maximum(q, eps)
        m = p > 0
        out.append(float(np.sum(p[m] * np.log(p[m] / q[m]))))
    return np.array(out)


def ref_mse_errors(hist: np.ndarray, num_steps: int) -> np.ndarray:
    hist = np.asarray(hist, np.float64)
    centres = np.arange(hist.size) + 0.5
    out = []
    for t in range(1, hist.size + 1):
        step = t / num_steps
        q = np.clip(np.rint(centres / step), 0, num_steps) * step
        out.append(float(np.sum(hist * (centres - q) ** 2) / hist.sum()))
    return np.array(out)


def ref_percentile(hist: np.ndarray, percentile: float) -> float:
    hist = np.asarray(hist, np.float64)
    cum = np.cumsum(hist)
    target = cum[-1] * percentile / 100.0
    b = int(np.searchsorted(cum, target, side="left"))
    before = cum[b] - hist[b]
    return b + (target - before) / hist[b]


def abs_hist(x: np.ndarray, nbins: int) -> tuple[np.ndarray, float]:
    """One-sided histogram of |x| over [0, max|x|], as the calibration code builds it."""
    a = np.abs(x)
    top = float(a.max())
    counts, _ = np.histogram(a, bins=nbins, range=(0.0, top))
    return counts.astype(np.int64), top / nbins


# ---------------------------------------------------------------------------------------------
# min / max
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        np.random.default_rng(0).normal(3.0, 2.0, size=(7, 33, 5)),
        np.full(100, 1.25),
        -np.random.default_rng(1).uniform(1.0, 9.0, size=513),
        np.array([4.0]),
        np.random.default_rng(2).normal(size=1_500_000),  # multi-threaded path
    ],
    ids=["normal", "constant", "all-negative", "single", "large"],
)
def test_tensor_minmax_matches_numpy(data: np.ndarray) -> None:
    assert k.tensor_minmax(data) == ref_minmax(data)


def test_tensor_minmax_ignores_and_counts_nonfinite() -> None:
    x = np.random.default_rng(3).normal(size=1000).astype(np.float32)
    x[[5, 17, 400]] = np.nan
    x[[6, 900]] = [np.inf, -np.inf]
    lo, hi, nf = k.tensor_minmax(x)
    assert nf == 5
    assert (lo, hi, nf) == ref_minmax(x)
    assert np.isfinite(lo) and np.isfinite(hi)


def test_tensor_minmax_all_nonfinite_gives_nan() -> None:
    lo, hi, nf = k.tensor_minmax(np.array([np.nan, np.inf, -np.inf]))
    assert np.isnan(lo) and np.isnan(hi) and nf == 3


def test_tensor_minmax_converts_dtype_and_layout() -> None:
    base = np.random.default_rng(4).integers(-50, 50, size=(40, 30))
    view = base.T[::2]  # int64, non-contiguous
    assert k.tensor_minmax(view) == ref_minmax(view.astype(np.float32))


# ---------------------------------------------------------------------------------------------
# per-channel min / max
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_channel_minmax_matches_numpy(axis: int) -> None:
    x = np.random.default_rng(5).normal(size=(6, 4, 9)).astype(np.float32)
    lo, hi = k.channel_minmax(x, axis=axis)
    reduce = tuple(d for d in range(x.ndim) if d != axis % x.ndim)
    np.testing.assert_array_equal(lo, x.min(axis=reduce))
    np.testing.assert_array_equal(hi, x.max(axis=reduce))
    assert lo.dtype == np.float32 and hi.dtype == np.float32


def test_channel_minmax_nonfinite_and_constant_channels() -> None:
    x = np.random.default_rng(6).normal(size=(4, 50)).astype(np.float32)
    x[1, 3] = np.nan
    x[1, 7] = np.inf
    x[2, :] = -2.5
    x[3, :] = np.nan
    lo, hi = k.channel_minmax(x, axis=0)
    finite = np.isfinite(x[1])
    assert lo[1] == x[1][finite].min() and hi[1] == x[1][finite].max()
    assert lo[2] == hi[2] == np.float32(-2.5)
    assert np.isnan(lo[3]) and np.isnan(hi[3])
    np.testing.assert_array_equal(lo[0], x[0].min())


def test_channel_minmax_large_weight() -> None:
    w = np.random.default_rng(7).normal(size=(512, 64, 3, 3)).astype(np.float64)
    lo, hi = k.channel_minmax(w, axis=0)
    np.testing.assert_array_equal(lo, w.astype(np.float32).reshape(512, -1).min(axis=1))
    np.testing.assert_array_equal(hi, w.astype(np.float32).reshape(512, -1).max(axis=1))


# ---------------------------------------------------------------------------------------------
# histogram
# ---------------------------------------------------------------------------------------------


def test_histogram_bins_values_by_construction() -> None:
    """Values placed strictly inside known bins land exactly there (no edge ambiguity)."""
    rng = np.random.default_rng(8)
    nbins, r = 64, 3.0
    width = 2 * r / nbins
    bins = rng.integers(0, nbins, size=20_000)
    x = -r + (bins + rng.uniform(0.05, 0.95, size=bins.size)) * width
    counts = np.zeros(nbins, np.int64)
    k.histogram_accumulate(x, r, counts)
    np.testing.assert_array_equal(counts, np.bincount(bins, minlength=nbins))


def test_histogram_clamps_out_of_range_and_skips_nonfinite() -> None:
    counts = np.zeros(10, np.int64)
    x = np.array([-100.0, -1.0001, 1.0001, 55.0, 0.05, np.nan, np.inf, -np.inf])
    k.histogram_accumulate(x, 1.0, counts)
    expected = np.zeros(10, np.int64)
    expected[0] = 2
    expected[9] = 2
    expected[5] = 1  # 0.05 is in [0, 0.2)
    np.testing.assert_array_equal(counts, expected)


def test_histogram_accumulates_in_place_and_matches_numpy() -> None:
    rng = np.random.default_rng(9)
    nbins, r = 2048, 4.0
    counts = np.zeros(nbins, np.int64)
    batches = [rng.normal(size=700_000).astype(np.float32) for _ in range(2)]
    for b in batches:
        k.histogram_accumulate(b, r, counts)
    allx = np.clip(np.concatenate(batches), -r, r)
    ref, _ = np.histogram(allx, bins=nbins, range=(-r, r))
    assert counts.sum() == allx.size
    # float32 values within an ulp of a bin edge may round either way; nothing else may differ
    assert np.abs(counts - ref).sum() <= 2e-4 * allx.size


def test_histogram_constant_tensor() -> None:
    counts = np.zeros(8, np.int64)
    k.histogram_accumulate(np.full((3, 5), 0.3), 1.0, counts)
    assert counts[5] == 15 and counts.sum() == 15


# ---------------------------------------------------------------------------------------------
# KL threshold search
# ---------------------------------------------------------------------------------------------


def _assert_best(chosen: int, ref: np.ndarray, first: int) -> None:
    best = int(np.argmin(ref)) + first
    if chosen != best:  # only a floating-point tie may pick another candidate
        assert ref[chosen - first] <= ref.min() * (1 + 1e-9) + 1e-15


def test_kl_matches_numpy_reference_on_gaussian() -> None:
    x = np.random.default_rng(10).normal(size=200_000)
    hist, _ = abs_hist(x, 2048)
    ref = ref_kl_divergences(hist, 128)
    np.testing.assert_allclose(k.kl_divergences(hist, 128), ref, rtol=1e-9, atol=1e-15)
    _assert_best(k.kl_threshold_bins(hist, 128), ref, 128)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_kl_matches_reference_on_sparse_small_histograms(seed: int) -> None:
    rng = np.random.default_rng(seed)
    hist = rng.integers(0, 20, size=37) * (rng.uniform(size=37) < 0.6)
    hist[0] += 1
    ref = ref_kl_divergences(hist, 8)
    np.testing.assert_allclose(k.kl_divergences(hist, 8), ref, rtol=1e-9, atol=1e-15)
    _assert_best(k.kl_threshold_bins(hist, 8), ref, 8)


def test_kl_clips_large_outliers() -> None:
    rng = np.random.default_rng(14)
    x = np.concatenate([rng.normal(size=500_000), [60.0, -75.0, 80.0, 90.0, -100.0]])
    hist, width = abs_hist(x, 2048)
    threshold = k.kl_threshold_bins(hist, 128) * width
    assert 2.0 < threshold < 10.0  # well below max |x| = 100, above the bulk


def test_kl_tiny_histograms_return_nbins() -> None:
    assert k.kl_threshold_bins(np.array([5, 0, 3]), 128) == 3
    assert k.kl_threshold_bins(np.arange(1, 129), 128) == 128


def test_kl_nbins_equal_levels_plus_one_compares_both_candidates() -> None:
    hist = np.array([10, 10, 10, 0, 1000])  # a huge last bin: dropping it costs a lot
    ref = ref_kl_divergences(hist, 4)
    np.testing.assert_allclose(k.kl_divergences(hist, 4), ref, rtol=1e-9)
    assert k.kl_threshold_bins(hist, 4) == 4 + int(np.argmin(ref))


# ---------------------------------------------------------------------------------------------
# percentile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pct", [0.01, 50.0, 99.9, 99.99, 100.0])
def test_percentile_matches_reference(pct: float) -> None:
    rng = np.random.default_rng(15)
    hist = rng.integers(0, 50, size=300) * (rng.uniform(size=300) < 0.7)
    hist[3] += 1
    assert k.percentile_bin(hist, pct) == pytest.approx(ref_percentile(hist, pct), abs=1e-9)


def test_percentile_against_raw_data() -> None:
    x = np.random.default_rng(16).uniform(0.0, 10.0, size=400_000)
    hist, width = abs_hist(x, 2048)
    for pct in (10.0, 90.0, 99.0):
        assert k.percentile_bin(hist, pct) * width == pytest.approx(
            np.percentile(x, pct), abs=width
        )


def test_percentile_100_is_top_of_last_nonzero_bin() -> None:
    assert k.percentile_bin(np.array([1, 2, 0, 4, 0, 0]), 100.0) == pytest.approx(4.0)
    assert k.percentile_bin(np.array([0, 0, 7]), 50.0) == pytest.approx(2.5)


# ---------------------------------------------------------------------------------------------
# MSE threshold search
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_steps", [127, 255, 7])
def test_mse_matches_reference(num_steps: int) -> None:
    x = np.random.default_rng(17).laplace(size=100_000)
    hist, _ = abs_hist(x, 512)
    ref = ref_mse_errors(hist, num_steps)
    np.testing.assert_allclose(k.mse_errors(hist, num_steps), ref, rtol=1e-9, atol=1e-15)
    t = k.mse_threshold_bins(hist, num_steps)
    assert t == float(t) and 1 <= t <= hist.size
    _assert_best(int(t), np.concatenate([[np.inf], ref]), 0)


def test_mse_uniform_data_keeps_full_range() -> None:
    hist = np.zeros(2048, np.int64)
    hist[:100] = 1000  # uniform over [0, 100) bins
    assert 98.0 <= k.mse_threshold_bins(hist, 127) <= 100.0


def test_mse_clips_rare_outliers_and_beats_full_range_on_raw_data() -> None:
    x = np.abs(np.concatenate([np.random.default_rng(18).normal(size=300_000), [40.0, -35.0]]))
    hist, width = abs_hist(x, 2048)
    t = k.mse_threshold_bins(hist, 127) * width
    assert t < 0.6 * x.max()  # two values at 35-40 sigma are not worth the resolution

    def raw_mse(thr: float) -> float:
        step = thr / 127
        return float(np.mean((x - np.clip(np.round(x / step), 0, 127) * step) ** 2))

    assert raw_mse(t) < raw_mse(float(x.max()))


def test_mse_single_bin() -> None:
    assert k.mse_threshold_bins(np.array([5]), 127) == 1.0


# ---------------------------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: k.tensor_minmax(np.zeros(0)),
        lambda: k.channel_minmax(np.zeros((0, 3)), axis=0),
        lambda: k.channel_minmax(np.zeros((2, 3)), axis=2),
        lambda: k.histogram_accumulate(np.zeros(0), 1.0, np.zeros(4, np.int64)),
        lambda: k.histogram_accumulate(np.ones(3), 1.0, np.zeros(0, np.int64)),
        lambda: k.histogram_accumulate(np.ones(3), 0.0, np.zeros(4, np.int64)),
        lambda: k.histogram_accumulate(np.ones(3), float("nan"), np.zeros(4, np.int64)),
        lambda: k.histogram_accumulate(np.ones(3), 1.0, np.zeros(4, np.int32)),
        lambda: k.kl_threshold_bins(np.zeros(0, np.int64)),
        lambda: k.kl_threshold_bins(np.zeros(300, np.int64)),
        lambda: k.kl_threshold_bins(np.array([3, -1, 2])),
        lambda: k.kl_threshold_bins(np.ones(300), num_levels=0),
        lambda: k.percentile_bin(np.ones(10), 0.0),
        lambda: k.percentile_bin(np.ones(10), 100.5),
        lambda: k.percentile_bin(np.zeros(10), 50.0),
        lambda: k.mse_threshold_bins(np.ones(10), 0),
        lambda: k.mse_threshold_bins(np.array([0.5, 2.0]), 127),
        lambda: k.tensor_minmax(np.ones(3), device="tpu"),
    ],
)
def test_bad_arguments_raise_kernel_error(call) -> None:
    with pytest.raises(KernelError) as info:
        call()
    assert "\n" not in str(info.value)


def test_cuda_request_without_device_is_an_error() -> None:
    if k.backends()["cuda"].startswith("loaded"):
        pytest.skip("a CUDA device is present; tests/gpu covers it")
    assert k.default_device() == "cpu"
    with pytest.raises(KernelError, match="CUDA kernels unavailable"):
        k.tensor_minmax(np.ones(4), device="cuda")


def test_missing_cpu_library_says_reinstall(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(k, "CPU_LIB", tmp_path / "libqtool_cpu.so")
    monkeypatch.setattr(k, "_cpu", None)
    with pytest.raises(KernelError, match="reinstall"):
        k.tensor_minmax(np.ones(4))
    assert k.backends()["cpu"].startswith("unavailable")


# ---------------------------------------------------------------------------------------------
# instruction sets, fused observe pass, thread pool
# ---------------------------------------------------------------------------------------------
# Every instruction set the CPU has is forced in turn and compared with numpy: the vector paths
# (AVX2 8 lanes, AVX-512 16 lanes, 4 vectors per step) and their scalar tails must give the very
# bins of the double formula and the same min/max, whatever the length, NaN/Inf placement or
# thread count. Sets this CPU lacks are skipped, so AVX2-only and AVX-512 machines both pass.


def ref_hist(x: np.ndarray, half_range: float, nbins: int) -> np.ndarray:
    """qt_hist_bin in numpy: floor((double(v) + R) * nbins / (2R)), clamped, non-finite skipped."""
    v = np.asarray(x, np.float32).ravel()
    v = v[np.isfinite(v)].astype(np.float64)
    r = np.float64(np.float32(half_range))
    t = (v + r) * (np.float64(nbins) / (2.0 * r))
    bins = np.where(t < 0.0, 0, np.where(t >= nbins, nbins - 1, np.floor(t))).astype(np.int64)
    return np.bincount(bins, minlength=nbins)


def _edge_values(half_range: float, nbins: int) -> np.ndarray:
    """Floats at and next to every bin edge, the range ends, and tiny values around R * 2^-54
    (where the double sum v + R starts rounding onto R), both signs."""
    r = np.float32(half_range)
    edges = (-r + np.arange(nbins + 1) * (2 * r / nbins)).astype(np.float32)
    near = [
        edges,
        np.nextafter(edges, np.float32(np.inf)),
        np.nextafter(edges, np.float32(-np.inf)),
    ]
    tau = np.float64(r) * 2.0**-54
    tiny = np.array([tau * f for f in (0.5, 0.99, 1.0, 1.01, 1.5, 2.0, 2.01, 1e-3)], np.float32)
    subnormal = np.array([1e-45, 3e-42, 1.1754942e-38, 1.1754944e-38], np.float32)
    special = np.array([0.0, r * 0.999, r, r * 1.001, 3.4e38], np.float32)
    pos = np.concatenate([*near, tiny, subnormal, special])
    return np.concatenate([pos, -pos]).astype(np.float32)


LENGTHS = [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000]


@pytest.mark.parametrize("n", LENGTHS)
def test_each_isa_minmax_and_histogram_match_numpy_at_every_length(isa, n) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 3
    assert k.tensor_minmax(x) == ref_minmax(x)
    for r, nbins in ((8.0, 4096), (3.0, 3000), (0.5, 10)):  # float path, double path, odd sizes
        counts = np.zeros(nbins, np.int64)
        k.histogram_accumulate(x, r, counts)
        np.testing.assert_array_equal(counts, ref_hist(x, r, nbins))


@pytest.mark.parametrize("r,nbins", [(1.0, 4096), (8.0, 256), (2.0**-20, 1024), (0.75, 4096)])
def test_each_isa_bins_values_on_and_next_to_bin_edges_like_the_double_formula(isa, r, nbins):
    values = _edge_values(r, nbins)
    counts = np.zeros(nbins, np.int64)
    k.histogram_accumulate(values, r, counts)
    np.testing.assert_array_equal(counts, ref_hist(values, r, nbins))
    # one value at a time (40 copies: vector lanes and tail), so no two errors can cancel
    for v in values[:: max(1, len(values) // 300)]:
        one = np.zeros(nbins, np.int64)
        k.histogram_accumulate(np.full(40, v, np.float32), r, one)
        np.testing.assert_array_equal(one, ref_hist(np.full(40, v, np.float32), r, nbins), str(v))


def test_each_isa_observe_accumulates_exactly_when_every_value_is_inside(isa) -> None:
    rng = np.random.default_rng(20)
    for nbins, r in ((4096, 4.0), (1000, 4.0)):  # speculative float path and the double path
        x = rng.uniform(-3.99, 3.99, size=100_003).astype(np.float32)
        counts = np.arange(nbins, dtype=np.int64)
        lo, hi, nf, done = k.observe(x, r, counts)
        assert done and nf == 0 and (lo, hi) == (float(x.min()), float(x.max()))
        np.testing.assert_array_equal(counts, np.arange(nbins) + ref_hist(x, r, nbins))
        # edge-of-range values: counted while strictly inside, rejected at |x| = R
        edges = _edge_values(r, nbins)
        inside = edges[np.abs(edges) < r]
        counts = np.zeros(nbins, np.int64)
        assert k.observe(inside, r, counts)[3]
        np.testing.assert_array_equal(counts, ref_hist(inside, r, nbins))


@pytest.mark.parametrize("bad", [4.0, -4.0, 1e30, np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", [0, 50_000, 100_002])  # first vector, middle, scalar tail
def test_each_isa_observe_leaves_counts_untouched_when_a_value_is_outside(isa, bad, where):
    x = np.random.default_rng(21).uniform(-3.9, 3.9, size=100_003).astype(np.float32)
    x[where] = bad
    counts = np.arange(4096, dtype=np.int64)
    lo, hi, nf, done = k.observe(x, 4.0, counts)
    assert not done
    np.testing.assert_array_equal(counts, np.arange(4096))
    assert (lo, hi, nf) == ref_minmax(x)  # min/max stay exact when the histogram is dropped


def test_observe_with_zero_range_computes_min_max_only(isa) -> None:
    counts = np.zeros(8, np.int64)
    assert k.observe(np.array([0.0, -2.0, 5.0]), 0.0, counts) == (-2.0, 5.0, 0, False)
    assert not counts.any()
    assert k.observe(np.zeros(70), 0.0, counts) == (0.0, 0.0, 0, False)


@pytest.mark.parametrize("n", [3, 40, 100_001])
def test_each_isa_orders_signed_zeros_the_same_way(isa, n) -> None:
    """-0.0 < +0.0 for min/max, so a zero result does not depend on lanes, threads or order."""
    rng = np.random.default_rng(n)
    x = np.abs(rng.standard_normal(n)).astype(np.float32) + 1
    x[rng.choice(n, size=2, replace=False)] = [0.0, -0.0]
    lo, hi, _ = k.tensor_minmax(x)
    assert lo == 0.0 and np.signbit(lo)
    lo, hi, _, _ = k.observe(-x, 2.0**40, np.zeros(16, np.int64))
    assert hi == 0.0 and not np.signbit(hi)
    assert np.signbit(k.tensor_minmax(np.full(n, -0.0))[1])  # only -0.0: max is -0.0
    assert not np.signbit(k.tensor_minmax(np.zeros(n))[0])  # only +0.0: min is +0.0
    lo_c, hi_c = k.channel_minmax(np.stack([x, -x]), axis=0)
    assert np.signbit(lo_c[0]) and not np.signbit(hi_c[1])


def test_each_isa_nonfinite_values_in_vectors_and_tails(isa) -> None:
    x = np.random.default_rng(22).standard_normal(1003).astype(np.float32)
    x[[0, 9, 40, 41, 500, 1001, 1002]] = [np.nan, np.inf, -np.inf, np.nan, np.inf, np.nan, -np.inf]
    assert k.tensor_minmax(x) == ref_minmax(x)
    counts = np.zeros(4096, np.int64)
    k.histogram_accumulate(x, 8.0, counts)
    np.testing.assert_array_equal(counts, ref_hist(x, 8.0, 4096))
    lo, hi, nf = k.tensor_minmax(np.full(50, np.nan, np.float32))
    assert np.isnan(lo) and np.isnan(hi) and nf == 50


def test_results_do_not_depend_on_the_thread_count(isa, threads) -> None:
    """Several 2^18-element tasks, so N threads really split the work."""
    rng = np.random.default_rng(23)
    x = np.maximum(rng.standard_t(3, size=1_300_007), 0).astype(np.float32)  # zeros: Relu-like
    x[777] = -0.0
    results = []
    for n in (1, 2, 3):
        threads(n)
        assert k.cpu_threads() == n
        counts = np.zeros(4096, np.int64)
        r = 2.0 ** np.ceil(np.log2(float(x.max()) + 1))
        out = k.observe(x, r, counts)
        h = np.zeros(3000, np.int64)
        k.histogram_accumulate(x, 7.5, h)
        lo, hi = k.channel_minmax(x[:1_300_000].reshape(100, -1), axis=0)
        results.append((out, counts, h, lo, hi))
    first = results[0]
    assert first[0][3]
    np.testing.assert_array_equal(first[1], ref_hist(x, r, 4096))
    np.testing.assert_array_equal(first[2], ref_hist(x, 7.5, 3000))
    for other in results[1:]:
        assert other[0] == first[0] and np.signbit(other[0][0]) == np.signbit(first[0][0])
        for a, b in zip(other[1:], first[1:], strict=True):
            np.testing.assert_array_equal(a, b)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_thread_pool_is_created_once_and_reused(threads) -> None:
    threads(3)
    x = np.random.default_rng(24).standard_normal(2_000_000).astype(np.float32)
    k.tensor_minmax(x)  # starts the pool's threads if this process has none yet
    before = _os_threads()
    for _ in range(20):
        k.tensor_minmax(x)
        k.observe(x, 16.0, np.zeros(4096, np.int64))
        k.histogram_accumulate(x, 16.0, np.zeros(4096, np.int64))
    assert _os_threads() == before  # no thread is spawned (or left behind) per call


def test_isa_and_thread_settings_are_validated() -> None:
    assert k.cpu_isa() == k.supported_cpu_isas()[-1]  # the best one by default
    assert "scalar" in k.supported_cpu_isas()
    with pytest.raises(KernelError, match="unknown CPU instruction set"):
        k.set_cpu_isa("sse9")
    with pytest.raises(KernelError, match="from 1 to 64"):
        k.set_cpu_threads(0)
    missing = [name for name in k.CPU_ISAS if name not in k.supported_cpu_isas()]
    if missing:
        with pytest.raises(KernelError, match="does not support"):
            k.set_cpu_isa(missing[0])
        assert k.cpu_isa() == k.supported_cpu_isas()[-1]


def _run_env(env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_environment_forces_isa_and_threads() -> None:
    code = "import qtool.kernels as k; print(k.cpu_isa(), k.cpu_threads())"
    proc = _run_env({"QTOOL_CPU_ISA": "scalar", "QTOOL_CPU_THREADS": "3"}, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["scalar", "3"]
    bad = _run_env({"QTOOL_CPU_ISA": "sse9"}, code)
    assert bad.returncode != 0 and "QTOOL_CPU_ISA='sse9'" in bad.stderr
    missing = [name for name in k.CPU_ISAS if name not in k.supported_cpu_isas()]
    if missing:
        proc = _run_env({"QTOOL_CPU_ISA": missing[0]}, code)
        assert proc.returncode != 0 and "does not support" in proc.stderr


@pytest.mark.parametrize(
    "call",
    [
        lambda: k.observe(np.zeros(0), 1.0, np.zeros(4, np.int64)),
        lambda: k.observe(np.ones(3), -1.0, np.zeros(4, np.int64)),
        lambda: k.observe(np.ones(3), float("inf"), np.zeros(4, np.int64)),
        lambda: k.observe(np.ones(3), 1.0, np.zeros(4, np.int32)),
        lambda: k.observe(np.ones(3), 1.0, np.zeros(0, np.int64)),
    ],
)
def test_observe_bad_arguments_raise_kernel_error(call) -> None:
    with pytest.raises(KernelError):
        call()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_working_pool(threads) -> None:
    """The child inherits the pool object but none of its threads; it must build its own rather
    than wait forever for workers that do not exist."""
    threads(2)
    x = np.random.default_rng(25).standard_normal(1_500_000).astype(np.float32)
    expected = k.tensor_minmax(x)  # the parent's pool threads exist now
    pid = os.fork()
    if pid == 0:  # child: exit code 0 only if the multi-threaded kernels work
        ok = False
        try:
            ok = k.tensor_minmax(x) == expected
            counts = np.zeros(4096, np.int64)
            ok = ok and k.observe(x, 8.0, counts)[3] and int(counts.sum()) == x.size
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung in the kernel thread pool")


# ---------------------------------------------------------------------------------------------
# staged counting: uint16 copies flushed per block, adaptive copies, early stop
# ---------------------------------------------------------------------------------------------
# The vector kernels count into uint16 staging slots (2, 4 or 8 copies, chosen per block of
# 32768 x copies elements from the block before) and flush them into int64 counts; exact zeros
# count into their own slots. These tests cross those block boundaries on one thread (so one
# thread sees every block) and on several, with the very bins of the double formula.

BLOCK = 4 * 32768  # the first block of a large call: 4 copies


def _observe_exact(x: np.ndarray, r: float, nbins: int = 4096) -> np.ndarray:
    counts = np.zeros(nbins, np.int64)
    lo, hi, nf, done = k.observe(x, r, counts)
    assert done and nf == 0
    assert (lo, hi, nf) == ref_minmax(x)
    return counts


@pytest.mark.parametrize("n_threads", [1, 2])
def test_each_isa_counts_past_uint16_in_one_bin_across_blocks(isa, threads, n_threads) -> None:
    """A constant tensor puts every value in one bin: each copy's slot reaches 32768 per block
    and the int64 counts must hold the total (no uint16 wrap at 65536)."""
    threads(n_threads)
    n = 5 * BLOCK + 37
    x = np.full(n, 0.7, np.float32)
    counts = _observe_exact(x, 1.0)
    np.testing.assert_array_equal(counts, ref_hist(x, 1.0, 4096))
    assert counts.max() == n
    h = np.zeros(3000, np.int64)  # the exact kernel, double path
    k.histogram_accumulate(x, 1.0, h)
    np.testing.assert_array_equal(h, ref_hist(x, 1.0, 3000))


def test_each_isa_switches_copies_between_blocks_and_stays_exact(isa, threads) -> None:
    """Spread blocks (2 copies next), peaked ones (4) and a few values (8) alternate; lengths
    are not multiples of any vector width or block."""
    threads(1)
    rng = np.random.default_rng(30)
    parts = []
    for i in range(9):
        size = 2 * BLOCK + 1000 * i + 13
        if i % 3 == 0:
            parts.append(rng.uniform(-3.99, 3.99, size=size))  # 4096 bins alike: 2 copies
        elif i % 3 == 1:
            parts.append(rng.normal(0.0, 0.05, size=size))  # fullest bin ~1/64: 4 copies
        else:
            parts.append(rng.choice([-1.5, 0.25, 3.0], size=size))  # three bins: 8 copies
    x = np.concatenate(parts).astype(np.float32)
    np.testing.assert_array_equal(_observe_exact(x, 4.0), ref_hist(x, 4.0, 4096))
    for nbins, r in ((4096, 4.0), (1000, 4.0)):  # exact float and double paths
        h = np.zeros(nbins, np.int64)
        k.histogram_accumulate(x, r, h)
        np.testing.assert_array_equal(h, ref_hist(x, r, nbins))


@pytest.mark.parametrize("n", [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 63, 3 * BLOCK + 65])
def test_each_isa_zeros_and_tails_at_block_boundaries(isa, threads, n) -> None:
    threads(1)
    rng = np.random.default_rng(n)
    x = np.maximum(rng.standard_normal(n), 0).astype(np.float32)  # half exact zeros
    x[rng.choice(n, size=50, replace=False)] = -0.0
    x[-1] = 0.0
    r = 8.0
    np.testing.assert_array_equal(_observe_exact(x, r), ref_hist(x, r, 4096))
    h = np.zeros(4096, np.int64)
    k.histogram_accumulate(x, r, h)
    np.testing.assert_array_equal(h, ref_hist(x, r, 4096))


@pytest.mark.parametrize("where", [BLOCK - 1, BLOCK, 2 * BLOCK + 5, 3 * BLOCK + 60])
def test_each_isa_nonfinite_values_at_block_boundaries_are_skipped(isa, threads, where) -> None:
    """The exact kernel bins every finite value and skips NaN/Inf wherever they fall."""
    threads(1)
    x = np.random.default_rng(31).standard_normal(3 * BLOCK + 64).astype(np.float32)
    x[[where, where - 1, 7]] = [np.nan, np.inf, -np.inf]
    h = np.zeros(4096, np.int64)
    k.histogram_accumulate(x, 8.0, h)
    np.testing.assert_array_equal(h, ref_hist(x, 8.0, 4096))
    assert k.tensor_minmax(x) == ref_minmax(x)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("bad", [np.nan, np.inf, 9.0])
def test_each_isa_range_growth_mid_tensor_then_exact_again(isa, threads, n_threads, bad) -> None:
    """A value outside the range several blocks in: the speculative pass stops, leaves the counts
    untouched and still reports exact min/max; the thread's staging is clean afterwards, so the
    next call (at the grown range) and a call at another bin count are exact."""
    threads(n_threads)
    rng = np.random.default_rng(32)
    x = rng.uniform(-3.9, 3.9, size=4 * BLOCK + 11).astype(np.float32)
    x[3 * BLOCK + 100] = bad
    counts = np.arange(4096, dtype=np.int64)
    lo, hi, nf, done = k.observe(x, 4.0, counts)
    assert not done
    np.testing.assert_array_equal(counts, np.arange(4096))
    assert (lo, hi, nf) == ref_minmax(x)
    if np.isfinite(bad):
        np.testing.assert_array_equal(_observe_exact(x, 16.0), ref_hist(x, 16.0, 4096))
    y = x[np.isfinite(x)][: 2 * BLOCK]
    np.testing.assert_array_equal(_observe_exact(y, 16.0, 64), ref_hist(y, 16.0, 64))
    np.testing.assert_array_equal(_observe_exact(y, 4.0, 4096), ref_hist(y, 4.0, 4096))


def test_each_isa_calls_with_other_bin_counts_start_from_clean_counts(isa, threads) -> None:
    """Per-thread counts are reused across calls and cleared only over the bins a call used."""
    threads(1)
    rng = np.random.default_rng(33)
    high = rng.uniform(3.0, 3.99, size=BLOCK + 5).astype(np.float32)  # the top bins only
    low = rng.uniform(-3.99, -3.0, size=300).astype(np.float32)
    for x, nbins in ((high, 4096), (low, 16), (high, 8), (low, 4096), (high[:100], 4096)):
        np.testing.assert_array_equal(_observe_exact(x, 4.0, nbins), ref_hist(x, 4.0, nbins))
