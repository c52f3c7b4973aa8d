"""plan.yaml: a plan's per-node precisions as recipe `overrides:`, to pin it or to edit it.

One entry per node the plan decides, by exact name, in graph order: the precision, and the
weight settings and activations wherever they differ from what `{nodes, precision}` alone would
resolve to (in this recipe or with qtool's defaults). The list stands for the recipe's own
overrides (it already includes their effect), so it replaces them: the file is a preset, usable
as the `base:` of a recipe without `overrides:` of its own, or pasted in place of them. Loading
such a recipe resolves every node to the same settings, hence the same Plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import yaml

from qtool.plan.node_settings import NodeSettings, resolve_node_settings
from qtool.plan.plan import Plan
from qtool.plan.settings import QuantizationSpec, WeightSettings, exact_pattern

_FIELDS = ("bits", "granularity", "block_size", "method", "symmetric")
_BITS = {"int4": 4, "int8": 8, "fp8": 8}
# Why a float node is pinned: a decision of the recipe, not a limit of the graph or op type.
_PINNED_FLOAT = ("excluded", "override")


def _default_activations(precision: str) -> str:
    if precision == "fp8":
        return "fp8"  # fp8 nodes have fp8 activations, always
    return "float" if precision == "int4" else "int8"


def _entry(name: str, settings: NodeSettings, spec: QuantizationSpec) -> dict:
    entry: dict = {"nodes": exact_pattern(name), "precision": settings.precision}
    if settings.precision in ("float", "fp16", "bf16"):
        return entry
    bits = WeightSettings(bits=_BITS[settings.precision])
    references = (spec.weights.layered(bits).resolved(), bits.resolved())
    weights = {}
    for key in _FIELDS:
        value = getattr(settings.weights, key)
        if key == "bits" or value is None:
            continue  # bits come with the precision; None (no blocks) follows the granularity
        if any(getattr(ref, key) != value for ref in references):
            weights[key] = value
    if weights:
        entry["weights"] = weights
    default = _default_activations(settings.precision)
    if settings.activations != default or (spec.activations or default) != settings.activations:
        entry["activations"] = settings.activations
    return entry


def plan_overrides(model: onnx.ModelProto, spec: QuantizationSpec, plan: Plan) -> list[dict]:
    """The overrides entries that pin `plan` (planned from `spec` on the prepared `model`)."""
    settings = resolve_node_settings(model, spec)
    entries = []
    for node in plan:
        if node.quantized:
            entries.append(_entry(node.name, settings[node.name], spec))
        elif node.source in _PINNED_FLOAT:  # float (FP32), or fp16/bf16 asked of the node
            entries.append({"nodes": exact_pattern(node.name), "precision": node.precision})
    return entries


def plan_yaml(
    model: onnx.ModelProto,
    spec: QuantizationSpec,
    plan: Plan,
    comments: Sequence[str] = (),
) -> str:
    """plan.yaml's text: `comments` as a header, then `quantization: {overrides: [...]}`."""
    entries = plan_overrides(model, spec, plan)
    counts = plan.counts()
    summary = ", ".join(f"{counts[p]} {p}" for p in ("int4", "fp8", "int8") if counts.get(p))
    typed = ", ".join(f"{counts[p]} {p}" for p in ("bf16", "fp16") if counts.get(p))
    pinned = sum(e["precision"] == "float" for e in entries)
    header = [
        *comments,
        f"{summary or 'no node'} quantized, {pinned} kept float by the recipe"
        + (f", typed {typed}." if typed else "."),
        "This list stands for the recipe's own overrides (it includes their effect): use this",
        "file as the `base:` of a recipe without `overrides:`, or paste the list in their place.",
    ]
    body = yaml.safe_dump(
        {"quantization": {"overrides": entries}},
        sort_keys=False,
        default_flow_style=None,
        width=1000,
    )
    return "".join(f"# {line}\n" for line in header) + body
