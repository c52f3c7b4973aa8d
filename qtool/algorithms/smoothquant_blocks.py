"""Where SmoothQuant measures a smoothing factor's effect: the output of the transformer block the
smoothed MatMuls belong to, after its residual Add.

A layer's own output error is the wrong yardstick for alpha. It cannot see what the block does
with that error (Q and K errors pass through a softmax, the MLP's through a GELU), and it weighs
the Q, K and V outputs alike. The block's output after the residual is what the next block
reads, so that is where two alphas are compared (docs/algorithms.md, "SmoothQuant").

The block of a smoothing group is found from the graph alone: the residual Add is the first Add
downstream of the group's MatMuls (in graph order) whose one input comes from them and whose
other input does not but is the group's input X or something X is computed from (the skip path
of the residual stream), both inputs of one shape (a broadcast Add is an attention mask or a
position bias, never the residual; where shape inference leaves dims symbolic, the shapes of one
run of the float model on a tuning batch decide). That covers post-LN blocks (BERT: LayerNorm ->
Q/K/V -> attention -> output dense -> Add(., X)) and pre-LN blocks (Llama, Swin:
Add(h, attn(norm(h)))).
A group with no such Add (a patch-merging Linear, a classifier head) is scored on its own output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

__all__ = ["Block", "find_block"]


@dataclass(frozen=True)
class Block:
    """One smoothing group's block: the tensor it is judged at and the nodes from the group's
    MatMuls to it, in graph order (the MatMuls included)."""

    output: str
    nodes: tuple[str, ...]


class _Graph:
    """Producer/reader lookups and tensor shapes of one model, built once per SmoothQuant run."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.nodes = list(graph.node)
        self.order = {node.name: i for i, node in enumerate(self.nodes)}
        self.producer = {out: node for node in self.nodes for out in node.output if out}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for name in node.input:
                if name:
                    self.readers.setdefault(name, []).append(node)
        self.constants = {init.name for init in graph.initializer}
        self.constants |= {n.output[0] for n in self.nodes if n.op_type == "Constant"}
        self.shapes = {
            vi.name: vi.type.tensor_type.shape
            for vi in [*graph.value_info, *graph.input, *graph.output]
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
        }

    def ancestors(self, tensor: str) -> set[str]:
        """`tensor` and every tensor it is computed from."""
        seen, stack = set(), [tensor]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            node = self.producer.get(name)
            if node is not None:
                stack.extend(n for n in node.input if n)
        return seen

    def downstream(self, nodes: list[onnx.NodeProto]) -> tuple[list[onnx.NodeProto], set[str]]:
        """Every node computed from `nodes` (themselves included), in graph order, and the
        tensors they produce."""
        tensors = {out for node in nodes for out in node.output if out}
        reached = {node.name for node in nodes}
        for node in self.nodes[min(self.order[n.name] for n in nodes) :]:
            if node.name in reached or any(name in tensors for name in node.input):
                reached.add(node.name)
                tensors.update(out for out in node.output if out)
        return [node for node in self.nodes if node.name in reached], tensors

    def same_shape(self, a: str, b: str) -> bool:
        """Same rank and no two known dims that differ (a symbolic dim matches any: shape
        inference names equal batch dims differently on two paths); unknown shapes: True."""
        first, second = self.shapes.get(a), self.shapes.get(b)
        if first is None or second is None:
            return True
        if len(first.dim) != len(second.dim):
            return False
        return all(
            x.dim_value == y.dim_value
            for x, y in zip(first.dim, second.dim, strict=True)
            if x.HasField("dim_value") and y.HasField("dim_value")
        )


# Candidate Adds looked at per group, in graph order, before it is scored on its own outputs.
CANDIDATES = 8

ShapeOracle = Callable[[list[str]], dict[str, tuple[int, ...]]]


def _candidates(
    graph: _Graph, group_input: str, downstream: list[onnx.NodeProto], reached: set[str]
) -> list[onnx.NodeProto]:
    """The first CANDIDATES Adds that may be the group's residual Add, by the graph alone."""
    skip_path = graph.ancestors(group_input)
    found = []
    for node in downstream:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        a, b = node.input
        if a in graph.constants or b in graph.constants:
            continue  # a bias
        for ours, other in ((a, b), (b, a)):
            if ours in reached and other not in reached and other in skip_path:
                if graph.same_shape(ours, other) and graph.same_shape(ours, node.output[0]):
                    found.append(node)
                    break
        if len(found) == CANDIDATES:
            break
    return found


def find_block(model: onnx.ModelProto, group_input: str, members: list[str]) -> Block | None:
    """The block of the group reading `group_input` with MatMuls `members`, or None when no
    residual Add follows them (module docstring)."""
    return find_blocks(model, {group_input: members}).get(group_input)


def find_blocks(
    model: onnx.ModelProto, groups: dict[str, list[str]], shapes: ShapeOracle | None = None
) -> dict[str, Block]:
    """`find_block` for every group (input -> member node names), sharing one graph index.

    `shapes`: the tensors' shapes on real inputs (one run of the float model), for the Adds
    whose inputs shape inference left symbolic: an attention mask [batch, 1, q, k] added to
    scores [batch, heads, q, k] then shows as the broadcast it is. Without it, the first Add
    the graph allows is taken."""
    graph = _Graph(model)
    by_name = {node.name: node for node in graph.nodes}
    found: dict[str, tuple[list[onnx.NodeProto], list[onnx.NodeProto]]] = {}
    for group_input, members in groups.items():
        downstream, reached = graph.downstream([by_name[m] for m in members])
        found[group_input] = (downstream, _candidates(graph, group_input, downstream, reached))
    measured: dict[str, tuple[int, ...]] = {}
    if shapes is not None:
        tensors = {t for _, adds in found.values() for add in adds for t in [*add.input]}
        measured = shapes(sorted(tensors)) if tensors else {}
    blocks = {}
    for group_input, (downstream, adds) in found.items():
        add = next((a for a in adds if _unbroadcast(a, measured)), None)
        if add is None:
            continue
        upstream = graph.ancestors(add.output[0])
        members = set(groups[group_input])
        inside = [
            node.name
            for node in downstream
            if node.name in members or any(out in upstream for out in node.output)
        ]
        blocks[group_input] = Block(add.output[0], tuple(inside))
    return blocks


def _unbroadcast(add: onnx.NodeProto, measured: dict[str, tuple[int, ...]]) -> bool:
    """Both inputs of the same shape on real inputs (True where they were not measured)."""
    a, b = add.input
    if a not in measured or b not in measured:
        return True
    return measured[a] == measured[b]
