"""Relu and Clip(0, max) (ReLU6) after a quantized output: folded into its QuantizeLinear.

For asymmetric uint8 targets a zero point of 0 clamps negatives exactly as Relu does, and the
range taken from the clamp's own output never exceeds its max, so the clamp is dropped and the
QuantizeLinear reads the op's output directly, as ORT's own quantizer does. ORT likewise removes
a clamp between an op and a QuantizeLinear that clamps at least as much (runtime/fusion.py).
"""

from __future__ import annotations

import onnx

from qtool.plan.graph import GraphIndex
from qtool.plan.ops.registry import Folds, OpRule

_FOLDED = (
    "{what} folded into the preceding quantized output (uint8 zero point 0 clamps negatives; "
    "the range never exceeds the clamp's maximum)"
)


def _relu_folds(node: onnx.NodeProto, graph: GraphIndex) -> bool:
    return True


def _clip_folds(node: onnx.NodeProto, graph: GraphIndex) -> bool:
    """A Clip with a constant floor of 0 and a constant positive ceiling (ReLU6)."""
    if len(node.input) < 3:
        return False
    floor = graph.constant_scalar(node.input[1])
    ceiling = graph.constant_scalar(node.input[2])
    return floor == 0.0 and ceiling is not None and ceiling > 0.0


RELU = OpRule(
    op_type="Relu",
    family="clamp",
    folds=Folds(_relu_folds, _FOLDED.format(what="Relu")),
)
CLIP = OpRule(
    op_type="Clip",
    family="clamp",
    folds=Folds(_clip_folds, _FOLDED.format(what="Clip(0, max)")),
)

RULES = (RELU, CLIP)
