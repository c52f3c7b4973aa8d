"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): round a linear layer's weight one input row at a time, pushing each
row's rounding error onto the rows not yet rounded so that the layer's output X W changes least.

The only statistic it needs is H = XᵀX over the layer's calibration inputs; the calibration pass
collects it (qtool/calibration/hessians.py).

Layout is ONNX's: a MatMul weight W is [K, N] (K inputs, N outputs), so the paper's "columns"
are rows of W here, and the blocks of the blocked DequantizeLinear run along K. Each block's
scale (and zero point) is fixed when its first row is reached, from the weights as the error
feedback has left them, which is what makes GPTQ better than rounding to nearest with the same
grid. With `act_order` rows are processed by decreasing H_ii, but blocks stay contiguous in the
original order (that is all DequantizeLinear can express): a block's grid is fixed when the first
of its rows comes up in the processing order.

Differences from the reference implementation, on purpose: inputs with H_ii == 0 (never active
in calibration) keep their weights and are rounded to nearest instead of being zeroed (zeroing is
exact on the calibration data but wrong if the input is live at deployment); all arithmetic is
float64 numpy, so identical inputs give identical bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from qtool.errors import CalibrationError, ModelError
from qtool.write.int4 import (
    DEFAULT_MSE_GRID,
    BlockwiseWeight,
    block_scales,
    dequantize,
    dequantize_values,
    quantize_values,
)

# Chooses a block's grid from its rows [rows, N] as GPTQ's error feedback has left them and the
# block's index: (scale [N], zero point [N] or None).
BlockGrid = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray | None]]


def hessian_error(weight: np.ndarray, quantized: BlockwiseWeight, hessian: np.ndarray) -> float:
    """sum over outputs of (w - ŵ)ᵀ H (w - ŵ): ||X W - X Ŵ||² when H = XᵀX.

    The per-layer check that GPTQ did better than rounding to nearest on the calibration data.
    """
    diff = np.asarray(weight, np.float64) - dequantize(quantized).astype(np.float64)
    return float(np.sum(diff * (np.asarray(hessian, np.float64) @ diff)))


def gptq_quantize(
    weight: np.ndarray,
    hessian: np.ndarray,
    *,
    bits: int = 4,
    block_size: int = 32,
    symmetric: bool = True,
    method: str = "minmax",
    mse_grid: Sequence[float] = DEFAULT_MSE_GRID,
    damp: float = 0.01,
    lazy_batch: int = 128,
    act_order: bool = False,
    name: str = "weight",
    block_grid: BlockGrid | None = None,
) -> BlockwiseWeight:
    """Blocked (axis 0) quantization of a MatMul weight [K, N] by GPTQ against H [K, K].

    `damp` adds damp * mean(diag H) to the diagonal; `lazy_batch` rows are updated together
    before the rest of W receives their error (the paper's lazy batch; it changes speed, not the
    result beyond float rounding). `method` picks each block's grid (minmax or mse) from the
    error-updated weights, unless `block_grid` (block rows as error feedback has left them
    [rows, N], block index) -> (scale, zero point) chooses it (scale estimation's grids). Raises
    ModelError for a bad weight, CalibrationError when H does not match it or stays singular
    after damping.
    """
    w = np.asarray(weight, dtype=np.float64)
    if w.ndim != 2:
        raise ModelError(f"weight {name!r}: GPTQ needs a 2-D [K, N] weight, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ModelError(f"weight {name!r} contains NaN or Inf")
    k, n = w.shape
    h = np.array(hessian, dtype=np.float64, copy=True)
    if h.shape != (k, k):
        raise CalibrationError(f"weight {name!r}: Hessian shape {h.shape} does not match K={k}")
    if not np.all(np.isfinite(h)):
        raise CalibrationError(f"weight {name!r}: Hessian contains NaN or Inf")
    if block_size < 1 or lazy_batch < 1 or damp < 0:
        raise ValueError("block_size and lazy_batch must be positive and damp non-negative")

    dead = np.diag(h) == 0
    h[dead, :] = 0.0
    h[:, dead] = 0.0
    h[dead, dead] = 1.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    h += np.eye(k) * (damp * float(np.mean(np.diag(h))))
    h = h[np.ix_(perm, perm)]
    u = _upper_cholesky_of_inverse(h, name, damp)

    wp = w[perm].copy()
    position = np.empty(k, dtype=np.int64)
    position[perm] = np.arange(k)
    n_blocks = -(-k // block_size)
    scale = np.zeros((n_blocks, n), dtype=np.float32)
    zero = None if symmetric else np.zeros((n_blocks, n), dtype=np.uint8)
    started = np.zeros(n_blocks, dtype=bool)
    q = np.zeros((k, n), dtype=np.int8 if symmetric else np.uint8)

    for i1 in range(0, k, lazy_batch):
        i2 = min(i1 + lazy_batch, k)
        w1 = wp[i1:i2].copy()
        err1 = np.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            b = perm[i1 + i] // block_size
            if not started[b]:
                rows = position[b * block_size : min((b + 1) * block_size, k)]
                current = _current_rows(rows, wp, w1, err1, u, i1, i2, i1 + i)
                if block_grid is not None:
                    s, z = block_grid(current, b)
                else:
                    s, z = block_scales(
                        current, bits=bits, symmetric=symmetric, method=method, mse_grid=mse_grid
                    )
                scale[b] = s
                if zero is not None:
                    zero[b] = z
                started[b] = True
            z = None if zero is None else zero[b]
            q[i1 + i] = quantize_values(w1[i], scale[b], z, bits)
            dq = dequantize_values(q[i1 + i], scale[b], z).astype(np.float64)
            err = (w1[i] - dq) / u1[i, i]
            w1[i + 1 :] -= np.outer(u1[i, i + 1 :], err)
            err1[i] = err
        wp[i2:] -= u[i1:i2, i2:].T @ err1

    values = np.empty_like(q)
    values[perm] = q
    return BlockwiseWeight(
        values=values, scale=scale, zero_point=zero, bits=bits, axis=0, block_size=block_size
    )


def _upper_cholesky_of_inverse(h: np.ndarray, name: str, damp: float) -> np.ndarray:
    """U upper triangular with H⁻¹ = Uᵀ U: row i of U is how row i's error spreads forward."""
    try:
        lower = np.linalg.cholesky(h)
        lower_inv = np.linalg.solve(lower, np.eye(h.shape[0]))
        return np.linalg.cholesky(lower_inv.T @ lower_inv).T
    except np.linalg.LinAlgError:
        raise CalibrationError(
            f"weight {name!r}: Hessian is not positive definite after damping {damp}; "
            "raise the damping or calibrate on more samples"
        ) from None


def _current_rows(
    rows: np.ndarray,
    wp: np.ndarray,
    w1: np.ndarray,
    err1: np.ndarray,
    u: np.ndarray,
    i1: int,
    i2: int,
    now: int,
) -> np.ndarray:
    """Rows (processing positions, all >= now) of W as the error feedback so far has left them.

    Rows inside the lazy batch are up to date in w1; rows after it still lack the feedback of
    this batch's rows i1..now-1, which is added here rather than read stale.
    """
    out = np.empty((len(rows), wp.shape[1]), dtype=np.float64)
    inside = rows < i2
    out[inside] = w1[rows[inside] - i1]
    later = rows[~inside]
    if len(later):
        done = now - i1
        out[~inside] = wp[later] - u[i1:now, later].T @ err1[:done]
    return out
