"""Every CUDA kernel against the CPU one (itself checked against numpy in tests/test_kernels.py),
on the same inputs, for every CUDA observe design (the `cuda_variant` fixture, conftest.py).

Both backends compute with the same math header, so min/max (sign of zero included), histograms,
observe's decision and the MSE errors and thresholds must be identical: compared bit for bit,
never with a tolerance. Only the KL divergences may differ in the last bits: libm's log and
CUDA's log are both within an ulp but not the same function.

Inputs are built to reach every path: Gaussian and heavy-tailed data, ReLU outputs (half exact
zeros), NaN/Inf, both zeros, values exactly on and next to bin edges, denormals, the observer's
power-of-two geometry (float32 bins) and others (double bins), histograms that fit shared memory
and ones that do not, a pointer 4, 8 or 12 bytes off a 16-byte boundary, tiny and large tensors,
and several grid sizes.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest

import qtool.kernels as k
from qtool.calibration.observers import HistogramObserver


@lru_cache(maxsize=8)
def _cached(n: int, seed: int, nonfinite: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(size=n - n // 10), rng.standard_t(2, size=n // 10)])
    x = x.astype(np.float32)
    rng.shuffle(x)
    if nonfinite:
        idx = rng.choice(n, size=min(n, 37), replace=False)
        x[idx[:20]] = np.nan
        x[idx[20:30]] = np.inf
        x[idx[30:]] = -np.inf
    x.setflags(write=False)
    return x


def _data(n: int, seed: int, nonfinite: bool = False) -> np.ndarray:
    return _cached(n, seed, nonfinite).copy()


def _edges(half_range: float, nbins: int) -> np.ndarray:
    """Values on every bin edge of [-R, R], one float32 step either side, zeros of both signs,
    denormals and values near +-R."""
    edges = (-half_range + np.arange(nbins + 1) * (2.0 * half_range / nbins)).astype(np.float32)
    near = [np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(-np.inf))]
    tiny = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 1e-30, -1e-30], np.float32)
    return np.concatenate([edges, *near, tiny])


def _same(a: float, b: float) -> bool:
    """Equal as float32 bit patterns (so -0.0 != 0.0), any NaN equal to any NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return np.float32(a).view(np.uint32) == np.float32(b).view(np.uint32)


def _same_minmax(gpu: tuple, cpu: tuple) -> bool:
    return _same(gpu[0], cpu[0]) and _same(gpu[1], cpu[1]) and tuple(gpu[2:]) == tuple(cpu[2:])


def _abs_hist(x: np.ndarray, nbins: int) -> np.ndarray:
    a = np.abs(x[np.isfinite(x)])
    counts, _ = np.histogram(a, bins=nbins, range=(0.0, float(a.max())))
    return counts.astype(np.int64)


def test_default_device_is_cuda() -> None:
    assert k.default_device() == "cuda"


def test_variants_are_listed_and_selectable() -> None:
    names = k.cuda_variants()
    assert len(names) == len(set(names)) >= 2
    assert k.default_cuda_variant() in names
    assert k.cuda_variant() == k.default_cuda_variant()
    try:
        k.set_cuda_variant(names[0], blocks_per_sm=2)
        assert k.cuda_variant() == names[0]
    finally:
        k.set_cuda_variant(None)
    assert k.cuda_variant() == k.default_cuda_variant()
    with pytest.raises(k.KernelError, match="unknown CUDA variant"):
        k.set_cuda_variant("no-such-design")


@pytest.mark.parametrize("n", [1, 7, 1000, 3_000_001, 50_000_000])
def test_tensor_minmax(cuda_variant: str, n: int) -> None:
    x = _data(n, seed=n % 97, nonfinite=n > 1)
    assert _same_minmax(k.tensor_minmax(x, device="cuda"), k.tensor_minmax(x, device="cpu"))


@pytest.mark.parametrize(
    "values",
    [[-0.0, 0.0], [0.0, -0.0], [-0.0] * 5, [0.0] * 5, [0.0, -0.0, 3.0], [-2.0, -0.0], [np.nan]],
)
@pytest.mark.parametrize("repeat", [1, 1_000_003])  # one block and many
def test_tensor_minmax_signed_zeros(cuda_variant: str, values: list, repeat: int) -> None:
    x = np.tile(np.asarray(values, np.float32), repeat)
    gpu, cpu = k.tensor_minmax(x, device="cuda"), k.tensor_minmax(x, device="cpu")
    assert _same_minmax(gpu, cpu), (gpu, cpu)


