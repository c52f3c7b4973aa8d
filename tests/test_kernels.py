"""CPU kernels against straightforward numpy references written here, independently of the C++.

The C++ and CUDA backends share one math header, so these tests also pin down the math the GPU
runs; tests/gpu/ only compares the two backends.
"""

from __future__ import annotations

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
