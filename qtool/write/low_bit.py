"""Weights that no integer kernel multiplies against uint8 activations: 4-bit, blocked, weight-only.

These are stored for DequantizeLinear (or GatherBlockQuantized) to expand, so the 16-bit pair
saturation that weight_format.py guards against cannot happen; what matters is the reconstruction
error, which the plan's scale `method` minimises: round to nearest (`minmax`), a clipping search
per block (`mse`), or GPTQ against the layer's calibration Hessian (`gptq`).
"""

from __future__ import annotations

import numpy as np

from qtool.calibration.hessians import HessianAccumulator
from qtool.errors import CalibrationError
from qtool.plan.layout import WeightSlot
from qtool.plan.plan import WeightPlan
from qtool.write.gptq import gptq_quantize
from qtool.write.int4 import BlockwiseWeight, quantize_blockwise, quantize_per_channel


def stored_weight(weight: np.ndarray, slot: WeightSlot) -> np.ndarray:
    """The float weight in the layout it is stored in ([K, N] for a transposed Gemm weight)."""
    return np.ascontiguousarray(weight.T) if slot.transposed else weight


def quantize_low_bit(
    weight: np.ndarray,
    slot: WeightSlot,
    plan: WeightPlan,
    hessian: HessianAccumulator | None = None,
) -> BlockwiseWeight:
    """Quantize one weight as its plan says; `hessian` is required for method `gptq`."""
    weight = stored_weight(np.asarray(weight, dtype=np.float32), slot)
    method = plan.method
    if method == "gptq":
        if hessian is None:
            raise CalibrationError(
                f"weight '{plan.tensor}': method gptq needs the Hessian of its layer input, and "
                "the calibration run collected none (re-run `qtool calibrate`)"
            )
        return gptq_quantize(
            weight,
            hessian.xtx,
            bits=plan.bits,
            block_size=int(plan.block_size or 32),
            symmetric=plan.symmetric,
            # Rows in decreasing H_ii order: on MiniLM (block 32, asymmetric) embedding cosine
            # 0.9882 -> 0.9898; an mse grid inside GPTQ changed it by < 0.0002.
            act_order=True,
            name=plan.tensor,
        )
    options = {
        "bits": plan.bits,
        "symmetric": plan.symmetric,
        "method": method,
        "signed_scales": plan.signed_scales,
    }
    if plan.block_size is not None:
        return quantize_blockwise(
            weight, block_size=plan.block_size, axis=int(slot.axis), name=plan.tensor, **options
        )
    if slot.axis is None:  # per-tensor: one channel holding every value
        flat = quantize_per_channel(weight.reshape(1, -1), axis=0, name=plan.tensor, **options)
        return BlockwiseWeight(
            values=flat.values.reshape(weight.shape),
            scale=flat.scale.reshape(()),
            zero_point=None if flat.zero_point is None else flat.zero_point.reshape(()),
            bits=flat.bits,
            axis=0,
            block_size=None,
        )
    return quantize_per_channel(weight, axis=slot.axis, name=plan.tensor, **options)
