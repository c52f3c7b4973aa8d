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

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


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


def _product_and_bias(node: onnx.NodeProto) -> tuple[str, list[onnx.NodeProto]]:
    """Where a dynamic form writes its float product, and the Add of a Gemm's own bias after it
    (none for a MatMul or a Gemm without one): both forms end the same way."""
    name, output = node.name, node.output[0]
    if node.op_type != "Gemm" or len(node.input) < 3 or not node.input[2]:
        return output, []
    product = f"{output}_before_bias"
    return product, [
        helper.make_node("Add", [product, node.input[2]], [output], name=f"{name}_bias_Add")
    ]


def dynamic_matmul_nodes(node: onnx.NodeProto, weight: str) -> list[onnx.NodeProto]:
    """`node` (a MatMul, or a Gemm with alpha = beta = 1 and transA = 0; the layout admits no
    other) in the dynamic form above. `weight` is the float weight's name: the writer stores
    `{weight}_quantized` ([K, N], a transB weight transposed), `_scale` and `_zero_point`."""
    name, output = node.name, node.output[0]
    quantized, scale, zero_point = dynamic_names(node.input[0])
    integer, as_float = f"{output}_int32", f"{output}_int32_float"
    scales = f"{output}_dynamic_scales"
    product, bias_add = _product_and_bias(node)
    return [
        helper.make_node("Mul", [scale, f"{weight}_scale"], [scales], name=f"{name}_scales_Mul"),
        helper.make_node(
            "MatMulInteger",
            [quantized, f"{weight}_quantized", zero_point, f"{weight}_zero_point"],
            [integer],
            name=name,
        ),
        helper.make_node("Cast", [integer], [as_float], name=f"{name}_Cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", [as_float, scales], [product], name=f"{name}_Mul"),
        *bias_add,
    ]


# ---------------------------------------------------------------------- one range per token
#
# quantization.dynamic_ranges: per-token. DynamicQuantizeLinear takes one range for the whole
# tensor, so in an LLM the few tokens with huge activations (the first token, delimiters) set
# every other token's step (SmolLM2-135M W8A8: +52% perplexity). Here each row of the last axis
# (a token) gets its own uint8 scale and zero point, in ONNX's standard arithmetic, exactly as
# DynamicQuantizeLinear computes them for that row alone:
#
#   lo = min(ReduceMin(x), 0), hi = max(ReduceMax(x), 0)          (per row, keepdims)
#   scale = max((hi - lo) / 255, tiny), zero = clip(round(-lo / scale), 0, 255)
#   x_q = uint8(clip(round(x / scale) + zero, 0, 255))
#
# MatMulInteger's CPU kernel takes one input zero point, so the product runs without it and the
# zero points are taken off after, in int32 (exact): sum_k (x_q - z)(w - w_z) = MatMulInteger(x_q,
# w, 0, w_z) - z * sum_k (w - w_z), the weight's column sums stored once. Then Cast, and the
# row scale times the weight's scale. ORT has no fused kernel for per-row input scales, so it
# runs these nodes as written (the registry's int8/dynamic-per-token entry).

# Shared constants of every per-token quantization in a model.
TOKEN_CONSTANTS = {
    "qtool_token_axes": np.asarray([-1], np.int64),
    "qtool_token_zero": np.asarray(0.0, np.float32),
    "qtool_token_levels": np.asarray(255.0, np.float32),
    "qtool_token_tiny": np.asarray(np.finfo(np.float32).tiny, np.float32),
}


def token_names(tensor: str) -> tuple[str, str, str]:
    """The per-token quantization of `tensor`: uint8 values, float scale, int32 zero point
    (the two last [..., rows, 1])."""
    return (
        f"{tensor}_token_quantized",
        f"{tensor}_token_scale",
        f"{tensor}_token_zero_point",
    )


def token_constants(opset: int) -> list[onnx.TensorProto]:
    """The initializers the per-token nodes read (once per model; the axes only from opset 18,
    where ReduceMin/ReduceMax take them as an input)."""
    return [
        numpy_helper.from_array(value, name)
        for name, value in TOKEN_CONSTANTS.items()
        if name != "qtool_token_axes" or opset >= 18
    ]


