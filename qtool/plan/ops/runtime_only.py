"""Ops qtool places no QDQ pair around, that ONNX Runtime's CPU provider can run quantized.

The report says so instead of claiming the runtime has no kernel ("qtool does not quantize
Sigmoid yet (ORT's CPU provider has QLinearSigmoid)"), and the verifier knows how ORT's QDQ
fusion treats them when another tool's model (or a future rule) puts them between Q/DQ pairs.
Making one quantizable is a new rule in a family module, with entries, in place of this one.
"""

from __future__ import annotations

from qtool.plan.ops.registry import NO_FUSION, OpRule, OrtFusion

_DATA_MOVEMENT = OrtFusion(on_integers=True)


def _runtime_only(
    op_type: str, form: str | None, ort: OrtFusion, output_quantized: bool = False
) -> OpRule:
    return OpRule(
        op_type=op_type,
        family="runtime_only",
        output_quantized=output_quantized,
        runtime_forms={"ort-cpu": form} if form is not None else {},
        ort=ort,
    )


def _qlinear(
    op_type: str,
    dq_inputs: tuple[int, ...] | None = None,
    activation_input: int = 0,
    same_input_types: bool = False,
) -> OpRule:
    """An op ORT fuses from DQ -> op -> Q into QLinear<op> (the output must be quantized)."""
    kernel = f"QLinear{op_type}"
    ort = OrtFusion(
        kernels=(kernel,),
        dq_inputs=dq_inputs,
        activation_input=activation_input,
        same_input_types=same_input_types,
    )
    return _runtime_only(op_type, kernel, ort, output_quantized=True)


RULES = (
    _qlinear("Sigmoid"),
    _qlinear("LeakyRelu"),
    _qlinear("Softmax"),
    # Where(condition, X, Y): the condition is boolean; X and Y are the quantized values.
    _qlinear("Where", dq_inputs=(1, 2), activation_input=1, same_input_types=True),
    # A QLinearReduceMean kernel exists, but ORT's QDQ fusion does not form it.
    _runtime_only("ReduceMean", "QLinearReduceMean", NO_FUSION),
    _runtime_only("Resize", "Resize on uint8", _DATA_MOVEMENT),
    _runtime_only("Split", "Split on uint8", _DATA_MOVEMENT),
    _runtime_only("Pad", "Pad on uint8", NO_FUSION),
    # ORT runs these on the integers between Q/DQ pairs of one scale (data movement), though the
    # layout does not walk ranges through them yet (passthrough.py lists the ones it does).
    *(
        _runtime_only(op, None, _DATA_MOVEMENT)
        for op in ("Expand", "GatherElements", "Slice", "Tile", "ReduceMax", "ReduceMin", "ArgMax")
    ),
)
