"""Weights that no integer kernel multiplies against uint8 activations: 4-bit, blocked, weight-only.

These are stored for DequantizeLinear (or GatherBlockQuantized) to expand, so the 16-bit pair
saturation that weight_format.py guards against cannot happen; what matters is the reconstruction
error, which the plan's scale `method` minimises: round to nearest (`minmax`), a clipping search
per block (`mse`), or GPTQ against the layer's calibration Hessian (`gptq`); scale estimation
(scale_estimation.py) then chooses every block's grid against that Hessian too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.calibration.hessians import HessianAccumulator
from qtool.errors import CalibrationError
from qtool.plan.layout import WeightSlot
from qtool.plan.plan import WeightPlan
from qtool.write.gptq import BlockGrid, gptq_quantize
from qtool.write.int4 import (
    BlockwiseWeight,
    quantize_blockwise,
    quantize_per_channel,
    transpose_blockwise,
)
from qtool.write.scale_estimation import (
    ScaleSearch,
    block_hessians,
    estimate_block,
    scale_estimated,
)


def stored_weight(weight: np.ndarray, slot: WeightSlot) -> np.ndarray:
    """The float weight in the layout it is stored in ([K, N] for a transposed Gemm weight)."""
    return np.ascontiguousarray(weight.T) if slot.transposed else weight


@dataclass(frozen=True)
class LowBitOptions:
    """The Hessian-driven weight methods' settings (the recipe's quantization.algorithms `gptq`
    and `scale_estimation`, mapped by the build stage): GPTQ's row order and damping, and the
    scale search of every blocked weight's grid when scale estimation is on."""

    act_order: bool = True
    damp: float = 0.01
    scale_search: ScaleSearch | None = None


def searches_scales(plan: WeightPlan, slot: WeightSlot, options: LowBitOptions) -> bool:
    """Whether scale estimation chooses this weight's grid: a blocked MatMul/Gemm weight (its
    blocks along K, so the layer input's Hessian weighs them), with scale estimation on."""
    return (
        options.scale_search is not None
        and plan.block_size is not None
        and slot.reduction in ("k-rows", "k-cols")
    )


def quantize_low_bit(
    weight: np.ndarray,
    slot: WeightSlot,
    plan: WeightPlan,
    hessian: HessianAccumulator | None = None,
    options: LowBitOptions | None = None,
) -> BlockwiseWeight:
    """Quantize one weight as its plan says; `hessian` (its layer input's) is required for
    method `gptq` and for scale estimation."""
    options = options if options is not None else LowBitOptions()
    weight = stored_weight(np.asarray(weight, dtype=np.float32), slot)
    method = plan.method
    # A tied lm_head's table [N, K] is blocked along axis 1: the Hessian methods see its [K, N].
    along_rows = plan.block_size is not None and slot.axis == 1
    search = searches_scales(plan, slot, options)
    if (method == "gptq" or search) and hessian is None:
        what = "method gptq" if method == "gptq" else "scale estimation"
        raise CalibrationError(
            f"weight '{plan.tensor}': {what} needs the Hessian of its layer input, and "
            "the calibration run collected none (re-run `qtool calibrate`)"
        )
    if method == "gptq":
        kn = weight.T if along_rows else weight
        grid = _estimated_grid(hessian.xtx, plan, options.scale_search) if search else None
        rounded = gptq_quantize(
            kn,
            hessian.xtx,
            bits=plan.bits,
            block_size=int(plan.block_size or 32),
            symmetric=plan.symmetric,
            damp=options.damp,
            # Rows in decreasing H_ii order: on MiniLM (block 32, asymmetric) embedding cosine
            # 0.9882 -> 0.9898; an mse grid inside GPTQ changed it by < 0.0002.
            act_order=options.act_order,
            name=plan.tensor,
            block_grid=grid,
        )
        return transpose_blockwise(rounded) if along_rows else rounded
    options_rtn = {
        "bits": plan.bits,
        "symmetric": plan.symmetric,
        "method": method,
        "signed_scales": plan.signed_scales,
    }
    if plan.block_size is not None:
        rounded = quantize_blockwise(
            weight, block_size=plan.block_size, axis=int(slot.axis), name=plan.tensor, **options_rtn
        )
        if not search:
            return rounded
        kn = weight.T if along_rows else weight
        start = transpose_blockwise(rounded) if along_rows else rounded
        found = scale_estimated(kn, hessian.xtx, start, options.scale_search)
        return transpose_blockwise(found) if along_rows else found
    if slot.axis is None:  # per-tensor: one channel holding every value
        flat = quantize_per_channel(weight.reshape(1, -1), axis=0, name=plan.tensor, **options_rtn)
        return BlockwiseWeight(
            values=flat.values.reshape(weight.shape),
            scale=flat.scale.reshape(()),
            zero_point=None if flat.zero_point is None else flat.zero_point.reshape(()),
            bits=flat.bits,
            axis=0,
            block_size=None,
        )
    return quantize_per_channel(weight, axis=slot.axis, name=plan.tensor, **options_rtn)


def _estimated_grid(xtx: np.ndarray, plan: WeightPlan, search: ScaleSearch) -> BlockGrid:
    """GPTQ's block grids from scale estimation: each block's rows (as error feedback has left
    them) searched against the block's part of the layer's Hessian."""
    block = int(plan.block_size)
    h = block_hessians(np.asarray(xtx, np.float64), block)

    def grid(rows: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        padded = np.zeros((block, rows.shape[1]), np.float32)
        padded[: len(rows)] = rows
        scale, zero = estimate_block(
            padded[None], h[index][None], plan.bits, plan.symmetric, search
        )
        return scale[0], None if zero is None else zero[0]

    return grid
