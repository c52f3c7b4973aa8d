"""Entries shared by several families.

Add, Mul, Concat and the average pools are written the same way: a Q/DQ pair on every float
input and on the output, uint8 for ORT's CPU provider, symmetric int8 for TensorRT; ORT fuses
the group into one QLinear kernel when every quantized tensor has one type. Every quantizable op
can be typed FP16 (both targets) or BF16 (TensorRT): no Q/DQ, the node and its constant inputs
in that type (write/float_type.py); the weighted ops also take FP8 E4M3 Q/DQ for TensorRT.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from qtool.plan.graph import GraphIndex
from qtool.plan.ops.registry import BF16, FP8, FP16, INT8, Entry

# ORT's CPU QLinear kernels want one integer type on every input and the output; on a TensorRT
# model ORT rewrites an int8 Q/DQ pair to uint8 only where its QuantizeLinear feeds one
# DequantizeLinear, so some groups end up mixed.
_ONE_TYPE = "every quantized input and the output have one type"


def activation_entries(op_type: str, kernels: tuple[str, ...]) -> dict[tuple[str, str], Entry]:
    """int8 entries for an op whose inputs and output are activations (no weight), and its
    float-typed entries."""
    return float_type_entries(op_type) | {
        ("ort-cpu", INT8): Entry(
            f"DQ(uint8) on each input -> {op_type} -> Q(uint8)",
            (op_type,),
            kernels,
            when=_ONE_TYPE if kernels else "",
        ),
        ("tensorrt", INT8): Entry(
            f"DQ(int8, symmetric) on each input -> {op_type} -> Q(int8)",
            (op_type,),
            kernels,
            when=_ONE_TYPE + " after ORT's int8 -> uint8 rewrite" if kernels else "",
        ),
    }


# What ORT's CPU provider makes of a node typed FP16: its FP16 kernels where it has them (few on
# x86), elsewhere FP32 between the Casts it inserts itself (InsertCastTransformer).
_FP16_ON_ORT = (
    "FP16 where ORT's CPU provider has an FP16 kernel, else FP32 between Casts ORT inserts"
)
# ORT's CPU provider has no BF16 kernels for most ops: qtool runs a BF16 file on the CPU as an
# FP32 copy that rounds every BF16 tensor to BF16 (runtime/bf16_emulation.py) and says so.
_BF16_ON_ORT = "not on ORT's CPU provider (no BF16 kernels): evaluated on an FP32 copy that "
_BF16_ON_ORT += "rounds every BF16 tensor to BF16"
# float8 Q/DQ: ORT's CPU QDQ fusion fails to load float8 around a MatMul (it builds
# MatMulIntegerToFloat on a float8 input, ORT 1.31), so qtool runs FP8 files unfused there.
_FP8_ON_ORT = "unfused only (ORT_DISABLE_ALL): DQ(float8) -> float op; ORT's CPU QDQ fusion "
_FP8_ON_ORT += "cannot load float8 Q/DQ around a MatMul"


def float_type_entries(op_type: str, constants: str = "") -> dict[tuple[str, str], Entry]:
    """FP16 (ort-cpu, tensorrt) and BF16 (tensorrt) entries: the node without Q/DQ, computing
    in that type; `constants` names its constant inputs stored in it ("weight and bias")."""
    stored = f", {constants} stored in it" if constants else ""
    entries = {}
    for target in ("ort-cpu", "tensorrt"):
        entries[(target, FP16)] = Entry(
            f"{op_type} typed FP16 (no Q/DQ){stored}",
            (op_type,),
            runs_as=_FP16_ON_ORT,
        )
    entries[("tensorrt", BF16)] = Entry(
        f"{op_type} typed BF16 (no Q/DQ){stored}", (op_type,), runs_as=_BF16_ON_ORT
    )
    return entries


def fp8_entry(
    written: str,
    op_types: tuple[str, ...],
    declines: Callable[[onnx.NodeProto, GraphIndex], str | None] | None = None,
) -> dict[tuple[str, str], Entry]:
    """The TensorRT FP8 E4M3 entry of a weighted op: per-tensor FP8 activations (amax or a
    histogram threshold / 448), per-output-channel FP8 weights, the bias left in the float
    type (TensorRT's DequantizeLinear takes no int32). The output is not quantized (TensorRT's
    Q/DQ placement recommendations: quantize the inputs of weighted ops, not their outputs; a
    Q/DQ pair on a tensor only FP16 ops read would add E4M3's rounding for no FP8 kernel).
    `declines`: the nodes whose shapes TensorRT's FP8 kernels gain nothing on
    (tensorrt_fp8.py)."""
    entry = Entry(written, op_types, runs_as=_FP8_ON_ORT, declines=declines, output_quantized=False)
    return {("tensorrt", FP8): entry}
