"""Where the bytes of a model file go: every record of its graph given to a planned node, to an
activation QDQ pair, or to the rest of the graph.

A serialized ONNX model is its header (ir_version, opsets, producer, metadata, the graph's name
and length prefix) followed by one record per node, initializer, value_info, graph input and
graph output; a record weighs a one-byte field tag, its length as a varint, and the message.
This module splits a model's bytes exactly that way, so the parts add up to the file:

- a planned node owns its node record (a Conv, or the MatMulNBits / GatherBlockQuantized that
  replaces its op under the same name), the initializers it reads (a float weight and bias, or
  the packed weight, block scales and zero points a 4-bit node reads itself), the
  DequantizeLinear nodes (and their int8 / int4 / int32 initializers) that feed only it, any
  node the writer inserted after it (the Add of a split Gemm bias), the value_info of the
  tensors it produces, and a Relu / Clip folded into its output (present in the float model,
  gone from the quantized one), and a Cast the typing pass put beside it at a float-type
  boundary;
- a node planned dynamic int8 owns every node the writer inserted between its float input and
  its output: the quantization of its input (a DynamicQuantizeLinear, or the per-token row
  quantization; shared by the nodes that read it) and what follows its MatMulInteger (Cast,
  Muls, the per-token zero-point correction);
- a Shape and Concat the writer inserted to compute the shape a Reshape after a planned node
  restores (the tied table's GatherBlockQuantized) are that node's;
- an activation slot (a tensor the layout quantizes) owns its QuantizeLinear, its
  DequantizeLinear, their scale and zero point, and the bytes by which unplanned nodes grow when
  they read the slot's longer `..._dequantized` name;
- an unplanned node of constants only that feeds only planned nodes (the Transpose of a tied
  table that the lm_head reads) is theirs;
- everything else (unplanned nodes, shape constants, graph inputs and outputs) is the rest.

The pieces are found from the graph's structure (what reads and writes what), not from the
writer's naming; a node the writer inserted that none of these rules places is an error, so a
change to the writer cannot silently leave bytes unpriced.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx

REST = ("rest", "")
# Ops the writer inserts only to compute a Reshape's target shape (write/tied.py)
_SHAPE_HELPERS = frozenset({"Shape", "Concat"})
Owner = tuple[str, str]  # ("node", name) | ("slot", tensor) | REST


def varint_bytes(value: int) -> int:
    """Bytes of `value` as a protobuf varint."""
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def record_bytes(message) -> int:
    """Bytes one element of a repeated GraphProto field takes in the file (field numbers below
    16, so a one-byte tag)."""
    size = message.ByteSize()
    return 1 + varint_bytes(size) + size


@dataclass
class Attribution:
    """A model's bytes by owner: planned nodes, activation slots, the rest, and the header."""

    nodes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    slots: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    rest: float = 0.0
    header: int = 0

    def add(self, owners: list[Owner], size: float) -> None:
        """`size` bytes split evenly among `owners` (a weight two nodes share)."""
        share = size / len(owners)
        for kind, name in owners:
            if kind == "node":
                self.nodes[name] += share
            elif kind == "slot":
                self.slots[name] += share
            else:
                self.rest += share

    def total(self) -> float:
        return self.header + self.rest + sum(self.nodes.values()) + sum(self.slots.values())


# Inserted nodes a walk from a dynamic node never enters: static Q/DQ pairs have their own owners
# (the activation slot, the weight's readers).
_PAIR_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


