"""The block MSE clipping kernel against its numpy specification (`int4._mse_search_numpy`).

The kernel must choose the same grid factor as numpy for every block, and so produce the same
scales, zero points and integers, bit for bit: on every instruction set this CPU has (forced in
turn; sets it lacks are skipped, so AVX2-only and AVX-512 machines both pass), at every thread
count, for vector strips and scalar tail columns, short last blocks, zero blocks and outliers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import qtool.kernels as k
from qtool.errors import KernelError
from qtool.write import int4

MSE_GRID = int4._check_grid("mse", int4.DEFAULT_MSE_GRID)


def _weights(rows: int, columns: int, seed: int) -> np.ndarray:
    """Gaussian weights with the cases that decide a search: outliers (clipping pays), all-zero
    and constant columns (ties), one-signed columns, tiny values (the 1e-8 scale floor), and a
    column of exact half steps (rint ties)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    outliers = rng.uniform(size=x.shape) < 0.01
    x[outliers] *= np.float32(25.0)
    if columns > 5:
        x[:, 0] = 0.0
        x[:, 1] = np.float32(0.3)
        x[:, 2] = np.abs(x[:, 2])
        x[:, 3] = -np.abs(x[:, 3])
        x[:, 4] *= np.float32(1e-12)
        x[:, 5] = (np.arange(rows) % 15 - 7) * np.float32(0.5)
    return x


