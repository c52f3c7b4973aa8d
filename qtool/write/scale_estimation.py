"""Scale estimation: each block's 4-bit grid chosen for the layer's output, not its weights.

Round-to-nearest takes a block's scale from its min/max; `mse` shrinks that range to lower the
block's own weight error. Neither sees the data: an input channel that carries large activations
makes its weights' errors count for more in the layer's output. NNCF's scale estimation (its
`scale_estimation.py`) refines each block's scale against the layer output on per-sample
mean activations; qtool does it against the exact output error over every calibration token,
from the Hessian H = XᵀX the calibration pass already collects for GPTQ.

For the block b of output column n (weights w, length B along K), the output error its
rounding causes is Δᵀ H_bb Δ with Δ = w - ŵ and H_bb the block's B x B part of H (cross-block
terms are left out, as NNCF leaves them out: blocks are chosen independently). Per block and
column, the candidates are the min-max range shrunk by each of `steps` factors from 1 down to
`min_factor`; each candidate's integers t (q minus its zero point) are fitted by the scale that
minimises the error for those integers, s* = (tᵀ H_bb w) / (tᵀ H_bb t), re-rounded, `refine`
times. The candidate with the least error wins; the plain round-to-nearest grid is always a
candidate (factor 1 before refitting), so no block ends with a larger H_bb error than it.

Float32 numpy over all blocks at once, then float64 error sums: the same inputs give the same
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.write.int4 import BlockwiseWeight, dequantize_values, quantize_values

__all__ = ["ScaleSearch", "block_hessians", "estimate_block", "scale_estimated"]

_MIN_SCALE = np.float32(1e-8)


@dataclass(frozen=True)
class ScaleSearch:
    """The search's settings (the recipe's quantization.algorithms.scale_estimation)."""

    steps: int = 10
    min_factor: float = 0.55
    refine: int = 2

    def factors(self) -> np.ndarray:
        if self.steps == 1:
            return np.ones(1, np.float32)
        return np.linspace(1.0, self.min_factor, self.steps, dtype=np.float32)


def _qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    if symmetric:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def _grid(
    low: np.ndarray, high: np.ndarray, bits: int, symmetric: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale (and zero point) of ranges [low, high] containing 0, as int4.py's round-to-nearest
    derives them."""
    qmin, qmax = _qrange(bits, symmetric)
    if symmetric:
        scale = np.maximum(low / np.float32(qmin), high / np.float32(qmax))
    else:
        scale = (high - low) / np.float32(qmax - qmin)
    scale = np.where(scale > 0, np.maximum(scale, _MIN_SCALE), np.float32(1.0)).astype(np.float32)
    zero = None
    if not symmetric:
        zero = np.clip(np.rint(-low / scale), qmin, qmax).astype(np.uint8)
    return scale, zero


