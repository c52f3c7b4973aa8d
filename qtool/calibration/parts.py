"""A large model split into consecutive parts, each small enough to calibrate on its own.

Calibrating in one ONNX Runtime session holds every weight of the model for the whole pass, and
with them every observed tensor's statistics (a decoder's GPTQ Hessians: as many bytes as its
4-bit weights). Split into parts of at most `max_bytes` of weights each, the pass runs part by
part over all batches: one session at a time, the tensors a later part reads kept on disk in
between, each part's finished Hessians handed off before the next part loads.

A part is the model's nodes in graph order (ONNX requires a topological order, so every tensor a
part reads is a graph input, a weight, or an earlier part's output) restricted to what the
observed tensors depend on: the logits of an LLM's lm_head, and the key/value cache outputs,
are not computed at all. Its weights are references into the same staged data file as the
whole model's.

A model is not split (None) when one part would hold it anyway, when a node carries a subgraph
(If, Loop, Scan read outer-scope tensors no part boundary lists), or when a tensor crossing a
boundary has no inferred tensor type: those calibrate in one session, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx
from onnx import AttributeProto

from qtool.model.external_data import copy_fields, raw_nbytes, tensor_nbytes

__all__ = ["Part", "split_model"]

_SUBGRAPHS = (AttributeProto.GRAPH, AttributeProto.GRAPHS)


@dataclass(frozen=True)
class Part:
    """One part: its model, the tensors it is fed (graph inputs and earlier parts' outputs),
    the observed tensors it produces, and the tensors it produces that later parts read."""

    model: onnx.ModelProto
    feeds: tuple[str, ...]
    observed: tuple[str, ...]
    passes_on: tuple[str, ...]


def _weight_bytes(tensor: onnx.TensorProto) -> int:
    """Its data's size, whether held or referenced in a data file."""
    external = tensor.data_location == onnx.TensorProto.EXTERNAL
    return raw_nbytes(tensor) if external else tensor_nbytes(tensor)


def _needed(nodes: Sequence[onnx.NodeProto], wanted: set[str]) -> list[int]:
    """Indices of the nodes the `wanted` tensors depend on, in graph order."""
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    keep: set[int] = set()
    stack = [producer[name] for name in wanted if name in producer]
    while stack:
        i = stack.pop()
        if i in keep:
            continue
        keep.add(i)
        stack.extend(producer[name] for name in nodes[i].input if name in producer)
    return sorted(keep)


def _groups(
    nodes: Sequence[onnx.NodeProto], order: list[int], sizes: dict[str, int], max_bytes: int
) -> list[list[int]]:
    """Consecutive runs of `order`, each reading at most `max_bytes` of weights (a node whose
    own weights exceed it is a part of its own)."""
    groups: list[list[int]] = [[]]
    held: set[str] = set()
    total = 0
    for i in order:
        new = {name for name in nodes[i].input if name in sizes and name not in held}
        extra = sum(sizes[name] for name in new)
        if total and total + extra > max_bytes:  # a part without weights takes the next
            groups.append([])
            held, total = set(), 0
            new = {name for name in nodes[i].input if name in sizes}
            extra = sum(sizes[name] for name in new)
        groups[-1].append(i)
        held |= new
        total += extra
    return groups


def split_model(
    model: onnx.ModelProto, observed: Sequence[str], max_bytes: int
) -> list[Part] | None:
    """`model` as parts of at most `max_bytes` of weights that together produce `observed` (but
    the graph inputs among them, which the caller takes from the batches), or None when it is
    not split (see the module's docstring)."""
    graph = model.graph
    nodes = list(graph.node)
    if any(a.type in _SUBGRAPHS for node in nodes for a in node.attribute):
        return None
    if len(graph.sparse_initializer):
        return None
    initializers = {t.name: t for t in graph.initializer}
    sizes = {name: _weight_bytes(t) for name, t in initializers.items()}
    if sum(sizes.values()) <= max_bytes:
        return None
    produced = {out for node in nodes for out in node.output if out}
    graph_inputs = {i.name for i in graph.input} - set(initializers)
    # an observed graph input is read from the batch itself (it reaches ORT unchanged)
    wanted = set(observed) - graph_inputs
    if not wanted <= produced:  # a weight observed, or no such tensor: the one-session path
        return None
    groups = _groups(nodes, _needed(nodes, wanted), sizes, max_bytes)
    if len(groups) < 2:
        return None
    typed = {vi.name: vi for vi in [*graph.input, *graph.value_info, *graph.output]}
    last_reader: dict[str, int] = {}
    for number, group in enumerate(groups):
        for i in group:
            for name in nodes[i].input:
                if name:
                    last_reader[name] = number
    parts = []
    for number, group in enumerate(groups):
        made = {out for i in group for out in nodes[i].output if out}
        read = list(dict.fromkeys(n for i in group for n in nodes[i].input if n))
        feeds = tuple(n for n in read if n not in made and n not in initializers)
        passes_on = tuple(n for n in sorted(made) if last_reader.get(n, -1) > number)
        mine = tuple(n for n in observed if n in made)
        outputs = list(dict.fromkeys([*mine, *passes_on]))
        if any(
            name not in typed or not typed[name].type.HasField("tensor_type")
            for name in [*feeds, *outputs]
        ):
            return None
        part = onnx.ModelProto()
        copy_fields(model, part, frozenset({"graph"}))
        part.graph.name = f"{graph.name}_part{number}"
        part.graph.node.extend(nodes[i] for i in group)
        part.graph.initializer.extend(initializers[n] for n in read if n in initializers)
        part.graph.input.extend(typed[n] for n in feeds)
        part.graph.output.extend(typed[n] for n in outputs)
        part.graph.value_info.extend(
            vi for vi in graph.value_info if vi.name in made and vi.name not in outputs
        )
        parts.append(Part(part, feeds, mine, passes_on))
    return parts
