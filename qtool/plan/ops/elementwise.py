"""Element-wise ops on two activations (Add, Mul): both inputs and the output quantized.

ORT forms QLinearAdd / QLinearMul from DQ -> op -> Q when both inputs and the output share one
integer type. A residual Add after a Relu keeps the Relu folded into the Q before it (clamp.py).
`binary_op_rule` is how another element-wise op is added: its ORT kernel, or None.
"""

from __future__ import annotations

from qtool.plan.ops.forms import activation_entries
from qtool.plan.ops.registry import NO_FUSION, OpRule, OrtFusion


def binary_op_rule(op_type: str, kernel: str | None) -> OpRule:
    """The rule of an element-wise op whose ORT CPU QDQ fusion is `kernel` (None: ORT has none,
    so the op runs DQ -> float op -> Q)."""
    kernels = (kernel,) if kernel is not None else ()
    return OpRule(
        op_type=op_type,
        family="elementwise",
        quantizable=True,
        output_quantized=True,
        ort=OrtFusion(kernels=kernels, same_input_types=True) if kernels else NO_FUSION,
        entries=activation_entries(op_type, kernels),
    )


ADD = binary_op_rule("Add", "QLinearAdd")
MUL = binary_op_rule("Mul", "QLinearMul")

RULES = (ADD, MUL)