def _reduce(op: str, tensor: str, output: str, opset: int) -> onnx.NodeProto:
    """ReduceMin/ReduceMax over the last axis, kept: axes is an input from opset 18 on."""
    name = f"{tensor}_token_{op}"
    if opset >= 18:
        return helper.make_node(op, [tensor, "qtool_token_axes"], [output], name=name, keepdims=1)
    return helper.make_node(op, [tensor], [output], name=name, axes=[-1], keepdims=1)


def token_quantize_nodes(tensor: str, opset: int) -> list[onnx.NodeProto]:
    """The per-token quantization of `tensor`, shared by every dynamic node that reads it."""
    quantized, scale, zero_point = token_names(tensor)
    t = f"{tensor}_token"
    arithmetic = [
        ("Min", [f"{t}_min", "qtool_token_zero"], f"{t}_low"),
        ("Max", [f"{t}_max", "qtool_token_zero"], f"{t}_high"),
        ("Sub", [f"{t}_high", f"{t}_low"], f"{t}_range"),
        ("Div", [f"{t}_range", "qtool_token_levels"], f"{t}_step"),
        ("Max", [f"{t}_step", "qtool_token_tiny"], scale),
        ("Neg", [f"{t}_low"], f"{t}_neg_low"),
        ("Div", [f"{t}_neg_low", scale], f"{t}_zero_ratio"),
        ("Round", [f"{t}_zero_ratio"], f"{t}_zero_rounded"),
        ("Clip", [f"{t}_zero_rounded", "qtool_token_zero", "qtool_token_levels"], f"{t}_zero"),
        ("Div", [tensor, scale], f"{t}_ratio"),
        ("Round", [f"{t}_ratio"], f"{t}_rounded"),
        ("Add", [f"{t}_rounded", f"{t}_zero"], f"{t}_shifted"),
        ("Clip", [f"{t}_shifted", "qtool_token_zero", "qtool_token_levels"], f"{t}_levels"),
    ]
    return [
        _reduce("ReduceMin", tensor, f"{t}_min", opset),
        _reduce("ReduceMax", tensor, f"{t}_max", opset),
        *(
            helper.make_node(op, inputs, [out], name=f"{out}_{op}")
            for op, inputs, out in arithmetic
        ),
        helper.make_node(
            "Cast", [f"{t}_levels"], [quantized], name=f"{t}_Cast", to=TensorProto.UINT8
        ),
        helper.make_node(
            "Cast", [f"{t}_zero"], [zero_point], name=f"{t}_zero_Cast", to=TensorProto.INT32
        ),
    ]


def column_sums(weight: str, values: np.ndarray, zero_point: np.ndarray) -> onnx.TensorProto:
    """sum over K of (w - w_z), int32 [N] (kept [..., 1, N] for a batched weight): what the
    per-token zero points multiply."""
    centered = values.astype(np.int32) - np.asarray(zero_point).astype(np.int32)
    sums = centered.sum(axis=-2, keepdims=values.ndim > 2, dtype=np.int32)
    return numpy_helper.from_array(np.ascontiguousarray(sums), f"{weight}_column_sums")


def token_matmul_nodes(node: onnx.NodeProto, weight: str) -> list[onnx.NodeProto]:
    """`node` (a MatMul, or a Gemm as `dynamic_matmul_nodes` takes it) on its input quantized
    per token; reads `{weight}_quantized`, `_scale`, `_zero_point` and `_column_sums`."""
    name, o = node.name, node.output[0]
    quantized, scale, zero_point = token_names(node.input[0])
    product, bias_add = _product_and_bias(node)
    return [
        helper.make_node(
            "MatMulInteger",
            [quantized, f"{weight}_quantized", "", f"{weight}_zero_point"],
            [f"{o}_int32"],
            name=name,
        ),
        helper.make_node(
            "Mul", [zero_point, f"{weight}_column_sums"], [f"{o}_offset"], name=f"{name}_zero_Mul"
        ),
        helper.make_node(
            "Sub", [f"{o}_int32", f"{o}_offset"], [f"{o}_centered"], name=f"{name}_Sub"
        ),
        helper.make_node(
            "Cast",
            [f"{o}_centered"],
            [f"{o}_int32_float"],
            name=f"{name}_Cast",
            to=TensorProto.FLOAT,
        ),
        helper.make_node(
            "Mul",
            [f"{o}_int32_float", f"{weight}_scale"],
            [f"{o}_weight_scaled"],
            name=f"{name}_Mul",
        ),
        helper.make_node("Mul", [f"{o}_weight_scaled", scale], [product], name=f"{name}_row_Mul"),
        *bias_add,
    ]
