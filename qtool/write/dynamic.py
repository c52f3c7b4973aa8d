"""Dynamic INT8: a MatMul/Gemm whose input is quantized at run time, in ONNX Runtime's own form.

The op registry's `int8/dynamic` entries (qtool/plan/ops/matmul.py) describe the form; this
module writes it. It is what `onnxruntime.quantization.quantize_dynamic` writes, because that is
the form ORT's CPU provider fuses best (measured on ORT 1.31):

    x -> DynamicQuantizeLinear -> (x_q uint8, x_scale, x_zero_point)
    MatMulInteger(x_q, W_q int8, x_zero_point, W_zero_point) -> int32
      -> Cast(float) -> Mul(x_scale x W_scale) [-> Add(bias): a Gemm's own bias]

ORT turns MatMulInteger + Cast + Mul (+ the bias Add that follows) into MatMulIntegerToFloat,
and folds a DynamicQuantizeLinear that feeds one such node into DynamicQuantizeMatMul. The QDQ
spelling (DynamicQuantizeLinear -> DequantizeLinear -> MatMul) is not used: ORT may turn its
per-column weight DequantizeLinear into an 8-bit weight-only MatMulNBits and leave the input
float (measured: 4x slower than the integer form on a 6-layer MLP). Unfused (ORT_DISABLE_ALL)
these standard ops run as written, which is the dynamic quantization's exact semantics.

The MatMulInteger keeps the planned node's name, so the runtime truth (runtime/fusion.py) finds
the ORT node that runs it by name, as for every other form.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper


def dynamic_names(tensor: str) -> tuple[str, str, str]:
    """The outputs of the DynamicQuantizeLinear of `tensor`: quantized, scale, zero point."""
    return (
        f"{tensor}_dynamic_quantized",
        f"{tensor}_dynamic_scale",
        f"{tensor}_dynamic_zero_point",
    )


def dynamic_quantize_node(tensor: str) -> onnx.NodeProto:
    """The one DynamicQuantizeLinear of `tensor`, shared by every dynamic node that reads it."""
    return helper.make_node(
        "DynamicQuantizeLinear",
        [tensor],
        list(dynamic_names(tensor)),
        name=f"{tensor}_DynamicQuantizeLinear",
    )


def dynamic_matmul_nodes(node: onnx.NodeProto, weight: str) -> list[onnx.NodeProto]:
    """`node` (a MatMul, or a Gemm with alpha = beta = 1 and transA = 0; the layout admits no
    other) in the dynamic form above. `weight` is the float weight's name: the writer stores
    `{weight}_quantized` ([K, N], a transB weight transposed), `_scale` and `_zero_point`."""
    name, output = node.name, node.output[0]
    quantized, scale, zero_point = dynamic_names(node.input[0])
    integer, as_float = f"{output}_int32", f"{output}_int32_float"
    scales = f"{output}_dynamic_scales"
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 else ""
    product = f"{output}_before_bias" if bias else output
    nodes = [
        helper.make_node("Mul", [scale, f"{weight}_scale"], [scales], name=f"{name}_scales_Mul"),
        helper.make_node(
            "MatMulInteger",
            [quantized, f"{weight}_quantized", zero_point, f"{weight}_zero_point"],
            [integer],
            name=name,
        ),
        helper.make_node("Cast", [integer], [as_float], name=f"{name}_Cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", [as_float, scales], [product], name=f"{name}_Mul"),
    ]
    if bias:
        nodes.append(helper.make_node("Add", [product, bias], [output], name=f"{name}_bias_Add"))
    return nodes