def _blocks(x: np.ndarray, block_len: int) -> np.ndarray:
    """x [rows, columns] as [blocks, block_len, columns], the last block padded with zero rows."""
    rows, columns = x.shape
    n_blocks = -(-rows // block_len)
    padded = np.zeros((n_blocks * block_len, columns), x.dtype)
    padded[:rows] = x
    return padded.reshape(n_blocks, block_len, columns)


def _reference(x: np.ndarray, block_len: int, bits: int, symmetric: bool, grid) -> tuple:
    values, scale, zero, best = int4._mse_search_numpy(
        _blocks(x, block_len), bits, symmetric, tuple(grid)
    )
    return values.reshape(-1, x.shape[1])[: x.shape[0]], scale, zero, best


def _search(
    x: np.ndarray, block_len: int, bits: int, symmetric: bool, grid, signed_scales: bool = False
) -> k.BlockSearch:
    qmin, qmax = int4._qrange(bits, symmetric)
    return k.block_mse_search(
        x,
        block_len,
        np.asarray(grid, np.float32),
        qmin=qmin,
        qmax=qmax,
        symmetric=symmetric,
        signed_scales=signed_scales,
    )


def _assert_same(found: k.BlockSearch, ref: tuple) -> None:
    values, scale, zero, best = ref
    np.testing.assert_array_equal(found.best_index, best)
    np.testing.assert_array_equal(found.scale.view(np.uint32), scale.view(np.uint32))
    if zero is None:
        assert found.zero_point is None
    else:
        assert found.zero_point.dtype == zero.dtype
        np.testing.assert_array_equal(found.zero_point, zero)
    assert found.values.dtype == values.dtype
    np.testing.assert_array_equal(found.values, values)


# rows x columns x block: vector strips + scalar tail columns, a short last block, one-row blocks,
# a block longer than the weight (one block: per channel), a 64-column item boundary
SHAPES = [(64, 77, 32), (45, 19, 16), (7, 3, 1), (33, 40, 128), (96, 130, 17)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_each_isa_chooses_exactly_what_numpy_chooses(isa, bits, symmetric, shape) -> None:
    rows, columns, block = shape
    x = _weights(rows, columns, seed=rows * columns + bits)
    ref = _reference(x, block, bits, symmetric, MSE_GRID)
    _assert_same(_search(x, block, bits, symmetric, MSE_GRID), ref)
    if bits == 4 and block > 1:  # the searched case: some blocks clip, some keep the full range
        assert 0 < np.count_nonzero(ref[3]) < ref[3].size


def test_each_isa_with_an_odd_grid_and_uneven_factors(isa) -> None:
    grid = (1.0, 0.61, 0.93, 0.3, 0.77, 0.999)
    x = _weights(50, 37, seed=11)
    for symmetric in (True, False):
        _assert_same(_search(x, 9, 4, symmetric, grid), _reference(x, 9, 4, symmetric, grid))


@pytest.mark.parametrize("rows,columns,block", [(1024, 200, 32), (300, 100, 300)])
def test_results_do_not_depend_on_the_thread_count(isa, threads, rows, columns, block) -> None:
    """Many blocks (several tasks per thread), and one block per column (per channel), where the
    column width of a work item shrinks with the thread count."""
    x = _weights(rows, columns, seed=5)
    outputs = []
    for n in (1, 2, 3, 8):
        threads(n)
        outputs.append(_search(x, block, 4, False, MSE_GRID))
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


def _reference_signed(x: np.ndarray, block_len: int, bits: int, grid) -> tuple:
    """The numpy specification of `signed_scales`: the grid search, then `_prefer_signed`; the
    blocks whose scale changed took the signed grid (its error strictly smaller, so never the
    same scale), index len(grid)."""
    values, scale, zero, best = _reference(x, block_len, bits, True, grid)
    signed_values, signed_scale = int4._prefer_signed(
        _blocks(x, block_len), _blocks(values, block_len), scale, bits
    )
    took = signed_scale.view(np.uint32) != scale.view(np.uint32)
    best = np.where(took, np.int32(len(grid)), best)
    return signed_values.reshape(-1, x.shape[1])[: x.shape[0]], signed_scale, zero, best


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("grid", [(1.0,), MSE_GRID], ids=["minmax", "mse"])
@pytest.mark.parametrize("shape", SHAPES)
def test_each_isa_prefers_the_signed_grid_exactly_where_numpy_does(isa, bits, grid, shape):
    rows, columns, block = shape
    x = _weights(rows, columns, seed=rows + columns + bits)
    ref = _reference_signed(x, block, bits, grid)
    _assert_same(_search(x, block, bits, True, grid, signed_scales=True), ref)
    took = ref[3] == len(grid)
    if block > 1 and x.size > 1000:  # both grids win somewhere, and the signed ones are negative
        assert 0 < np.count_nonzero(took) < took.size
        assert np.any(ref[1][took] < 0)


def test_signed_grid_of_quantize_blockwise_is_the_numpy_reference() -> None:
    """The kernel path of int4 (chunked columns, padding) writes what numpy's path wrote."""
    w = _weights(200, 300, seed=9)
    got = int4.quantize_blockwise(w, block_size=32, signed_scales=True)
    values, scale, _, _ = _reference_signed(w, 32, 4, (1.0,))
    np.testing.assert_array_equal(got.values, values)
    np.testing.assert_array_equal(got.scale.view(np.uint32), scale.view(np.uint32))


_DIGEST_CODE = """
import hashlib, numpy as np, qtool.kernels as k
x = np.random.default_rng(3).standard_t(3, size=(256, 96)).astype(np.float32)
grid = np.float32(1.0) - np.float32(0.025) * np.arange(21, dtype=np.float32)
h = hashlib.sha256()
for sym, (lo, hi) in ((True, (-8, 7)), (False, (0, 15))):
    for arr in k.block_mse_search(x, 32, grid, qmin=lo, qmax=hi, symmetric=sym):
        if arr is not None:  # no zero point when symmetric
            h.update(np.ascontiguousarray(arr).tobytes())
signed = k.block_mse_search(x, 32, grid[:1], qmin=-8, qmax=7, symmetric=True, signed_scales=True)
for arr in (signed.scale, signed.best_index, signed.values):
    h.update(np.ascontiguousarray(arr).tobytes())
print(k.cpu_isa(), k.cpu_threads(), h.hexdigest())
"""


def _digest_run(env: dict[str, str]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", _DIGEST_CODE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_environment_isa_and_threads_give_the_same_bytes() -> None:
    """QTOOL_CPU_ISA / QTOOL_CPU_THREADS (read when the library loads): scalar on one thread and
    the best instruction set on three give identical outputs."""
    scalar = _digest_run({"QTOOL_CPU_ISA": "scalar", "QTOOL_CPU_THREADS": "1"})
    best = k.supported_cpu_isas()[-1]
    vector = _digest_run({"QTOOL_CPU_ISA": best, "QTOOL_CPU_THREADS": "3"})
    assert scalar[:2] == ["scalar", "1"] and vector[:2] == [best, "3"]
    assert scalar[2] == vector[2]


def test_rint_rounds_half_to_even_like_numpy(isa) -> None:
    """max 7 -> scale 1 at factor 1: every value is a level or exactly half-way between two."""
    x = np.array([7.0, 0.5, 1.5, 2.5, -0.5, -2.5, -3.5, 6.5], np.float32)[:, None]
    x = np.repeat(x, 19, axis=1)  # vector lanes and tail columns
    found = _search(x, 8, 4, True, (1.0,))
    np.testing.assert_array_equal(found.scale, 1.0)
    np.testing.assert_array_equal(found.values[:, 0], [7, 0, 2, 2, 0, -2, -4, 6])
    np.testing.assert_array_equal(found.values, np.repeat(found.values[:, :1], 19, axis=1))


def test_ties_keep_the_earliest_factor(isa) -> None:
    """A zero block has error 0 everywhere and keeps factor 0 (scale 1); a repeated factor can
    never win over its first occurrence."""
    x = np.random.default_rng(8).laplace(size=(64, 24)).astype(np.float32)  # 0.9 often pays
    x[:32, 7] = 0.0
    found = _search(x, 32, 4, True, (1.0, 0.9, 0.9))
    assert found.best_index[0, 7] == 0 and found.scale[0, 7] == 1.0
    assert not np.any(found.best_index == 2)
    assert np.any(found.best_index == 1)


def test_one_factor_is_the_minmax_path_of_int4() -> None:
    """grid (1.0,) skips the error search: the same integers and scales as the numpy minmax."""
    x = _weights(70, 33, seed=2)
    for bits, symmetric in ((4, True), (4, False), (8, True), (8, False)):
        ref = int4.quantize_blockwise(x, bits=bits, block_size=16, symmetric=symmetric)
        found = _search(x, 16, bits, symmetric, (1.0,))
        np.testing.assert_array_equal(found.values, ref.values)
        np.testing.assert_array_equal(found.scale, ref.scale)
        if not symmetric:
            np.testing.assert_array_equal(found.zero_point, ref.zero_point)
        assert not found.best_index.any()


# ---------------------------------------------------------------------------------------------
# int4.py runs its `mse` method on the kernel
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_blockwise_mse_is_the_numpy_reference(symmetric) -> None:
    w = _weights(100, 48, seed=21)  # 100 = 3 blocks of 32 + a short one
    bw = int4.quantize_blockwise(w, block_size=32, symmetric=symmetric, method="mse")
    values, scale, zero, best = _reference(w, 32, 4, symmetric, MSE_GRID)
    np.testing.assert_array_equal(bw.values, values)
    np.testing.assert_array_equal(bw.scale, scale)
    if symmetric:
        assert bw.zero_point is None
    else:
        np.testing.assert_array_equal(bw.zero_point, zero)
    assert np.any(best > 0)


def test_embedding_and_per_channel_mse_are_the_numpy_reference() -> None:
    table = _weights(40, 64, seed=4)  # blocks along D (axis 1)
    bw = int4.quantize_embedding(table, block_size=16, symmetric=False, method="mse")
    values, scale, zero, _ = _reference(np.ascontiguousarray(table.T), 16, 4, False, MSE_GRID)
    np.testing.assert_array_equal(bw.values, values.T)
    np.testing.assert_array_equal(bw.scale, scale.T)
    np.testing.assert_array_equal(bw.zero_point, zero.T)

    conv = _weights(8, 27, seed=6).reshape(8, 3, 3, 3)  # one block per output channel
    pc = int4.quantize_per_channel(conv, symmetric=True, method="mse")
    rows = np.ascontiguousarray(conv.reshape(8, -1).T)
    values, scale, _, _ = _reference(rows, 27, 4, True, MSE_GRID)
    np.testing.assert_array_equal(pc.values, values.T.reshape(conv.shape))
    np.testing.assert_array_equal(pc.scale, scale[0])


def test_block_scales_for_gptq_is_the_numpy_reference() -> None:
    rows = _weights(32, 20, seed=9)
    for symmetric in (True, False):
        scale, zero = int4.block_scales(rows, symmetric=symmetric, method="mse")
        _, ref_scale, ref_zero, _ = _reference(rows, 32, 4, symmetric, MSE_GRID)
        np.testing.assert_array_equal(scale, ref_scale[0])
        if not symmetric:
            np.testing.assert_array_equal(zero, ref_zero[0])


def test_block_scales_with_nan_names_the_problem() -> None:
    rows = _weights(32, 20, seed=9)
    rows[3, 4] = np.nan
    with pytest.raises(KernelError, match="NaN or Inf"):
        int4.block_scales(rows, method="mse")


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

X = np.ones((4, 3), np.float32)
SYM = {"qmin": -8, "qmax": 7, "symmetric": True}
ASYM = {"qmin": 0, "qmax": 15, "symmetric": False}


@pytest.mark.parametrize(
    "x,block_len,grid,kwargs,message",
    [
        (np.ones(4), 2, [1.0], SYM, "2-D"),
        (X, 0, [1.0], SYM, "block_len"),
        (X, 2, [], SYM, "grid"),
        (X, 2, [1.0, 0.0], SYM, "grid"),
        (X, 2, [1.5], SYM, "grid"),
        (X, 2, [np.nan], SYM, "grid"),
        (X, 2, [1.0], {**ASYM, "symmetric": True}, "symmetric integer range"),
        (X, 2, [1.0], {**SYM, "symmetric": False}, "asymmetric integer range"),
        (X, 2, [1.0], {**ASYM, "qmax": 256}, "range"),
        (X, 2, [1.0], {**ASYM, "signed_scales": True}, "signed_scales needs a symmetric"),
        (X * np.inf, 2, [1.0], ASYM, "NaN or Inf"),
        (X, 2, [1.0], {**SYM, "device": "tpu"}, "tpu"),
    ],
)
def test_bad_arguments_raise_kernel_error(x, block_len, grid, kwargs, message) -> None:
    with pytest.raises(KernelError, match=message):
        k.block_mse_search(x, block_len, grid, **kwargs)


def test_cuda_request_without_device_is_an_error() -> None:
    if k.default_device() == "cuda":
        pytest.skip("a CUDA device is usable here: tests/gpu covers it")
    with pytest.raises(KernelError, match="CUDA kernels unavailable"):
        k.block_mse_search(X, 2, [1.0], qmin=-8, qmax=7, symmetric=True, device="cuda")
