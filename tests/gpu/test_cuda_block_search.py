"""The CUDA block MSE search against the CPU one (itself checked against numpy, bit for bit, in
tests/test_mse_kernel.py). Each device thread runs the CPU's scalar recipe on one block column
with the same qt_math.h functions and sequential sums, so every output must be identical."""

from __future__ import annotations

import numpy as np
import pytest

import qtool.kernels as k
from qtool.errors import KernelError
from qtool.write import int4

GRID = np.asarray(int4._check_grid("mse", int4.DEFAULT_MSE_GRID), np.float32)


def _weights(rows: int, columns: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    x[rng.uniform(size=x.shape) < 0.01] *= np.float32(25.0)
    x[:, 0] = 0.0
    x[:, 1] *= np.float32(1e-12)
    return x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    "rows,columns,block",
    [(1536, 384, 32), (100, 77, 32), (4608, 64, 4608), (4096, 4096, 128), (7, 3, 1)],
)
def test_block_mse_search_matches_cpu(bits, symmetric, rows, columns, block) -> None:
    x = _weights(rows, columns, seed=rows + columns)
    qmin, qmax = int4._qrange(bits, symmetric)
    kw = {"qmin": qmin, "qmax": qmax, "symmetric": symmetric}
    gpu = k.block_mse_search(x, block, GRID, device="cuda", **kw)
    cpu = k.block_mse_search(x, block, GRID, device="cpu", **kw)
    np.testing.assert_array_equal(gpu.best_index, cpu.best_index)
    np.testing.assert_array_equal(gpu.scale.view(np.uint32), cpu.scale.view(np.uint32))
    if symmetric:
        assert gpu.zero_point is None
    else:
        np.testing.assert_array_equal(gpu.zero_point, cpu.zero_point)
    assert gpu.values.dtype == cpu.values.dtype
    np.testing.assert_array_equal(gpu.values, cpu.values)


@pytest.mark.parametrize("grid", [GRID[:1], GRID], ids=["minmax", "mse"])
@pytest.mark.parametrize("rows,columns,block", [(1536, 384, 32), (100, 77, 32), (7, 3, 1)])
def test_signed_scales_match_cpu(grid, rows, columns, block) -> None:
    x = _weights(rows, columns, seed=rows * columns)
    kw = {"qmin": -8, "qmax": 7, "symmetric": True, "signed_scales": True}
    gpu = k.block_mse_search(x, block, grid, device="cuda", **kw)
    cpu = k.block_mse_search(x, block, grid, device="cpu", **kw)
    np.testing.assert_array_equal(gpu.best_index, cpu.best_index)
    np.testing.assert_array_equal(gpu.scale.view(np.uint32), cpu.scale.view(np.uint32))
    np.testing.assert_array_equal(gpu.values, cpu.values)
    if rows > 100:
        assert np.any(cpu.best_index == grid.size)  # the signed grid won somewhere


def test_quantize_blockwise_on_cuda_writes_the_cpu_weights() -> None:
    w = _weights(768, 256, seed=1)
    for symmetric in (True, False):
        a = int4.quantize_blockwise(w, symmetric=symmetric, method="mse", device="cuda")
        b = int4.quantize_blockwise(w, symmetric=symmetric, method="mse", device="cpu")
        for x, y in zip(int4.to_initializers("w", a), int4.to_initializers("w", b), strict=True):
            assert x.SerializeToString() == y.SerializeToString()


def test_nonfinite_input_is_refused_before_the_launch() -> None:
    x = _weights(64, 16, seed=2)
    x[5, 3] = np.inf
    with pytest.raises(KernelError, match="NaN or Inf"):
        k.block_mse_search(x, 32, GRID, qmin=-8, qmax=7, symmetric=True, device="cuda")
