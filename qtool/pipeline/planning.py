"""The plan stage: one decision per node from the user's settings and the graph.

One function, so that quantize, qat, the analysis variants, the mixed-precision search and
SmoothQuant's re-plan of the smoothed graph all decide the same way from the same inputs.
"""

from __future__ import annotations

import onnx

from qtool.errors import ModelError
from qtool.model.opset21 import TARGET_OPSET
from qtool.model.prepare import tensor_types
from qtool.plan.layout import Layout, plan_layout
from qtool.plan.settings import QuantizationSpec


def min_opset(model_opset: int, quantization: QuantizationSpec) -> int:
    """The opset the float model is prepared at: 21 when any 4-bit or blocked weight (or an
    ort-cpu embedding table) may be written, whose DequantizeLinear needs it."""
    if quantization.may_need_opset21:
        return max(model_opset, TARGET_OPSET)
    return model_opset


def float_tensors(model: onnx.ModelProto) -> set[str]:
    return {
        name for name, (elem, _) in tensor_types(model).items() if elem == onnx.TensorProto.FLOAT
    }


def plan(
    model: onnx.ModelProto,
    quantization: QuantizationSpec,
    activation_method: str,
    where: str,
    floats: set[str] | None = None,
    require_quantized: bool = True,
) -> Layout:
    """The Plan and QDQ slots of `model` under `quantization`; `where` names the settings'
    source (the recipe file) in errors. Refuses a plan that quantizes nothing (unless the
    caller builds variants of a plan on purpose): a run that writes a copy of the float model
    as its result would be silently wrong. A plan that only types nodes fp16/bf16 (op_types
    empty, quantization.float_type fp16) writes a typed model, not a copy."""
    layout = plan_layout(
        model,
        quantization,
        floats if floats is not None else float_tensors(model),
        activation_method,
        where,
    )
    typed = any(node.precision in ("fp16", "bf16") for node in layout.plan)
    if require_quantized and not layout.quantized_nodes() and not typed:
        raise ModelError(
            f"{where}: no node can be quantized with quantization.op_types "
            f"{list(quantization.op_types)} and the exclude list (and no node is typed fp16 or "
            "bf16)"
        )
    return layout
