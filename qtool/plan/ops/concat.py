"""Concat of activations: every input and the output quantized, fused into QLinearConcat.

ORT's QLinearConcat requantizes each input to the output's scale, so the inputs may have their
own ranges, but they must share the output's integer type.
"""

from __future__ import annotations

from qtool.plan.ops.forms import activation_entries
from qtool.plan.ops.registry import OpRule, OrtFusion

CONCAT = OpRule(
    op_type="Concat",
    family="concat",
    quantizable=True,
    output_quantized=True,
    ort=OrtFusion(kernels=("QLinearConcat",), same_input_types=True),
    entries=activation_entries("Concat", ("QLinearConcat",)),
)

RULES = (CONCAT,)
