"""Where the QDQ tensors of a layout go: one slot per quantized activation, weight and bias.

These live apart from layout.py so that the op families (qtool/plan/ops/), which build the weight
and bias slots of their ops, and the layout, which looks the families up, do not import each
other. qtool.plan.layout re-exports them: that is where the rest of qtool imports them from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActivationSlot:
    """A tensor whose consumers read a dequantized copy.

    `source` is what the QuantizeLinear reads: the tensor itself, or the input of a folded Relu.
    `stats_tensor` is the tensor whose calibration statistics set the range (the tensor before a
    chain of pass-through ops, so both sides of a Reshape share one scale). `dtype`: "int8" (the
    target's 8-bit integer type) or "fp8" (float8 E4M3FN); a tensor read by int8 and fp8 nodes
    has one slot of each, and each node reads the pair of its own type (`slot_key`).
    """

    tensor: str
    source: str
    stats_tensor: str
    dtype: str = "int8"

    @property
    def key(self) -> str:
        return slot_key(self.tensor, self.dtype)


def slot_key(tensor: str, dtype: str) -> str:
    """The layout's key of the pair of `dtype` on `tensor`, which also names the pair's tensors
    and nodes: the tensor itself for int8 (as before fp8 existed), `{tensor}_fp8` for fp8."""
    return tensor if dtype == "int8" else f"{tensor}_{dtype}"


@dataclass(frozen=True)
class WeightSlot:
    """A constant weight stored as an integer tensor.

    `axis` is DequantizeLinear's axis: the output-channel axis (None: per-tensor), or with
    `block_size` the axis the blocks run along. `reduction` says how ORT's kernels walk the
    weight along the summed axis, which decides which products share a 16-bit pair sum on CPUs
    without VNNI: "k-rows" (MatMul / Gemm weight [K, N]), "k-cols" (Gemm transB [N, K]), "conv"
    (im2col order: kernel positions outer, input channels of the group inner), "depthwise"
    (ORT's depthwise kernel accumulates in 32 bits) or "gather" (an embedding table [V, D]).
    `transposed`: a Gemm transB weight stored as [K, N] (see WeightPlan).
    """

    tensor: str
    axis: int | None
    reduction: str = "k-rows"
    group: int = 1
    block_size: int | None = None
    transposed: bool = False


@dataclass(frozen=True)
class BiasSlot:
    """A bias stored as int32 with scale = input scale x weight scale."""

    tensor: str
    activation: str
    weight: str