def test_tensor_minmax_all_nonfinite(cuda_variant: str) -> None:
    lo, hi, nf = k.tensor_minmax(np.full(5000, np.nan, np.float32), device="cuda")
    assert np.isnan(lo) and np.isnan(hi) and nf == 5000


@pytest.mark.parametrize(
    "shape,axis",
    [((64, 3, 3, 3), 0), ((4096, 4096), 0), ((7, 100_000), 0), ((32, 1), 0), ((5, 6, 7), 1)],
)
def test_channel_minmax(shape: tuple[int, ...], axis: int) -> None:
    x = _data(int(np.prod(shape)), seed=len(shape), nonfinite=True).reshape(shape)
    x.reshape(-1)[::7] = -0.0  # signed zeros: the channel's min must be -0.0 where it is 0
    lo_c, hi_c = k.channel_minmax(x, axis=axis, device="cuda")
    lo, hi = k.channel_minmax(x, axis=axis, device="cpu")
    np.testing.assert_array_equal(lo_c.view(np.uint32), lo.view(np.uint32))
    np.testing.assert_array_equal(hi_c.view(np.uint32), hi.view(np.uint32))


@pytest.mark.parametrize("half_range", [2.5, 4.0])  # double bins; power-of-two (float) bins
@pytest.mark.parametrize("nbins", [1, 128, 3000, 4096, 16384, 100_000])  # shared and global
@pytest.mark.parametrize("n", [1000, 20_000_000])
def test_histogram(cuda_variant: str, nbins: int, n: int, half_range: float) -> None:
    x = np.concatenate([_data(n, seed=3, nonfinite=True), _edges(half_range, min(nbins, 4096))])
    start = np.arange(nbins, dtype=np.int64) % 3  # accumulation keeps prior counts
    gpu, cpu = start.copy(), start.copy()
    k.histogram_accumulate(x, half_range, gpu, device="cuda")
    k.histogram_accumulate(x, half_range, cpu, device="cpu")
    np.testing.assert_array_equal(gpu, cpu)
    assert gpu.sum() - start.sum() == np.isfinite(x).sum()


@pytest.mark.parametrize("half_range,nbins", [(3.0, 4096), (3.0, 3000), (3.0, 16384), (4.0, 4096)])
@pytest.mark.parametrize("bad", [None, "R", np.nan])  # inside, out of range (+R), non-finite
def test_observe(cuda_variant: str, half_range: float, nbins: int, bad: float | str | None) -> None:
    x = np.clip(_data(5_000_001, seed=nbins), -2.9, 2.9)
    x[1000 : 1000 + 4097] = _edges(2.5, 4096)[:4097]  # bin edges inside the range
    x[::11] = 0.0
    x[::13] = -0.0
    if bad is not None:
        x[123_457] = half_range if bad == "R" else bad
    start = np.arange(nbins, dtype=np.int64) % 5
    gpu, cpu = start.copy(), start.copy()
    out_gpu = k.observe(x, half_range, gpu, device="cuda")
    out_cpu = k.observe(x, half_range, cpu, device="cpu")
    assert _same_minmax(out_gpu, out_cpu), (out_gpu, out_cpu)
    assert out_gpu[3] == (bad is None)
    np.testing.assert_array_equal(gpu, cpu)
    assert k.observe(x, 0.0, gpu, device="cuda")[3] is False
    np.testing.assert_array_equal(gpu, cpu)  # min/max only: counts untouched


