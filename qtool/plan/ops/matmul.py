"""MatMul and Gemm: a constant weight B per output column, or 4-bit blocks along K.

ORT fuses DQ -> MatMul into MatMulIntegerToFloat (float output) or, when a QuantizeLinear reads
the output, QLinearMatMul; DQ -> Gemm into QGemm. Neither needs a quantized output, so qtool
quantizes none. A MatMul between two activations (attention) quantizes both inputs. 4-bit
weights are blocked along K, the only layout ORT runs as com.microsoft MatMulNBits: qtool writes
MatMulNBits directly on ort-cpu (quantization.int4_format) and DQ -> MatMul for TensorRT, which
ORT still fuses into MatMulNBits when it loads the model. A Gemm transB weight is stored [K, N]
for that (WeightPlan.transposed). These are the weights GPTQ rounds.
"""

from __future__ import annotations

import onnx

from qtool.plan.graph import GraphIndex, float_attribute, int_attribute
from qtool.plan.node_settings import NodeSettings
from qtool.plan.ops.forms import float_type_entries, fp8_entry
from qtool.plan.ops.registry import (
    INT4_INT8,
    INT4_WEIGHT_ONLY,
    INT8,
    INT8_DYNAMIC,
    INT8_DYNAMIC_TOKEN,
    INT8_WEIGHT_ONLY,
    Entry,
    NodeSlots,
    OpRule,
    OrtFusion,
    Weights,
)
from qtool.plan.ops.tensorrt_fp8 import gemm_declines_fp8
from qtool.plan.plan import WeightPlan
from qtool.plan.settings import QuantizationSpec
from qtool.plan.slots import BiasSlot, WeightSlot

_NO_BLOCKS = "blocks need a 2-D weight"
_DYNAMIC_NO_BLOCKS = (
    "dynamic int8 weights are per channel or per tensor (MatMulInteger has no blocks)"
)


def matmul_slots(
    node: onnx.NodeProto,
    graph: GraphIndex,
    spec: QuantizationSpec,
    chosen: NodeSettings,
    entry: Entry,
) -> NodeSlots | str:
    """A constant B is the weight (per output column, or blocks along K), and so is the
    initializer W behind B = Transpose(W) (a tied lm_head); a float B is an activation like A,
    and the node has no weight."""
    a, b = node.input[0], node.input[1]
    if not graph.is_float_activation(a) and not graph.is_float_constant(a):
        return "input A is not float"
    if graph.is_float_constant(a):
        return "constant first input (weight on the left) is not supported"
    settings = chosen.weights
    tied = graph.transposed_constant(b)
    if tied is not None:
        return NodeSlots(transposed_read_slot(tied, settings.granularity, settings.block_size))
    if graph.is_float_constant(b):
        dims = graph.initializers[b].dims
        if settings.granularity == "block" and chosen.activations == "dynamic":
            return _DYNAMIC_NO_BLOCKS
        if settings.granularity == "block":
            return NodeSlots(WeightSlot(b, len(dims) - 2, "k-rows", block_size=settings.block_size))
        axis = None if settings.granularity == "per-tensor" or len(dims) != 2 else 1
        return NodeSlots(WeightSlot(b, axis, "k-rows"))
    if not graph.is_float_activation(b):
        return "input B is not float"
    return NodeSlots(None)


def transposed_read_slot(weight: str, granularity: str, block_size: int | None) -> WeightSlot:
    """MatMul(x, Transpose(W)): W [N, K] is the weight, read as Gemm transB reads its own.

    A tied lm_head reads its embedding table this way. W keeps its own orientation in the file
    (every other reader, the embedding Gather, reads it as it is): one scale per output row
    (axis 0), or blocks along K (axis 1), which is also MatMulNBits' own [N, K] layout and
    GatherBlockQuantized's, so one stored table serves both (qtool/write/tied.py)."""
    if granularity == "block":
        return WeightSlot(weight, 1, "k-cols", block_size=block_size)
    return WeightSlot(weight, None if granularity == "per-tensor" else 0, "k-cols")


