"""Shape and max ops (Reshape, Flatten, Transpose, Squeeze, Unsqueeze, MaxPool): no own pair.

They move or select values without creating new ones, so the tensor after them reuses the range
of the tensor before them (the layout walks back through them to one statistics tensor). With
one scale on both sides ORT drops DQ -> op -> Q and runs the op on the uint8 data.
"""

from __future__ import annotations

from qtool.plan.ops.registry import OpRule, OrtFusion, SharesRange

_SHARES_RANGE = SharesRange(
    between_pairs="shape/max op between QDQ pairs with one scale: ORT runs it on uint8 data",
    alone="shape/max op: no quantized neighbour",
)


def _passthrough(op_type: str) -> OpRule:
    return OpRule(
        op_type=op_type,
        family="passthrough",
        shares_range=_SHARES_RANGE,
        ort=OrtFusion(on_integers=True),
    )


RULES = tuple(
    _passthrough(op)
    for op in ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "MaxPool")
)