@lru_cache(maxsize=8)
def _activation(kind: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    if kind == "relu":  # half exact zeros: the zeros-in-registers designs' case
        x = np.maximum(rng.standard_normal(n, dtype=np.float32), 0)
    elif kind == "t2":  # heavy tails: a peaked histogram at the range that holds the outliers
        x = rng.standard_t(2, size=n).astype(np.float32)
    elif kind == "constant":  # every value in one bin
        x = np.full(n, 0.3, np.float32)
    else:  # denormals and zeros of both signs
        x = (rng.standard_normal(n) * 1e-40).astype(np.float32)
    x.setflags(write=False)
    return x


@pytest.mark.parametrize("kind", ["relu", "t2", "constant", "tiny"])
@pytest.mark.parametrize("n", [33, 20_000_001])
def test_observe_activations(cuda_variant: str, kind: str, n: int) -> None:
    """What calibration sees, at the observer's geometry (4096 bins, R a power of two)."""
    x = _activation(kind, n)
    _, hi, _ = k.tensor_minmax(np.abs(x), device="cpu")
    half_range = float(2.0 ** (math.floor(math.log2(hi)) + 1)) if hi > 0 else 1.0
    gpu, cpu = np.zeros(4096, np.int64), np.zeros(4096, np.int64)
    out_gpu = k.observe(x, half_range, gpu, device="cuda")
    out_cpu = k.observe(x, half_range, cpu, device="cpu")
    assert _same_minmax(out_gpu, out_cpu), (out_gpu, out_cpu)
    assert out_cpu[3] is True
    np.testing.assert_array_equal(gpu, cpu)


def test_observer_stream_matches_the_cpu_observer(cuda_variant: str) -> None:
    """HistogramObserver as calibration drives it: batches that grow the range, a first batch of
    zeros, signed zeros; the TensorStats must be identical."""
    rng = np.random.default_rng(7)
    batches = [np.zeros(1000, np.float32), -np.zeros(777, np.float32)]
    for scale in (0.1, 1.0, 0.5, 30.0, 2.0):
        batches.append((rng.standard_t(3, size=2_000_000) * scale).astype(np.float32))
    batches.append(np.maximum(rng.standard_normal(3_000_000, dtype=np.float32), 0))
    stats = []
    for device in ("cuda", "cpu"):
        observer = HistogramObserver("t", 4096, device=device)
        for b in batches:
            observer.update(b)
        stats.append(observer.result())
    gpu, cpu = stats
    assert _same(gpu.minimum, cpu.minimum) and _same(gpu.maximum, cpu.maximum)
    assert gpu.half_range == cpu.half_range and gpu.samples == cpu.samples
    np.testing.assert_array_equal(gpu.counts, cpu.counts)


@pytest.mark.parametrize("blocks_per_sm", [1, 3, 40])
def test_grid_size_does_not_change_results(cuda_variant: str, blocks_per_sm: int) -> None:
    x = _data(20_000_000, seed=5)
    x[::17] = -0.0
    try:
        k.set_cuda_variant(cuda_variant, blocks_per_sm=blocks_per_sm)
        gpu = np.zeros(4096, np.int64)
        out_gpu = k.observe(np.clip(x, -7.9, 7.9), 8.0, gpu, device="cuda")
    finally:
        k.set_cuda_variant(cuda_variant)
    cpu = np.zeros(4096, np.int64)
    out_cpu = k.observe(np.clip(x, -7.9, 7.9), 8.0, cpu, device="cpu")
    assert _same_minmax(out_gpu, out_cpu) and out_cpu[3] is True
    np.testing.assert_array_equal(gpu, cpu)


def test_observe_on_device_at_every_alignment(cuda_variant: str) -> None:
    """observe_on_device on torch CUDA memory, starting 0, 4, 8 and 12 bytes past a 16-byte
    boundary, with lengths around the vector width: the scalar head and tail of the float4
    designs must count exactly the values the CPU counts."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    host = np.clip(_data(1_000_003, seed=11, nonfinite=False), -3.9, 3.9)
    host[::9] = 0.0
    device_x = torch.from_numpy(host).cuda()
    for offset in range(4):
        for length in (1, 2, 3, 4, 5, 6, 7, 8, 9, 33, 1000, 999_990):
            part = host[offset : offset + length]
            counts = torch.zeros(4096, dtype=torch.int64, device="cuda")
            out = torch.zeros(24, dtype=torch.uint8, device="cuda")
            ptr = device_x.data_ptr() + 4 * offset
            k.observe_on_device(ptr, length, 4.0, counts.data_ptr(), 4096, out.data_ptr())
            torch.cuda.synchronize()
            raw = out.cpu().numpy()
            lo, hi = raw[:8].view(np.float32)
            got = (float(lo), float(hi), int(raw[8:16].view(np.int64)[0]), bool(raw[16]))
            cpu = np.zeros(4096, np.int64)
            want = k.observe(part, 4.0, cpu, device="cpu")
            assert _same_minmax(got, want), (offset, length, got, want)
            np.testing.assert_array_equal(counts.cpu().numpy(), cpu, err_msg=f"{offset} {length}")


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


@pytest.mark.parametrize("nbins,steps", [(2048, 127), (2048, 255), (1, 127), (5000, 15), (777, 7)])
def test_mse(nbins: int, steps: int) -> None:
    """One device thread per candidate adds the bins in the CPU's order: identical errors."""
    hist = _abs_hist(_data(1_000_000, seed=nbins), nbins)
    gpu_err, cpu_err = k.mse_errors(hist, steps, device="cuda"), k.mse_errors(hist, steps)
    np.testing.assert_array_equal(gpu_err.view(np.uint64), cpu_err.view(np.uint64))
    gpu = k.mse_threshold_bins(hist, steps, device="cuda")
    assert gpu == k.mse_threshold_bins(hist, steps, device="cpu")
