"""Entries shared by the families whose only quantized tensors are activations.

Add, Mul, Concat and the average pools are written the same way: a Q/DQ pair on every float
input and on the output, uint8 for ORT's CPU provider, symmetric int8 for TensorRT; ORT fuses
the group into one QLinear kernel when every quantized tensor has one type.
"""

from __future__ import annotations

from qtool.plan.ops.registry import INT8, Entry

# ORT's CPU QLinear kernels want one integer type on every input and the output; on a TensorRT
# model ORT rewrites an int8 Q/DQ pair to uint8 only where its QuantizeLinear feeds one
# DequantizeLinear, so some groups end up mixed.
_ONE_TYPE = "every quantized input and the output have one type"


def activation_entries(op_type: str, kernels: tuple[str, ...]) -> dict[tuple[str, str], Entry]:
    """int8 entries for an op whose inputs and output are activations (no weight)."""
    return {
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
