"""The size model: what a plan's file will weigh, before it is built.

The search builds the all-int8 and the all-int4 models anyway (the references it compares with).
costs.py splits each of them, and the float model, into what each planned node owns, what each
activation QDQ pair owns, and the rest. A node's price at a precision is then

- its own records in the uniform model of that precision (node, weights, scales, zero points,
  weight DequantizeLinear, folded Relu gone), and
- its share of every activation QDQ pair it asks for at that precision: a pair two nodes ask for
  (a Conv's output that the next Conv reads) is written once, so each pays half;

and a plan's file is the fixed part (the float graph outside the planned nodes, the quantized
file's header, qtool's provenance stamp) plus each node's price at its precision. The pairs a
node asks for come from the layout itself: that node alone at that precision, the rest float.

Exact for the uniform models up to the shared pairs of nodes that do not all take activation
quantization there (an int4 weight-only MatMul beside an int8 Conv) and the header's com.microsoft
opset entry (tens of bytes); a mixed plan whose shared pair has only one of its nodes quantized
is off by half a pair. report.json gives the predicted and the measured size of every plan and
reference, so the difference is visible.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import onnx

from qtool.plan.layout import Layout
from qtool.search.costs import Attribution, attribute


@dataclass
class Uniform:
    """A uniform reference model: `precision` wherever the layout gives it, its bytes, the
    layout it was written from, the plan as the layout resolved it (node -> precision), and its
    bytes split by owner (costs.attribute)."""

    precision: str
    serialized: bytes
    layout: Layout
    plan: dict[str, str]
    parts: Attribution


@dataclass(frozen=True)
class SizeModel:
    """`fixed` bytes plus, per node, its price at its precision (bytes, fractional where a pair
    or a weight is shared)."""

    fixed: int
    prices: dict[str, dict[str, float]]
    notes: list[str] = field(default_factory=list)
    # Nodes the search leaves to the recipe, at the precision it gives them in every plan
    recipe_made: dict[str, str] = field(default_factory=dict)

    def predict(self, plan: Mapping[str, str]) -> int | None:
        """The file size of `plan` as written (provenance stamp included); None when a node's
        precision in it was not priced (no uniform model holds it)."""
        if any(p not in self.prices[n] for n, p in plan.items()):
            return None
        return int(round(self.fixed + sum(self.prices[n][p] for n, p in plan.items())))

    def all_float(self) -> float:
        """The prediction with every planned node float but those left to the recipe (at its
        precision, as in every plan), unrounded: the base from which promote.predicted_size adds
        each node's price difference."""
        return self.fixed + sum(
            prices[self.recipe_made.get(name, "float")] for name, prices in self.prices.items()
        )


def wanted_slots(
    layout_of: Callable[[Mapping[str, str]], Layout],
    names: Sequence[str],
    uniforms: Mapping[str, Uniform],
) -> dict[tuple[str, str], frozenset[str]]:
    """(node, precision) -> the activation tensors the layout quantizes for that node alone at
    that precision (the rest float); empty for a node whose activations stay float there."""
    wanted: dict[tuple[str, str], frozenset[str]] = {}
    for precision, uniform in uniforms.items():
        for name in names:
            if uniform.plan[name] != precision:
                continue
            if uniform.layout.plan[name].activations != "int8":
                wanted[(name, precision)] = frozenset()
                continue
            alone = {other: "float" for other in names}
            alone[name] = precision
            wanted[(name, precision)] = frozenset(layout_of(alone).activations)
    return wanted


def clamp_owners(float_model: onnx.ModelProto, layouts: Sequence[Layout]) -> dict[str, str]:
    """Relu / Clip folded in any of `layouts` -> the planned node whose output it follows: the
    clamp's bytes are that node's in every model (it is gone where that node folds it)."""
    producer = {out: node.name for node in float_model.graph.node for out in node.output}
    nodes = {node.name: node for node in float_model.graph.node}
    owners = {}
    for layout in layouts:
        for clamp in layout.folded_clamps:
            owners[clamp] = producer[nodes[clamp].input[0]]
    return owners


def uniform(
    precision: str,
    model: onnx.ModelProto,
    layout: Layout,
    float_model: onnx.ModelProto,
    names: Sequence[str],
    clamps: Mapping[str, str],
) -> Uniform:
    """`model` (written from `layout`) serialized, with its bytes split by owner."""
    serialized = model.SerializeToString()
    parts = attribute(model, len(serialized), float_model, set(names), clamps, _sources(layout))
    plan = {name: layout.plan[name].precision for name in names}
    return Uniform(precision, serialized, layout, plan, parts)


def _sources(layout: Layout) -> dict[str, str]:
    sources: dict[str, str] = {}
    for tensor, slot in layout.activations.items():
        if sources.setdefault(slot.source, tensor) != tensor:
            raise RuntimeError(
                f"size model: tensors {sources[slot.source]!r} and {tensor!r} are quantized "
                f"from the same source {slot.source!r}"
            )
    return sources


def size_model(
    float_model: onnx.ModelProto,
    float_bytes: int,
    names: Sequence[str],
    uniforms: Mapping[str, Uniform],
    wanted: Mapping[tuple[str, str], frozenset[str]],
    clamps: Mapping[str, str],
    stamp_bytes: int,
    recipe_made: Mapping[str, str] | None = None,
) -> SizeModel:
    """Prices for every planned node (`names`) at float and at each precision a uniform model
    gives it, and the fixed part. `float_bytes`: the float model serialized; `clamps`:
    clamp_owners of the uniform layouts; `stamp_bytes`: qtool's provenance metadata;
    `recipe_made`: nodes the search leaves to the recipe (readers of a tied weight) and the
    precision it gives them, priced from the first uniform model that holds them so."""
    recipe_made = recipe_made or {}
    floats = attribute(float_model, float_bytes, float_model, set(names), clamps, {})
    prices: dict[str, dict[str, float]] = {n: {"float": floats.nodes.get(n, 0.0)} for n in names}
    sharers: dict[str, set[str]] = defaultdict(set)
    for (name, _), tensors in wanted.items():
        for tensor in tensors:
            sharers[tensor].add(name)
    notes: list[str] = []
    for precision, model in uniforms.items():
        split = model.parts
        for name in names:
            held = model.plan[name]
            left = name in recipe_made and held == recipe_made[name] and held not in prices[name]
            if held != precision and not left:
                continue
            # a node left to the recipe has no slots of its own to price (wanted_slots varies
            # the search's nodes only)
            slots = wanted.get((name, held), frozenset()) if left else wanted[(name, held)]
            pairs = sum(split.slots.get(t, 0.0) / len(sharers[t]) for t in slots)
            prices[name][held] = split.nodes.get(name, 0.0) + pairs
        orphans = sum(size for tensor, size in split.slots.items() if not sharers[tensor])
        if orphans:
            notes.append(
                f"size model: {orphans:.0f} bytes of QDQ pairs in the all-{precision} model "
                "belong to no single node's layout and are not priced"
            )
    # The header (producer, opsets, graph length prefix) of a file the writer wrote.
    written = next((uniforms[p].parts for p in ("int8", "int4") if p in uniforms), floats)
    made = {name: p for name, p in recipe_made.items() if p in prices[name]}
    return SizeModel(int(round(written.header + floats.rest)) + stamp_bytes, prices, notes, made)