def _error(blocks: np.ndarray, approx: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Σ Δᵀ H_bb Δ per block and column: blocks/approx [nb, B, N], h [nb, B, B] -> [nb, N]."""
    diff = (blocks - approx).astype(np.float64)
    return np.einsum("kbn,kbn->kn", diff, np.einsum("kbc,kcn->kbn", h, diff))


def _refit(
    blocks: np.ndarray, integers: np.ndarray, h: np.ndarray, fallback: np.ndarray
) -> np.ndarray:
    """The scale s minimising (w - s t)ᵀ H (w - s t) per block and column: (tᵀHw) / (tᵀHt);
    `fallback` where that is not a positive number (t all zero, or a degenerate H)."""
    ht = np.einsum("kbc,kcn->kbn", h, integers)
    numerator = np.einsum("kbn,kbn->kn", ht, blocks)
    denominator = np.einsum("kbn,kbn->kn", ht, integers)
    with np.errstate(divide="ignore", invalid="ignore"):
        fitted = numerator / denominator
    good = np.isfinite(fitted) & (fitted > _MIN_SCALE)
    return np.where(good, fitted, fallback).astype(np.float32)


def estimate_block(
    blocks: np.ndarray,
    h: np.ndarray,
    bits: int,
    symmetric: bool,
    search: ScaleSearch,
    first: tuple[np.ndarray, np.ndarray | None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales [nb, N] (and zero points) of `blocks` [nb, B, N] (zero rows pad a short last
    block), searched against `h` [nb, B, B]. `first`: a grid to start from, kept unless a
    candidate beats it (the plan's own round-to-nearest grid, signed scales and all); default
    the min-max grid."""
    blocks = blocks.astype(np.float32)
    h = h.astype(np.float32)
    low = np.minimum(blocks.min(axis=1), 0).astype(np.float32)
    high = np.maximum(blocks.max(axis=1), 0).astype(np.float32)
    best_scale, best_zero = first if first is not None else _grid(low, high, bits, symmetric)
    best_scale = best_scale.astype(np.float32)

    def reconstruct(scale: np.ndarray, zero: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        z = None if zero is None else zero[:, None, :]
        q = quantize_values(blocks, scale[:, None, :], z, bits)
        integers = q.astype(np.float32) - (0 if z is None else z.astype(np.float32))
        return dequantize_values(q, scale[:, None, :], z), integers

    approx, _ = reconstruct(best_scale, best_zero)
    best_error = _error(blocks, approx, h)
    for factor in search.factors():
        scale, zero = _grid(low * factor, high * factor, bits, symmetric)
        for step in range(search.refine + 1):
            approx, integers = reconstruct(scale, zero)
            error = _error(blocks, approx, h)
            better = error < best_error  # strict: earlier candidates win ties
            best_error = np.where(better, error, best_error)
            best_scale = np.where(better, scale, best_scale)
            if zero is not None:
                best_zero = np.where(better, zero, best_zero)
            if step < search.refine:
                scale = _refit(blocks, integers, h, scale)
    return best_scale.astype(np.float32), best_zero


def block_hessians(hessian: np.ndarray, block_size: int) -> np.ndarray:
    """H's diagonal blocks [nb, B, B] (the last zero-padded to B, identity on the padding)."""
    k = hessian.shape[0]
    n_blocks = -(-k // block_size)
    out = np.zeros((n_blocks, block_size, block_size), np.float64)
    for b in range(n_blocks):
        rows = slice(b * block_size, min((b + 1) * block_size, k))
        size = rows.stop - rows.start
        out[b, :size, :size] = hessian[rows, rows]
        if size < block_size:
            out[b, size:, size:] = np.eye(block_size - size)
    return out


def scale_estimated(
    weight: np.ndarray,
    hessian: np.ndarray,
    start: BlockwiseWeight,
    search: ScaleSearch,
) -> BlockwiseWeight:
    """A blocked MatMul weight [K, N] (blocks along K) with every block's scale searched against
    `hessian` [K, K], starting from (and never worse on H_bb than) `start`, its round-to-nearest
    quantization on the same grid."""
    if start.block_size is None or start.axis != 0 or weight.ndim != 2:
        raise ValueError("scale estimation needs a 2-D weight in blocks along axis 0")
    block = int(start.block_size)
    k, n = weight.shape
    n_blocks = -(-k // block)
    padded = np.zeros((n_blocks * block, n), np.float32)
    padded[:k] = weight
    blocks = padded.reshape(n_blocks, block, n)
    h = block_hessians(np.asarray(hessian, np.float64), block)
    scale, zero = estimate_block(
        blocks,
        h,
        start.bits,
        start.symmetric,
        search,
        first=(np.asarray(start.scale, np.float32), start.zero_point),
    )
    z = None if zero is None else zero[:, None, :]
    values = quantize_values(blocks, scale[:, None, :], z, start.bits)
    values = values.reshape(n_blocks * block, n)[:k]
    return BlockwiseWeight(
        values=np.ascontiguousarray(values),
        scale=scale,
        zero_point=None if zero is None else np.ascontiguousarray(zero),
        bits=start.bits,
        axis=0,
        block_size=block,
    )