def gemm_slots(
    node: onnx.NodeProto,
    graph: GraphIndex,
    spec: QuantizationSpec,
    chosen: NodeSettings,
    entry: Entry,
) -> NodeSlots | str:
    """The weight per output channel (axis 1, or 0 with transB); blocked, it is stored [K, N]
    with blocks along K (the only layout ORT fuses into MatMulNBits). The bias goes int32 when
    it is the [N] vector QGemm adds with alpha = beta = 1."""
    inputs = list(node.input) + [""] * (3 - len(node.input))
    x, w, bias = inputs[0], inputs[1], inputs[2]
    if not graph.is_float_activation(x):
        return "input is not a float activation"
    if not graph.is_float_constant(w):
        return "weight is not a constant float initializer"
    if int_attribute(node, "transA", 0) != 0:
        return "Gemm with transA=1 is not supported"
    settings = chosen.weights
    trans_b = bool(int_attribute(node, "transB", 0))
    if chosen.activations == "dynamic":
        return _dynamic_gemm_slot(node, w, trans_b, settings.granularity)
    axis: int | None = 0 if trans_b else 1
    reduction = "k-cols" if trans_b else "k-rows"
    channels = list(graph.initializers[w].dims)[axis]
    block_size = None
    transposed = False
    if settings.granularity == "block":
        axis, block_size, transposed = 0, settings.block_size, trans_b
        reduction = "k-rows"
    bias_ok = bool(bias) and graph.is_float_constant(bias)
    if bias_ok:
        bias_dims = list(graph.initializers[bias].dims)
        alpha_beta_default = (
            float_attribute(node, "alpha") == 1.0 and float_attribute(node, "beta") == 1.0
        )
        bias_ok = bias_dims == [channels] and alpha_beta_default
    if settings.granularity == "per-tensor":
        axis = None
    slot = WeightSlot(w, axis, reduction, 1, block_size, transposed)
    integer_bias = entry.int32_bias and block_size is None
    return NodeSlots(slot, BiasSlot(bias, x, w) if bias_ok and integer_bias else None)


def _dynamic_gemm_slot(
    node: onnx.NodeProto, weight: str, trans_b: bool, granularity: str | None
) -> NodeSlots | str:
    """A dynamic Gemm is written as MatMulInteger (+ an Add of the float bias), which takes B
    as [K, N]: a transB weight is stored transposed. MatMulInteger has no alpha or beta."""
    if float_attribute(node, "alpha") != 1.0 or float_attribute(node, "beta") != 1.0:
        return "dynamic int8 writes Gemm as MatMulInteger + Add, which needs alpha = beta = 1"
    if granularity == "block":
        return _DYNAMIC_NO_BLOCKS
    axis = None if granularity == "per-tensor" else 1
    return NodeSlots(WeightSlot(weight, axis, "k-rows", 1, None, trans_b))


def not_nbits(weight: WeightPlan | None) -> str:
    """No MatMulNBits where the blocks are not a power of two >= 16 along K, or several nodes
    read the weight: ORT runs the float op on the dequantized weight (the words depend on the
    planned weight)."""
    tail = "ORT runs the float op on the dequantized weight (smaller file, float speed)"
    if weight is None:
        return tail
    if weight.block_size is None:
        why = "the weight is per channel; MatMulNBits needs blocks along K"
    elif weight.block_size < 16 or weight.block_size & (weight.block_size - 1):
        why = f"block size {weight.block_size} is not a power of two >= 16"
    elif weight.axis != 0:
        why = "the blocks do not run along K of a [K, N] weight"
    else:
        why = "ORT did not form MatMulNBits here (a weight shared by several nodes, or a "
        why += "non-default Gemm alpha/beta)"
    return f"{why}: {tail}"


def _qgemm_beta(node: onnx.NodeProto) -> str | None:
    """QGemm adds the bias unscaled: a Gemm with a bias and beta != 1 stays float."""
    if len(node.input) < 3 or not node.input[2]:
        return None
    beta = next((a.f for a in node.attribute if a.name == "beta"), 1.0)
    return None if beta == 1.0 else f"Gemm has a bias with beta = {beta:g} (QGemm needs beta = 1)"


