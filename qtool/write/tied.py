"""A tied table written once for both its readers: GatherBlockQuantized and MatMulNBits.

A tied embedding W [V, D] is read by the embedding Gather and, through Transpose, by the lm_head
MatMul (qtool/model/tie_weights.py). Quantized in blocks along D (the plan's layout for both,
qtool/plan/ops/matmul.py), W is already in MatMulNBits' own layout: B is [N, K] = [V, D] in
blocks along K. com.microsoft GatherBlockQuantized reads uint8 data "with MatMulNBits'
conventions" (ORT's words: packed two 4-bit values per byte, low nibble first, unsigned with a
default zero point of 8, or 128 for 8 bits), so one table serves both:

    {W}_quantized   uint8 [V, blocks, block * bits / 8]   MatMulNBits B, GatherBlockQuantized data
    {W}_scale       float [V, blocks]                     MatMulNBits
    {W}_zero_point  uint8 [V, ceil(blocks * bits / 8)]    MatMulNBits, asymmetric only
    Reshape({W}_scale, [V, blocks, 1])                    GatherBlockQuantized (quantize_axis 2)
    Reshape({W}_zero_point, [V, blocks, 1])               the same, 8 bits; 4 bits: its own
                                                          uint8 [V, blocks, 1] (one nibble a byte)
    Reshape(GatherBlockQuantized's [.., blocks, block], Shape(indices) ++ [D]) -> Gather output

The table is MatMulNBits' B itself, not a Reshape of it: ORT prepacks an initializer B once, but
a B computed by a node (the Reshape an unfused session does not fold) it dequantized whole on
every run (Gemma 3's 262144 x 640 table: 0.67 GB a run), and the folded Reshape of a fused
session held a second copy of the table. The Reshapes left are of the scales (V x blocks) and of
a gathered activation.

Checked on ORT 1.31: both 4- and 8-bit, symmetric and asymmetric, reproduce DequantizeLinear's
values exactly (tests/test_tied_embeddings.py). The file then holds the table once, and both
readers run fused kernels: the lm_head, the largest MatMul of a small LLM, runs as MatMulNBits
instead of dequantizing and transposing the whole table at every step.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.write.int4 import MS_DOMAIN, BlockwiseWeight

__all__ = ["TiedTable", "tied_tables"]


def _power_of_two_at_least_16(block: int) -> bool:
    return block >= 16 and block & (block - 1) == 0


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values along the last axis; 4 bits: two per byte, low nibble first (zero-padded)."""
    if bits == 8:
        return np.ascontiguousarray(values, dtype=np.uint8)
    if values.shape[-1] % 2:
        pad = np.zeros((*values.shape[:-1], 1), np.uint8)
        values = np.concatenate([values, pad], axis=-1)
    pairs = values.astype(np.uint8).reshape(*values.shape[:-1], -1, 2)
    return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4), dtype=np.uint8)