def _links(nodes: list[onnx.NodeProto]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Tensor -> the index of the node that writes it, and -> the indices of those that read it."""
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    readers: dict[str, list[int]] = defaultdict(list)
    for i, node in enumerate(nodes):
        for name in node.input:
            if name:
                readers[name].append(i)
    return producer, readers


def _dynamic_parts(
    nodes: list[onnx.NodeProto],
    producer: Mapping[str, int],
    readers: Mapping[str, list[int]],
    float_nodes: Mapping[str, onnx.NodeProto],
    float_producer: Mapping[str, str],
    planned: set[str],
) -> dict[int, set[str]]:
    """The writer's nodes around each planned MatMulInteger (dynamic int8), by index -> the
    planned nodes they serve. Forward from the MatMulInteger through inserted nodes until a
    tensor of the float model is produced (its output): the dequantization and, per token, the
    zero-point correction. Then backward from all of those through inserted nodes to the float
    input: the input's quantization (DynamicQuantizeLinear, or the per-token row
    quantization), shared by every dynamic node that reads it."""

    def inserted(i: int) -> bool:
        return nodes[i].name not in float_nodes and nodes[i].op_type not in _PAIR_OPS

    parts: dict[int, set[str]] = defaultdict(set)
    for start, node in enumerate(nodes):
        if node.op_type != "MatMulInteger" or node.name not in planned:
            continue
        mine, todo = {start}, [start]
        while todo:  # forward: up to the tensors the float model has
            for out in nodes[todo.pop()].output:
                if out in float_producer:
                    continue
                for r in readers.get(out, []):
                    if inserted(r) and r not in mine:
                        mine.add(r)
                        todo.append(r)
        todo = list(mine)
        while todo:  # backward: to the float input
            for name in nodes[todo.pop()].input:
                i = producer.get(name)
                if i is not None and inserted(i) and i not in mine:
                    mine.add(i)
                    todo.append(i)
        for i in mine - {start}:
            parts[i].add(node.name)
    return parts


def attribute(
    model: onnx.ModelProto,
    size: int,
    float_model: onnx.ModelProto,
    planned: set[str],
    clamps: Mapping[str, str],
    sources: Mapping[str, str],
) -> Attribution:
    """Split `model` (`size` bytes serialized, written from `float_model`) among `planned` nodes,
    activation slots and the rest. `clamps`: Relu / Clip node -> the planned node whose output it
    folds into (in any layout); `sources`: tensor a QuantizeLinear reads -> the slot's tensor (the
    layout's ActivationSlot.source -> tensor), empty for the float model."""
    graph = model.graph
    float_nodes = {node.name: node for node in float_model.graph.node}
    float_producer = {out: node.name for node in float_model.graph.node for out in node.output}
    initializers = {init.name for init in graph.initializer}
    nodes = list(graph.node)
    producer, consumers = _links(nodes)

    def float_owner(name: str) -> Owner:
        if name in planned:
            return ("node", name)
        if name in clamps:
            return ("node", clamps[name])
        return REST

    def weight_prep(node: onnx.NodeProto) -> list[Owner]:
        """The planned nodes an unplanned node of constants only serves (the Transpose of a tied
        table that its lm_head reads: gone where the writer reads the table itself), or []."""
        if any(name and name not in initializers for name in node.input):
            return []
        readers = [nodes[r] for out in node.output for r in consumers.get(out, [])]
        if not readers or any(r.name not in planned for r in readers):
            return []
        return list(dict.fromkeys(("node", r.name) for r in readers))

    owners: dict[int, list[Owner]] = {
        i: [("node", name) for name in sorted(names)]
        for i, names in _dynamic_parts(
            nodes, producer, consumers, float_nodes, float_producer, planned
        ).items()
    }
    for i, node in enumerate(nodes):
        if i in owners:
            continue
        if node.name in float_nodes:
            owners[i] = [float_owner(node.name)]
            if owners[i] == [REST]:  # neither planned nor a folded clamp
                owners[i] = weight_prep(node) or [REST]
        elif node.op_type == "QuantizeLinear" and node.input[0] not in initializers:
            read = node.input[0]
            cast = nodes[producer[read]] if read in producer else None
            if read not in sources and cast is not None and cast.op_type == "Cast":
                read = cast.input[0]  # a graph input the typing pass cast to FP16 first
            if read not in sources:
                raise RuntimeError(
                    f"size model: QuantizeLinear {node.name!r} reads {node.input[0]!r}, which is "
                    "the source of no activation slot of the layout"
                )
            owners[i] = [("slot", sources[read])]

    def owner_of(i: int, seen: frozenset[int] = frozenset()) -> list[Owner]:
        if i in owners:
            return owners[i]
        if i in seen:
            raise RuntimeError(f"size model: a cycle through {nodes[i].name!r}")
        node = nodes[i]
        data = [name for name in node.input if name and name not in initializers]
        if node.op_type == "DequantizeLinear" and data and data[0] in producer:
            source = nodes[producer[data[0]]]
            if source.op_type == "QuantizeLinear":  # the pair's second half
                owners[i] = owner_of(producer[data[0]], seen | {i})
                return owners[i]
        if not data:  # a weight's DequantizeLinear: it belongs to what reads its output
            found: list[Owner] = []
            for out in node.output:
                for reader in consumers.get(out, []):
                    found.extend(o for o in owner_of(reader, seen | {i}) if o not in found)
            if not found:
                raise RuntimeError(f"size model: nothing reads the output of {node.name!r}")
            owners[i] = found
            return found
        if node.op_type in _SHAPE_HELPERS:
            # A shape the writer computes for a Reshape after a planned node (the tied table's
            # GatherBlockQuantized rows back to the Gather's shape, write/tied.py): the
            # Reshape's, found through the nodes that read it
            found = []
            for out in node.output:
                for reader in consumers.get(out, []):
                    found.extend(o for o in owner_of(reader, seen | {i}) if o not in found)
            if found and all(kind == "node" for kind, _ in found):
                owners[i] = found
                return found
        if node.op_type == "Cast":
            # The typing pass's Cast at a float-type boundary (beside a node kept FP32, or
            # pinned FP32 next to FP16 ones): it serves the planned nodes on either side of it,
            # readers first; between unplanned nodes it is the rest's.
            found = []
            for out in node.output:
                for reader in consumers.get(out, []):
                    found.extend(
                        o for o in owner_of(reader, seen | {i}) if o[0] == "node" and o not in found
                    )
            if not found and data[0] in producer:
                found = [o for o in owner_of(producer[data[0]], seen | {i}) if o[0] == "node"]
            owners[i] = found or [REST]
            return owners[i]
        # Inserted after a node (the Add of a split Gemm bias): its first data input's producer.
        if data[0] in producer:
            upstream = owner_of(producer[data[0]], seen | {i})
            if all(kind == "node" for kind, _ in upstream):
                owners[i] = upstream
                return upstream
        raise RuntimeError(
            f"size model: cannot tell which planned node the writer's {node.op_type} "
            f"{node.name!r} belongs to"
        )

    parts = Attribution()
    for i, node in enumerate(nodes):
        owner = owner_of(i)
        size_here = record_bytes(node)
        original = float_nodes.get(node.name)
        if owner == [REST] and original is not None:
            # An unplanned node that reads a slot's `..._dequantized` tensor grows by the name.
            before = record_bytes(original)
            slots = []
            for name in node.input:
                if name in producer and name not in float_producer:
                    slots.extend(o for o in owner_of(producer[name]) if o[0] == "slot")
            if slots and size_here != before:
                parts.add(slots, size_here - before)
                size_here = before
        parts.add(owner, size_here)
    readers: dict[str, list[Owner]] = defaultdict(list)
    for i, node in enumerate(nodes):
        for name in node.input:
            if name in initializers:
                readers[name].extend(o for o in owner_of(i) if o not in readers[name])
    for init in graph.initializer:
        parts.add(readers.get(init.name) or [REST], record_bytes(init))
    for info in graph.value_info:
        if info.name in float_producer:
            owner = [float_owner(float_producer[info.name])]
        elif info.name in producer:
            owner = owner_of(producer[info.name])
        else:
            owner = [REST]
        parts.add(owner, record_bytes(info))
    for info in list(graph.input) + list(graph.output) + list(graph.sparse_initializer):
        parts.add([REST], record_bytes(info))
    parts.header = size - int(round(parts.total()))
    return parts