_NBITS_WHEN = "blocks along K of a 2-D weight, a power of two >= 16, one reader of the weight"
# Measured on ORT 1.31: it forms an 8-bit MatMulNBits too, from a blocked or a per-column weight
# of a MatMul (a Gemm followed by a Relu is taken by its float Gemm + activation fusion first).
_NBITS8_WHEN = (
    "ORT forms an 8-bit MatMulNBits from DQ -> {op} when it loads the model (ORT 1.31: blocks "
    "along K, or one scale per column of a MatMul weight)"
)
_NO_4BIT_QLINEAR = (
    "ORT's QLinear kernels take no 4-bit weight: it runs DQ -> float {op} behind a dequantized "
    "input"
)


# ORT's own dynamic form (what onnxruntime.quantization.quantize_dynamic writes) and what its
# CPU provider makes of it, measured on ORT 1.31: DynamicQuantizeLinear + MatMulInteger + Cast
# + Mul (+ the bias Add after it) become one DynamicQuantizeMatMul; where one
# DynamicQuantizeLinear feeds several nodes (the Q, K and V projections of one input), each
# becomes MatMulIntegerToFloat behind the shared DynamicQuantizeLinear. Unfused
# (ORT_DISABLE_ALL) the same nodes run as written: MatMulInteger on uint8 x int8.
_DYNAMIC_WHEN = (
    "DynamicQuantizeMatMul where the DynamicQuantizeLinear feeds this node alone, "
    "MatMulIntegerToFloat where several nodes share it; the bias Add after it is absorbed"
)


# Per-token ranges have no fused kernel in ORT: DynamicQuantizeMatMul and MatMulIntegerToFloat
# take one input scale and zero point per tensor, and MatMulInteger's CPU kernel one zero point.
# So the zero points are applied after the integer product (acc - z_row x column sums of B),
# and ORT runs the MatMulInteger as written.
_DYNAMIC_TOKEN_WHEN = (
    "never fused: ORT's fused dynamic kernels take one input scale and zero point per tensor; "
    "MatMulInteger runs as written, the per-token zero points applied after it"
)


def _dynamic_entry(op: str, per_token: bool = False) -> Entry:
    """int8 weights, the input quantized at run time (ort-cpu only: TensorRT has no form): one
    range per tensor, or per row of the input (`per_token`)."""
    bias = " -> Add(float bias)" if op == "Gemm" else ""
    stored = " (a transB weight stored [K, N])" if op == "Gemm" else ""
    if per_token:
        quantize = (
            "per row of the input: ReduceMin/ReduceMax -> uint8 scale and zero point -> "
            "QuantizeLinear's arithmetic"
        )
        after = (
            " -> minus zero point x the weight's column sums (int32) -> Cast -> "
            "Mul(row scale x weight scale)"
        )
        fused, when = ("MatMulInteger",), _DYNAMIC_TOKEN_WHEN
    else:
        quantize = "DynamicQuantizeLinear(uint8, range at run time)"
        after = " -> Cast -> Mul(input scale x weight scale)"
        fused, when = ("DynamicQuantizeMatMul", "MatMulIntegerToFloat"), _DYNAMIC_WHEN
    return Entry(
        f"{quantize} -> MatMulInteger replacing the {op}, weight int8 per output channel{stored}"
        f"{after}{bias}",
        ("MatMulInteger",),
        fused,
        when=when,
    )