class TiedTable:
    """One table W written for GatherBlockQuantized readers and Transpose -> MatMul readers."""

    def __init__(self, name: str, bw: BlockwiseWeight) -> None:
        self.name = name
        self.bw = bw
        self.rows, self.columns = bw.values.shape
        self.block = int(bw.block_size)
        self.blocks = self.columns // self.block

    @property
    def data(self) -> str:
        return f"{self.name}_quantized"

    def _matmul_tail(self) -> list[str]:
        tail = [f"{self.name}_scale"]
        if self.bw.zero_point is not None:
            tail.append(f"{self.name}_zero_point")
        return tail

    def _gather_tail(self) -> list[str]:
        tail = [f"{self.name}_scale_blocks"]
        if self.bw.zero_point is not None:
            tail.append(f"{self.name}_zero_point_blocks")
        return tail

    def initializers(self) -> list[onnx.TensorProto]:
        bw = self.bw
        offset = 0 if bw.zero_point is not None else 1 << (bw.bits - 1)  # signed -> unsigned
        unsigned = (bw.values.astype(np.int16) + offset).astype(np.uint8)
        by_block = unsigned.reshape(self.rows, self.blocks, self.block)
        tensors = [
            numpy_helper.from_array(_pack(by_block, bw.bits), self.data),
            numpy_helper.from_array(
                np.ascontiguousarray(bw.scale, np.float32), self._matmul_tail()[0]
            ),
            numpy_helper.from_array(
                np.array([self.rows, self.blocks, 1], np.int64), f"{self.name}_blocks_shape"
            ),
            numpy_helper.from_array(np.array([self.columns], np.int64), f"{self.name}_row_shape"),
        ]
        if bw.zero_point is not None:
            zero = np.asarray(bw.zero_point, np.uint8)
            tensors.append(numpy_helper.from_array(_pack(zero, bw.bits), self._matmul_tail()[1]))
            if bw.bits == 4:  # GatherBlockQuantized packs along its one-block axis: a nibble a byte
                tensors.append(
                    numpy_helper.from_array(
                        zero.reshape(self.rows, self.blocks, 1), self._gather_tail()[1]
                    )
                )
        return tensors

    def head_nodes(self) -> list[onnx.NodeProto]:
        """The Reshapes of the scales (and 8-bit zero points) into GatherBlockQuantized's
        [V, blocks, 1]."""
        shape = f"{self.name}_blocks_shape"
        pairs = list(zip(self._matmul_tail(), self._gather_tail(), strict=True))
        if self.bw.bits == 4:
            pairs = pairs[:1]  # its zero points are an initializer of their own
        return [
            helper.make_node("Reshape", [source, shape], [target], name=f"{target}_Reshape")
            for source, target in pairs
        ]

    def gather(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """GatherBlockQuantized replacing the Gather `node` (its name kept, for the Plan), and
        the Reshape of its [.., blocks, block] rows into the Gather's output [.., D]."""
        indices, output = node.input[1], node.output[0]
        by_block, shape = f"{output}_blocks", f"{output}_shape"
        return [
            helper.make_node(
                "GatherBlockQuantized",
                [self.data, indices, *self._gather_tail()],
                [by_block],
                name=node.name,
                domain=MS_DOMAIN,
                gather_axis=0,
                quantize_axis=2,
                block_size=self.block,
                bits=self.bw.bits,
            ),
            helper.make_node(
                "Shape", [indices], [f"{output}_indices_shape"], name=f"{output}_Shape"
            ),
            helper.make_node(
                "Concat",
                [f"{output}_indices_shape", f"{self.name}_row_shape"],
                [shape],
                name=f"{output}_Concat",
                axis=0,
            ),
            helper.make_node("Reshape", [by_block, shape], [output], name=f"{output}_Reshape"),
        ]

    def matmul(self, node: onnx.NodeProto, accuracy_level: int) -> onnx.NodeProto:
        """MatMulNBits replacing MatMul(x, Transpose(W)) `node` (its name kept)."""
        return helper.make_node(
            "MatMulNBits",
            [node.input[0], self.data, *self._matmul_tail()],
            list(node.output),
            name=node.name,
            domain=MS_DOMAIN,
            K=self.columns,
            N=self.rows,
            bits=self.bw.bits,
            block_size=self.block,
            accuracy_level=accuracy_level,
        )


def _form_blocker(bw: BlockwiseWeight) -> str | None:
    if bw.values.ndim != 2 or bw.block_size is None or bw.axis != 1:
        return "not a 2-D table in blocks along its rows"
    if bw.bits not in (4, 8):
        return f"{bw.bits}-bit"
    if not _power_of_two_at_least_16(int(bw.block_size)):
        return f"block {bw.block_size} is not a power of two >= 16"
    if bw.values.shape[1] % int(bw.block_size):
        return "the block does not divide the row"
    return None


def tied_tables(
    graph: onnx.GraphProto, low_bit: dict[str, BlockwiseWeight]
) -> tuple[dict[str, TiedTable], dict[str, str], set[str]]:
    """The low-bit tables to write in the shared form: every reader a Gather of it (axis 0) or
    a Transpose (perm [1, 0]) read only as input B of MatMuls, at least one such MatMul.

    Returns (table name -> TiedTable, MatMul node name -> table, Transpose node names to drop).
    """
    readers: dict[str, list[onnx.NodeProto]] = {}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in set(node.input):
            if name in low_bit:
                readers.setdefault(name, []).append(node)
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    tables: dict[str, TiedTable] = {}
    matmuls: dict[str, str] = {}
    dropped: set[str] = set()
    for name, nodes in sorted(readers.items()):
        if _form_blocker(low_bit[name]) is not None:
            continue
        these_matmuls: list[onnx.NodeProto] = []
        these_transposes: list[str] = []
        ok = True
        for node in nodes:
            if _gathers(node, name):
                continue
            matmuls_here = _transposed_for_matmuls(node, consumers, outputs)
            if matmuls_here is None:
                ok = False
                break
            these_matmuls += matmuls_here
            these_transposes.append(node.name)
        if ok and these_matmuls:
            tables[name] = TiedTable(name, low_bit[name])
            matmuls.update({m.name: name for m in these_matmuls})
            dropped.update(these_transposes)
    return tables, matmuls, dropped


def _gathers(node: onnx.NodeProto, table: str) -> bool:
    """`node` gathers rows of `table` (axis 0, the table as data only)."""
    return (
        node.op_type == "Gather"
        and node.input[0] == table
        and node.input[1] != table
        and _axis(node) == 0
    )


def _transposed_for_matmuls(
    node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]], outputs: set[str]
) -> list[onnx.NodeProto] | None:
    """The MatMuls that read `node` (a Transpose perm [1, 0]) as their B and nothing else reads
    it; None when `node` is not such a Transpose."""
    if node.op_type != "Transpose" or _perm(node) not in ([1, 0], None):
        return None
    out = node.output[0]
    users = consumers.get(out, [])
    if out in outputs or not users:
        return None
    for user in users:
        if user.op_type != "MatMul" or user.input[1] != out or user.input[0] == out:
            return None
    return users


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _perm(node: onnx.NodeProto) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
