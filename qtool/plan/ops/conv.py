"""Conv: an int8 weight per output channel, uint8 activations in and out, an int32 bias.

ORT forms QLinearConv only from DQ -> Conv -> Q, so the output is quantized too (a Relu or
ReLU6 after it folds into that QuantizeLinear, clamp.py). A 4-bit Conv has no ORT kernel: the
weight is stored small and dequantized, and the Conv runs in float. Weights keep one scale per
output channel even when the recipe asks for blocks.
"""

from __future__ import annotations

import onnx

from qtool.plan.graph import GraphIndex, int_attribute
from qtool.plan.node_settings import NodeSettings
from qtool.plan.ops.forms import float_type_entries, fp8_entry
from qtool.plan.ops.registry import (
    INT4_INT8,
    INT4_WEIGHT_ONLY,
    INT8,
    INT8_WEIGHT_ONLY,
    Entry,
    NodeSlots,
    OpRule,
    OrtFusion,
    Weights,
)
from qtool.plan.ops.tensorrt_fp8 import conv_declines_fp8
from qtool.plan.settings import QuantizationSpec
from qtool.plan.slots import BiasSlot, WeightSlot


def conv_slots(
    node: onnx.NodeProto,
    graph: GraphIndex,
    spec: QuantizationSpec,
    chosen: NodeSettings,
    entry: Entry,
) -> NodeSlots | str:
    inputs = list(node.input) + [""] * (3 - len(node.input))
    x, w, bias = inputs[0], inputs[1], inputs[2]
    if not graph.is_float_activation(x):
        return "input is not a float activation"
    if not graph.is_float_constant(w):
        return "weight is not a constant float initializer"
    settings = chosen.weights
    bias_ok = bool(bias) and graph.is_float_constant(bias)
    group = int_attribute(node, "group", 1)
    w_dims = list(graph.initializers[w].dims)
    # ORT's QLinearConv takes its depthwise kernel when each group has one input and one output
    # channel; every other Conv runs as im2col x GEMM.
    depthwise = group > 1 and len(w_dims) >= 2 and w_dims[1] == 1 and w_dims[0] == group
    reduction = "depthwise" if depthwise else "conv"
    axis = None if settings.granularity == "per-tensor" else 0
    slot = WeightSlot(w, axis, reduction, group, None, False)
    return NodeSlots(slot, BiasSlot(bias, x, w) if bias_ok and entry.int32_bias else None)


_NO_4BIT = (
    "ORT has no {bits}-bit Conv kernel: it dequantizes the weight and runs the float Conv "
    "(smaller file, float speed)"
)

_NO_4BIT_QLINEAR = "QLinearConv takes no 4-bit weight: ORT runs DQ -> float Conv"

CONV = OpRule(
    op_type="Conv",
    family="conv",
    quantizable=True,
    weights=Weights(conv_slots, no_blocks="Conv weights use one scale per output channel"),
    output_quantized=True,
    ort=OrtFusion(
        kernels=("QLinearConv",),
        weight_input=1,
        bias_input=2,
        quantizes_float_weights=True,
        int8_activations_arm_only=True,
    ),
    entries={
        ("ort-cpu", INT8): Entry(
            "DQ(uint8) -> Conv -> Q(uint8); weight int8 per output channel, bias int32",
            ("Conv",),
            ("QLinearConv",),
            int32_bias=True,
        ),
        ("tensorrt", INT8): Entry(
            "DQ(int8, symmetric) -> Conv -> Q(int8); weight int8 per output channel, bias in "
            "the float type",
            ("Conv",),
            ("QLinearConv",),
            when="where ORT rewrites the int8 Q/DQ pairs to uint8, or on ARM (it quantizes "
            "the float bias itself)",
        ),
        ("ort-cpu", INT8_WEIGHT_ONLY): Entry(
            "weight int8 per output channel -> DQ -> Conv on float activations",
            ("Conv",),
            not_fused=_NO_4BIT.format(bits=8),
        ),
        ("tensorrt", INT8_WEIGHT_ONLY): Entry(
            "weight int8 per output channel -> DQ -> Conv on float activations",
            ("Conv",),
            not_fused=_NO_4BIT.format(bits=8),
        ),
        ("ort-cpu", INT4_WEIGHT_ONLY): Entry(
            "weight int4 per output channel -> DQ -> Conv on float activations",
            ("Conv",),
            not_fused=_NO_4BIT.format(bits=4),
            signed_scales=True,
        ),
        ("tensorrt", INT4_WEIGHT_ONLY): Entry(
            "weight int4 per output channel -> DQ -> Conv on float activations",
            ("Conv",),
            not_fused=_NO_4BIT.format(bits=4),
        ),
        ("ort-cpu", INT4_INT8): Entry(
            "DQ(uint8) -> Conv -> Q(uint8); weight int4 per output channel",
            ("Conv",),
            not_fused=_NO_4BIT_QLINEAR,
            signed_scales=True,
        ),
        ("tensorrt", INT4_INT8): Entry(
            "DQ(int8, symmetric) -> Conv -> Q(int8); weight int4 per output channel",
            ("Conv",),
            not_fused=_NO_4BIT_QLINEAR,
        ),
        **fp8_entry(
            "DQ(fp8 e4m3) -> Conv; weight fp8 per output channel, bias and output in the "
            "float type",
            ("Conv",),
            conv_declines_fp8,
        ),
        **float_type_entries("Conv", "weight and bias"),
    },
)

RULES = (CONV,)
