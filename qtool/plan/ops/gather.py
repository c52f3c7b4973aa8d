"""Gather from a constant table (embeddings): the table is the weight, the indices stay integers.

Only the table is quantized; the gathered rows are float, so the node is weight-only whatever
the recipe says of activations. For ORT's CPU provider the table is written as com.microsoft
GatherBlockQuantized, which runs on the quantized table: it wants blocks along each row (a
power of two >= 16 that divides the row) and has no signed 8-bit form, so 8-bit tables there
are blocked and asymmetric. For TensorRT the table is a standard DQ -> Gather, per row or in the
recipe's blocks, which ORT runs in float.
"""

from __future__ import annotations

import onnx

from qtool.plan.graph import GraphIndex, int_attribute
from qtool.plan.node_settings import NodeSettings
from qtool.plan.ops.forms import float_type_entries
from qtool.plan.ops.registry import (
    INT4_WEIGHT_ONLY,
    INT8_WEIGHT_ONLY,
    Entry,
    NodeSlots,
    OpRule,
    OrtFusion,
    Weights,
)
from qtool.plan.settings import QuantizationSpec
from qtool.plan.slots import WeightSlot

# GatherBlockQuantized's blocks (ORT 1.31): a power of two >= 16 that divides the row.
_GBQ_BLOCKS = (128, 64, 32, 16)


def _fitting_block(size: int, wanted: int, sizes: tuple[int, ...] | None) -> int | None:
    """The recipe's block, else the largest of the form's `sizes` under it that divides `size`
    (None: none does); without `sizes` the form takes the recipe's block as it is."""
    if sizes is None:
        return wanted
    for block in (wanted, *sizes):
        if block <= wanted and size % block == 0:
            return block
    return None


def gather_slots(
    node: onnx.NodeProto,
    graph: GraphIndex,
    spec: QuantizationSpec,
    chosen: NodeSettings,
    entry: Entry,
) -> NodeSlots | str:
    table, indices = node.input[0], node.input[1]
    if not graph.is_float_constant(table):
        return "data input is not a constant float table"
    if graph.is_float_activation(indices) or indices in graph.initializers:
        return "indices are constant or float"
    dims = list(graph.initializers[table].dims)
    if len(dims) != 2 or int_attribute(node, "axis", 0) != 0:
        return "only 2-D tables gathered along axis 0 are quantized"
    settings = chosen.weights
    block = None
    if settings.granularity == "block" or entry.always_blocked:
        block = _fitting_block(dims[1], settings.block_size or 128, entry.block_sizes)
    axis = 1 if block is not None else 0
    return NodeSlots(WeightSlot(table, axis, "gather", block_size=block))


_FLOAT_GATHER = (
    "the table is dequantized and gathered in float (standard ONNX form, ORT fuses only "
    "com.microsoft GatherBlockQuantized)"
)


def _gbq(table: str, unsigned_blocks: str | None = None) -> Entry:
    return Entry(
        f"{table} table in blocks along each row -> com.microsoft GatherBlockQuantized; rows "
        "no block of 16 or more divides: one scale per row, DQ -> Gather",
        ("GatherBlockQuantized", "Gather"),
        ("GatherBlockQuantized",),
        when="a block of 16 or more divides the row",
        not_fused=_FLOAT_GATHER,
        always_blocked=True,
        block_sizes=_GBQ_BLOCKS,
        unsigned_blocks=unsigned_blocks,
    )


def _dq_gather(table: str) -> Entry:
    return Entry(
        f"{table} table, one scale per row (or the recipe's blocks along it) -> DQ -> Gather",
        ("Gather",),
        not_fused=_FLOAT_GATHER,
    )


GATHER = OpRule(
    op_type="Gather",
    family="gather",
    quantizable=True,
    weights=Weights(
        gather_slots, no_blocks="no block size divides the table's rows: one scale per row"
    ),
    activation_inputs=False,
    # ORT runs DQ -> Gather -> Q of an activation on the integers (data movement).
    ort=OrtFusion(on_integers=True),
    entries={
        ("ort-cpu", INT8_WEIGHT_ONLY): _gbq(
            "8-bit (uint8)", unsigned_blocks="GatherBlockQuantized has no signed 8-bit form"
        ),
        ("ort-cpu", INT4_WEIGHT_ONLY): _gbq("4-bit"),
        ("tensorrt", INT8_WEIGHT_ONLY): _dq_gather("8-bit"),
        ("tensorrt", INT4_WEIGHT_ONLY): _dq_gather("4-bit"),
        **float_type_entries("Gather", "table"),
    },
)

RULES = (GATHER,)