def _entries(
    op: str, int8_kernels: tuple[str, ...], int8_when: str, bias: bool
) -> dict[tuple[str, str], Entry]:
    """The same forms for MatMul and Gemm: they differ in the int8 kernel and the weight axis."""
    nbits = f"MatMulNBits replacing the {op} (com.microsoft; compute type picked for the CPU)"
    blocked = f"DQ(int4 blocks along K) -> {op}"
    weight_only_8 = Entry(
        f"weight int8 per output channel (or blocks along K) -> DQ -> {op} on float activations "
        "(a tied table in blocks: 8-bit MatMulNBits sharing the embedding's data)",
        (op, "MatMulNBits"),
        ("MatMulNBits",),
        when=_NBITS8_WHEN.format(op=op),
        not_fused=not_nbits,
    )
    return {
        ("ort-cpu", INT8): Entry(
            f"DQ(uint8) -> {op}; weight int8 per output channel; output not quantized"
            + ("; bias int32" if bias else ""),
            (op,),
            int8_kernels,
            when=int8_when,
            int32_bias=bias,
        ),
        ("tensorrt", INT8): Entry(
            f"DQ(int8, symmetric) -> {op}; weight int8 per output channel; output not quantized"
            + ("; bias in the float type" if bias else ""),
            (op,),
            int8_kernels,
            when="where ORT rewrites the int8 Q/DQ pair of the input to uint8 (its "
            "QuantizeLinear feeds one DequantizeLinear), or on ARM",
        ),
        ("ort-cpu", INT8_DYNAMIC): _dynamic_entry(op),
        ("ort-cpu", INT8_DYNAMIC_TOKEN): _dynamic_entry(op, per_token=True),
        ("ort-cpu", INT8_WEIGHT_ONLY): weight_only_8,
        ("tensorrt", INT8_WEIGHT_ONLY): weight_only_8,
        ("ort-cpu", INT4_WEIGHT_ONLY): Entry(
            f"{nbits} when quantization.int4_format is matmulnbits (the default) and the weight "
            f"allows it; else {blocked}",
            ("MatMulNBits", op),
            ("MatMulNBits",),
            when=_NBITS_WHEN,
            not_fused=not_nbits,
            signed_scales=True,
        ),
        ("tensorrt", INT4_WEIGHT_ONLY): Entry(
            f"{blocked} (quantization.int4_format qdq, the default; matmulnbits writes {nbits})",
            (op, "MatMulNBits"),
            ("MatMulNBits",),
            when=f"ORT forms MatMulNBits from DQ -> {op} when it loads the model: {_NBITS_WHEN}",
            not_fused=not_nbits,
        ),
        ("ort-cpu", INT4_INT8): Entry(
            f"DQ(uint8) -> {nbits} when quantization.int4_format is matmulnbits and the weight "
            f"allows it; else DQ(uint8) -> {op} with a DQ(int4 blocks along K) weight",
            ("MatMulNBits", op),
            ("MatMulNBits",),
            when=_NBITS_WHEN,
            signed_scales=True,
        ),
        ("tensorrt", INT4_INT8): Entry(
            f"DQ(int8, symmetric) -> {op}; weight int4 in blocks along K",
            (op, "MatMulNBits"),
            not_fused=_NO_4BIT_QLINEAR.format(op=op),
        ),
        **fp8_entry(
            f"DQ(fp8 e4m3) -> {op}; weight fp8 per output channel; output not quantized"
            + ("; bias in the float type" if bias else ""),
            (op,),
            gemm_declines_fp8,
        ),
        **float_type_entries(op, "weight and bias" if bias else "weight"),
    }


GEMM = OpRule(
    op_type="Gemm",
    family="matmul",
    quantizable=True,
    weights=Weights(gemm_slots, no_blocks=_NO_BLOCKS, gptq=True),
    ort=OrtFusion(
        kernels=("QGemm",),
        weight_input=1,
        bias_input=2,
        quantizes_float_weights=True,
        check=_qgemm_beta,
    ),
    entries=_entries("Gemm", ("QGemm",), "alpha = 1 and, with a bias, beta = 1", bias=True),
)

MATMUL = OpRule(
    op_type="MatMul",
    family="matmul",
    quantizable=True,
    weights=Weights(matmul_slots, no_blocks=_NO_BLOCKS, gptq=True),
    ort=OrtFusion(
        kernels=("QLinearMatMul", "MatMulIntegerToFloat"),
        weight_input=1,
        int8_activations_arm_only=True,
    ),
    entries=_entries(
        "MatMul",
        ("QLinearMatMul", "MatMulIntegerToFloat"),
        "QLinearMatMul when a QuantizeLinear reads the output, else MatMulIntegerToFloat",
        bias=False,
    ),
)

# Gemm before MatMul: the order quantization.op_types choices are listed in.
RULES = (GEMM, MATMUL)
