"""BF16 models on a CPU that cannot run them: an FP32 copy that rounds like BF16 storage.

ONNX Runtime's CPU provider has no BF16 kernels for Conv, MatMul, Gemm and most other ops, and
its automatic Casts cover FP16 only, so a file typed BF16 for TensorRT does not load there. To
verify and score it, qtool runs a copy in which every BF16 tensor is computed in FP32 and then
rounded to BF16 and back (a Cast pair ORT runs), and BF16 constants are widened exactly. What
the copy reproduces is BF16's storage rounding between ops; what it does not is rounding inside
an op (TensorRT's BF16 kernels accumulate in FP32, so this is the smaller part). Every number
measured on the copy says so.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

BF16 = TensorProto.BFLOAT16
FLOAT = TensorProto.FLOAT

EMULATED = (
    "ONNX Runtime's CPU provider has no BF16 kernels: measured on an FP32 copy that rounds every "
    "BF16 tensor to BF16 after the op that writes it (storage rounding; not BF16 arithmetic "
    "inside an op)"
)


def has_bf16(model: onnx.ModelProto) -> bool:
    """Whether the file types anything BF16 (constants, Casts, declared tensors)."""
    graph = model.graph
    if any(init.data_type == BF16 for init in graph.initializer):
        return True
    if any(n.op_type == "Cast" and _attr(n, "to") == BF16 for n in graph.node):
        return True
    infos = [*graph.input, *graph.output, *graph.value_info]
    return any(i.type.tensor_type.elem_type == BF16 for i in infos)


def _attr(node: onnx.NodeProto, name: str) -> int | None:
    return next((a.i for a in node.attribute if a.name == name), None)


def _low_outputs(model: onnx.ModelProto, low: int) -> set[str]:
    """Every tensor the model computes in `low` (ONNX type inference)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    infos = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    return {i.name for i in infos if i.type.tensor_type.elem_type == low}


def _widened(info: onnx.ValueInfoProto, low: int) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(info)
    if copy.type.tensor_type.elem_type == low:
        copy.type.tensor_type.elem_type = FLOAT
    return copy


def emulated(model: onnx.ModelProto, low: int = BF16) -> onnx.ModelProto:
    """The FP32 copy of a `low`-typed `model` (BF16; see the module docstring). With FLOAT16 it
    is FP16's storage-rounding limit with FP32 arithmetic (benchmarks/float_types.py)."""
    rounded_tensors = _low_outputs(model, low)
    graph = model.graph
    body: list[onnx.NodeProto] = []
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for attr in copy.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == low:
                attr.t.CopyFrom(numpy_helper.from_array(_to_float(attr.t), attr.t.name))
        rounded = [out for out in copy.output if out in rounded_tensors]
        if copy.op_type == "Cast" and _attr(copy, "to") == low:
            # the Cast rounds to the low type itself; widen its output after it
            out = copy.output[0]
            copy.output[0] = f"{out}_bf16"
            body.append(copy)
            body.append(helper.make_node("Cast", [copy.output[0]], [out], to=FLOAT))
            continue
        for index, out in enumerate(copy.output):
            if out in rounded:
                copy.output[index] = f"{out}_wide"
        body.append(copy)
        for out in rounded:
            body.append(helper.make_node("Cast", [f"{out}_wide"], [f"{out}_bf16"], to=low))
            body.append(helper.make_node("Cast", [f"{out}_bf16"], [out], to=FLOAT))
    initializers = []
    for init in graph.initializer:
        if init.data_type == low:
            initializers.append(numpy_helper.from_array(_to_float(init), init.name))
        else:
            initializers.append(init)
    copy_graph = helper.make_graph(
        body,
        graph.name,
        [_widened(i, low) for i in graph.input],
        [_widened(o, low) for o in graph.output],
        initializer=initializers,
    )
    wide = helper.make_model(copy_graph, opset_imports=list(model.opset_import))
    wide.ir_version = model.ir_version
    wide.metadata_props.extend(model.metadata_props)
    return wide


def _to_float(tensor: onnx.TensorProto):
    return numpy_helper.to_array(tensor).astype("float32")
