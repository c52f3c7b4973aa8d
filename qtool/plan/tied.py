"""Tied weights: one initializer read by several nodes is stored once, so its readers must agree.

A decoder LLM with tied embeddings reads one table W [V, D] in its embedding Gather and, through a
Transpose, in its lm_head MatMul (qtool/model/tie_weights.py keeps it one tensor). Stored once,
W can have one precision only. Which one, decided here without names (no node is special):

- a reader made float on purpose (`exclude`, or an override to float) keeps W float for all;
- else the quantized reader that asks for the most bits decides (int8 over int4; the first in
  graph order on a tie), and the other quantized readers follow its settings;
- a reader left float by `op_types` reads the stored values (the file holds W once).

So `overrides: [{op_types: Gather, precision: int8}]` with 4-bit MatMuls stores the tied table
int8, read by the embedding (GatherBlockQuantized) and the lm_head (8-bit MatMulNBits) alike.
A follower's NodeSettings say why (source "tied"), and report.json shows it per node.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import onnx

from qtool.plan.graph import GraphIndex
from qtool.plan.node_settings import NodeSettings
from qtool.plan.ops import find_rule

_BITS_RANK = {"int4": 4, "int8": 8}
_ON_PURPOSE = ("excluded", "override")


@dataclass(frozen=True)
class TiedWeights:
    """Per node the settings it is planned with (followers changed), the order to plan them in
    (each leader before its followers, otherwise graph order), and per tied weight its leader."""

    settings: dict[str, NodeSettings]
    order: list[onnx.NodeProto]
    leaders: dict[str, str]  # weight -> the node whose settings decide it


def _weight_readers(graph: GraphIndex) -> dict[str, list[onnx.NodeProto]]:
    """Constant float weight -> the nodes of a weighted op rule that read it (directly, or
    through a Transpose), in graph order."""
    constants = {n for n in graph.initializers if graph.is_float_constant(n)}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.nodes:
        rule = find_rule(node.op_type)
        if rule is None or rule.weights is None:
            continue
        weight = graph.weight_of(node, constants)
        if weight is not None:
            readers.setdefault(weight, []).append(node)
    return readers


def _leader(readers: list[onnx.NodeProto], settings: dict[str, NodeSettings]):
    """(leader node or None, "float" when a reader keeps the table float on purpose)."""
    chosen = [settings[n.name] for n in readers]
    if any(c.precision == "float" and c.source in _ON_PURPOSE for c in chosen):
        return next(n for n, c in zip(readers, chosen, strict=True) if c.precision == "float"), (
            "float"
        )
    quantized = [(n, c) for n, c in zip(readers, chosen, strict=True) if c.precision != "float"]
    if not quantized:
        return None, None
    best = max(_BITS_RANK[c.precision] for _, c in quantized)
    return next(n for n, c in quantized if _BITS_RANK[c.precision] == best), None


def _follow(
    own: NodeSettings, lead: NodeSettings, lead_weight_only: bool, weight: str, leader: str
) -> NodeSettings:
    """A reader's settings when the weight it reads is decided by node `leader` (`lead`)."""
    note = f"tied weight '{weight}' is stored once, as node '{leader}' plans it"
    if lead.precision == "float":
        return NodeSettings("float", own.weights, own.activations, "tied", f"{note} (float)")
    if own.precision == "float":  # left float by op_types: it reads the stored values
        return dataclasses.replace(own, reason=f"{own.reason}; reads the {note}")
    # A weight stored for a weight-only reader (blocks, an embedding table) has no int8-kernel
    # form: the follower multiplies it in float too.
    activations = "float" if lead_weight_only else own.activations
    return NodeSettings(
        lead.precision,
        lead.weights,
        activations,
        "tied",
        f"{note} ({lead.precision}; this node's own settings asked for {own.precision})",
    )


def tie_weights(graph: GraphIndex, settings: dict[str, NodeSettings]) -> TiedWeights:
    """The settings and planning order that make every tied weight's readers agree."""
    readers = _weight_readers(graph)
    adjusted = dict(settings)
    leaders: dict[str, str] = {}
    followers: dict[str, str] = {}  # follower node -> its leader node
    for weight, nodes in readers.items():
        if len(nodes) < 2:
            continue
        leader, verdict = _leader(nodes, settings)
        if leader is None:
            continue
        leaders[weight] = leader.name
        lead = settings[leader.name]
        if verdict == "float":
            lead = NodeSettings("float", lead.weights, lead.activations, lead.source, lead.reason)
        rule = find_rule(leader.op_type)
        weight_only = lead.activations == "float" or rule is None or not rule.activation_inputs
        for node in nodes:
            if node.name == leader.name:
                continue
            own = settings[node.name]
            adjusted[node.name] = _follow(own, lead, weight_only, weight, leader.name)
            followers[node.name] = leader.name
    order = _leaders_first(graph.nodes, followers)
    return TiedWeights(adjusted, order, leaders)


def _leaders_first(nodes: list[onnx.NodeProto], followers: dict[str, str]) -> list[onnx.NodeProto]:
    """Graph order, except that a follower waits until its leader is placed (the leader's
    weight slot and plan are the ones stored)."""
    order: list[onnx.NodeProto] = []
    placed: set[str] = set()
    waiting: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        leader = followers.get(node.name)
        if leader is not None and leader not in placed:
            waiting.setdefault(leader, []).append(node)
            continue
        order.append(node)
        placed.add(node.name)
        for follower in waiting.pop(node.name, []):
            order.append(follower)
            placed.add(follower.name)
    for rest in waiting.values():  # a leader never placed (cannot happen: it is a graph node)
        order.extend(rest)
    return order
