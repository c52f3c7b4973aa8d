"""Every CUDA kernel against the CPU one (itself checked against numpy in tests/test_kernels.py).

Both backends call the same math header, so histograms and min/max must agree exactly; the
searches may only differ by floating-point summation order.
"""

from __future__ import annotations

import numpy as np
import pytest

import qtool.kernels as k


def _data(n: int, seed: int, nonfinite: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(size=n - n // 10), rng.standard_t(2, size=n // 10)])
    x = x.astype(np.float32)
    rng.shuffle(x)
    if nonfinite:
        idx = rng.choice(n, size=min(n, 37), replace=False)
        x[idx[:20]] = np.nan
        x[idx[20:30]] = np.inf
        x[idx[30:]] = -np.inf
    return x


def _abs_hist(x: np.ndarray, nbins: int) -> np.ndarray:
    a = np.abs(x[np.isfinite(x)])
    counts, _ = np.histogram(a, bins=nbins, range=(0.0, float(a.max())))
    return counts.astype(np.int64)


def test_default_device_is_cuda() -> None:
    assert k.default_device() == "cuda"


@pytest.mark.parametrize("n", [1, 1000, 3_000_001, 50_000_000])
def test_tensor_minmax(n: int) -> None:
    x = _data(n, seed=n % 97, nonfinite=n > 1)
    assert k.tensor_minmax(x, device="cuda") == k.tensor_minmax(x, device="cpu")


def test_tensor_minmax_all_nonfinite() -> None:
    lo, hi, nf = k.tensor_minmax(np.full(5000, np.nan, np.float32), device="cuda")
    assert np.isnan(lo) and np.isnan(hi) and nf == 5000


@pytest.mark.parametrize(
    "shape,axis",
    [((64, 3, 3, 3), 0), ((4096, 4096), 0), ((7, 100_000), 0), ((32, 1), 0), ((5, 6, 7), 1)],
)
def test_channel_minmax(shape: tuple[int, ...], axis: int) -> None:
    x = _data(int(np.prod(shape)), seed=len(shape), nonfinite=True).reshape(shape)
    lo_c, hi_c = k.channel_minmax(x, axis=axis, device="cuda")
    lo, hi = k.channel_minmax(x, axis=axis, device="cpu")
    np.testing.assert_array_equal(lo_c, lo)
    np.testing.assert_array_equal(hi_c, hi)


@pytest.mark.parametrize("nbins", [1, 128, 2048, 12288, 16384, 100_000])  # shared and global paths
@pytest.mark.parametrize("n", [1000, 20_000_000])
def test_histogram(nbins: int, n: int) -> None:
    x = _data(n, seed=3, nonfinite=True)
    start = np.arange(nbins, dtype=np.int64) % 3  # accumulation keeps prior counts
    gpu, cpu = start.copy(), start.copy()
    k.histogram_accumulate(x, 2.5, gpu, device="cuda")
    k.histogram_accumulate(x, 2.5, cpu, device="cpu")
    np.testing.assert_array_equal(gpu, cpu)
    assert gpu.sum() - start.sum() == np.isfinite(x).sum()


@pytest.mark.parametrize("nbins", [4096, 3000, 16384])  # shared and global histogram paths
@pytest.mark.parametrize("bad", [None, 3.0, np.nan])  # inside, out of range, non-finite
def test_observe(nbins: int, bad: float | None) -> None:
    x = np.clip(_data(5_000_001, seed=nbins), -2.9, 2.9)
    if bad is not None:
        x[123_457] = bad
    start = np.arange(nbins, dtype=np.int64) % 5
    gpu, cpu = start.copy(), start.copy()
    out_gpu = k.observe(x, 3.0, gpu, device="cuda")
    out_cpu = k.observe(x, 3.0, cpu, device="cpu")
    assert out_gpu[2:] == out_cpu[2:] and out_gpu[3] == (bad is None)
    np.testing.assert_array_equal(out_gpu[:2], out_cpu[:2])
    np.testing.assert_array_equal(gpu, cpu)
    assert k.observe(x, 0.0, gpu, device="cuda")[3] is False


@pytest.mark.parametrize("nbins,levels", [(2048, 128), (8192, 128), (300, 255), (40, 8), (50, 128)])
def test_kl(nbins: int, levels: int) -> None:
    hist = _abs_hist(_data(2_000_000, seed=nbins), nbins)
    if nbins >= levels:
        np.testing.assert_allclose(
            k.kl_divergences(hist, levels, device="cuda"),
            k.kl_divergences(hist, levels, device="cpu"),
            rtol=1e-10,
            atol=1e-14,
        )
    gpu = k.kl_threshold_bins(hist, levels, device="cuda")
    cpu = k.kl_threshold_bins(hist, levels, device="cpu")
    if gpu != cpu:  # only a floating-point tie may differ
        kl = k.kl_divergences(hist, levels, device="cpu")
        assert kl[gpu - levels] <= kl.min() * (1 + 1e-9)


def test_kl_sparse_histogram() -> None:
    rng = np.random.default_rng(5)
    hist = rng.integers(0, 1000, size=4096) * (rng.uniform(size=4096) < 0.3)
    hist[0] += 1
    np.testing.assert_allclose(
        k.kl_divergences(hist, 128, device="cuda"), k.kl_divergences(hist, 128), rtol=1e-10
    )


@pytest.mark.parametrize("nbins,steps", [(2048, 127), (2048, 255), (1, 127), (5000, 15)])
def test_mse(nbins: int, steps: int) -> None:
    hist = _abs_hist(_data(1_000_000, seed=nbins), nbins)
    np.testing.assert_allclose(
        k.mse_errors(hist, steps, device="cuda"), k.mse_errors(hist, steps), rtol=1e-10, atol=0
    )
    gpu = k.mse_threshold_bins(hist, steps, device="cuda")
    cpu = k.mse_threshold_bins(hist, steps, device="cpu")
    if gpu != cpu:
        err = k.mse_errors(hist, steps)
        assert err[int(gpu) - 1] <= err.min() * (1 + 1e-9)
