"""Resolve the recipe's defaults, `exclude` and `overrides` into one setting per graph node.

The recipe says things about groups of nodes (op types, name globs); the Plan needs one answer
per node. This module is the only place that turns the first into the second, so the layout,
the mixed-precision search (which writes overrides) and the report agree on what a pattern
meant. A pattern that matches nothing is an error, never a silent no-op: users mix up PyTorch
module names (`encoder.layer.0.attention`) and the ONNX node names the exporter writes
(`/encoder/layer.0/attention/...`), and the error suggests the closest real names.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import onnx

from qtool.errors import RecipeError
from qtool.plan.attention import float_tensors_of, node_roles
from qtool.plan.plan import FLOAT_TYPES as FLOAT_PRECISIONS
from qtool.plan.settings import Override, QuantizationSpec, WeightSettings


@dataclass(frozen=True)
class NodeSettings:
    """What the recipe asks for one node, before the layout checks what the graph allows.

    `precision` is "int4" / "int8" (the weight bits, or int8 for ops without weights), "fp8",
    or a float precision ("fp16", "bf16", "float" = FP32); `activations` "int8", "fp8", "float"
    (weight-only) or the float precision itself; `weights` is fully resolved.
    """

    precision: str
    weights: WeightSettings
    activations: str
    source: str  # "default", "excluded", "override", "not-listed" (plan/tied.py: "tied")
    reason: str


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def _normalized(name: str) -> str:
    """ONNX node name in PyTorch module-path spelling: '/encoder/layer.0/fc/MatMul' ->
    'encoder.layer.0.fc.MatMul'."""
    return name.replace("/", ".").strip(".")


def closest_names(pattern: str, names: Sequence[str], limit: int = 3) -> list[str]:
    """Node names a user who wrote `pattern` most likely meant, best first."""
    stem = pattern.rstrip("*").rstrip(".").rstrip("/")
    if stem and not any(c in stem for c in "*?["):
        dotted = _normalized(stem)
        under = [n for n in names if _normalized(n).startswith(dotted + ".")]
        if under:
            return under[:limit]
    by_spelling = difflib.get_close_matches(pattern, list(names), n=limit, cutoff=0.4)
    if by_spelling:
        return by_spelling
    normalized = {_normalized(n): n for n in names}
    close = difflib.get_close_matches(_normalized(pattern), list(normalized), n=limit, cutoff=0.4)
    return [normalized[c] for c in close]


def _no_match_error(
    recipe_path: str, where: str, pattern: str, names: Sequence[str]
) -> RecipeError:
    suggestions = closest_names(pattern, names)
    hint = (
        "; closest node names: " + ", ".join(repr(s) for s in suggestions)
        if suggestions
        else "; no node name is close (see the node names in report.json)"
    )
    if "." in pattern and "/" not in pattern:
        hint += " (ONNX node names use '/', e.g. '/encoder/layer.0/*', not PyTorch's dots)"
    return RecipeError(f"{recipe_path}: {where}: pattern {pattern!r} matches no node{hint}")


def _check_patterns(
    recipe_path: str,
    spec: QuantizationSpec,
    nodes: Sequence[onnx.NodeProto],
    roles: dict[str, set[str]],
    weighted: set[str],
) -> None:
    names = [node.name for node in nodes]
    op_types = {node.op_type for node in nodes}
    for index, pattern in enumerate(spec.exclude):
        if not any(_matches(name, pattern) for name in names):
            raise _no_match_error(recipe_path, f"quantization.exclude[{index}]", pattern, names)
    for override in spec.overrides:
        for index, pattern in enumerate(override.nodes):
            if not any(_matches(name, pattern) for name in names):
                raise _no_match_error(
                    recipe_path, f"{override.where}.nodes[{index}]", pattern, names
                )
        for index, op_type in enumerate(override.op_types):
            if op_type not in op_types:
                raise RecipeError(
                    f"{recipe_path}: {override.where}.op_types[{index}]: the model has no "
                    f"{op_type} node (it has {', '.join(sorted(op_types))})"
                )
        found = set().union(*roles.values()) if roles else set()
        for index, role in enumerate(override.roles):
            if role not in found:
                raise RecipeError(
                    f"{recipe_path}: {override.where}.roles[{index}]: no node of the model "
                    f"plays {role!r} (found: {', '.join(sorted(found)) or 'no attention block'})"
                )
        if not any(_selects(override, node, roles, weighted) for node in nodes):
            raise RecipeError(
                f"{recipe_path}: {override.where}: no node matches all of its nodes, op_types, "
                "roles and constant_weight"
            )


def weighted_nodes(model: onnx.ModelProto) -> set[str]:
    """Names of the nodes that read a constant float weight: an initializer, or a Transpose of
    one (a tied lm_head), what an override's `constant_weight` selects on."""
    floats = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    views = {
        n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in floats
    }
    return {
        node.name
        for node in model.graph.node
        if node.op_type != "Transpose" and any(i in floats or i in views for i in node.input)
    }


def _selects(
    override: Override, node: onnx.NodeProto, roles: dict[str, set[str]], weighted: set[str]
) -> bool:
    if override.op_types and node.op_type not in override.op_types:
        return False
    if override.roles and not roles.get(node.name, set()) & set(override.roles):
        return False
    if override.constant_weight is not None and (node.name in weighted) != override.constant_weight:
        return False
    return not override.nodes or any(_matches(node.name, p) for p in override.nodes)


def _describe(override: Override) -> str:
    parts = [f"roles {', '.join(override.roles)}"] if override.roles else []
    if override.precision is not None:
        parts.append(f"precision {override.precision}")
    fields = [
        f"{key} {getattr(override.weights, key)}"
        for key in ("bits", "granularity", "block_size", "method", "symmetric")
        if getattr(override.weights, key) is not None
    ]
    if fields:
        parts.append("weights " + ", ".join(fields))
    if override.activations is not None:
        parts.append(f"activations {override.activations}")
    return f"{override.where} ({'; '.join(parts) or 'no change'})"


def resolve_node_settings(
    model: onnx.ModelProto,
    spec: QuantizationSpec,
    recipe_path: str = "recipe",
    float_tensors: set[str] | None = None,
    unquantized_inputs: Collection[str] = (),
) -> dict[str, NodeSettings]:
    """Node name -> its settings: defaults, then `exclude`, then every override in order.

    A node that is not quantized gets the float type's precision (`quantization.float_type`:
    float for FP32, fp16, bf16) unless an override names its float precision itself.
    `float_tensors`: the model's float tensors, for overrides that select attention roles
    (None: read from the model's declared types). `unquantized_inputs`: op types whose inputs
    never get Q/DQ (the registry's `activation_inputs=False`, an embedding Gather): their 8-bit
    blocks are weight-only whatever `activations` says."""
    nodes = list(model.graph.node)
    roles: dict[str, set[str]] = {}
    if any(o.roles for o in spec.overrides):
        floats = float_tensors if float_tensors is not None else float_tensors_of(model)
        roles = node_roles(model, floats)
    weighted = (
        weighted_nodes(model)
        if any(o.constant_weight is not None for o in spec.overrides)
        else set()
    )
    _check_patterns(recipe_path, spec, nodes, roles, weighted)
    listed = set(spec.op_types)
    settings: dict[str, NodeSettings] = {}
    for node in nodes:
        weights = spec.weights
        activations = spec.activations
        quantized = node.op_type in listed
        fp8 = spec.precision == "fp8"
        float_precision = spec.float_precision
        source = "default" if quantized else "not-listed"
        reason = (
            f"{node.op_type} is in quantization.op_types"
            if quantized
            else "op type not listed in quantization.op_types"
        )
        excluded_by = next((p for p in spec.exclude if _matches(node.name, p)), None)
        if excluded_by is not None:
            quantized, source = False, "excluded"
            reason = f"excluded by quantization.exclude pattern '{excluded_by}'"
        applied = []
        for override in spec.overrides:
            if not _selects(override, node, roles, weighted):
                continue
            applied.append(_describe(override))
            weights = weights.layered(override.weights)
            if override.activations is not None:
                activations = override.activations
            if override.precision in FLOAT_PRECISIONS:
                quantized, float_precision = False, override.precision
            elif override.precision is not None or override.weights.bits is not None:
                quantized = True
                fp8 = override.precision == "fp8"
        if applied:
            source = "override"
            reason = "set by " + ", then ".join(applied)
        resolved = weights.resolved()
        if not quantized:
            precision = float_precision
        elif fp8:
            precision = "fp8"
        else:
            precision = "int4" if resolved.bits == 4 else "int8"
        if precision in ("fp8",) + FLOAT_PRECISIONS:
            # fp8 nodes have fp8 activations (FP8 has no weight-only form here); a float node's
            # activations are its own type.
            activations = precision
        elif activations is None:
            activations = "float" if precision == "int4" else "int8"
        elif activations == "dynamic" and precision == "int4":
            # dynamic int8 multiplies 8-bit weights (MatMulInteger); a node given 4-bit
            # weights at another level (an override, the search's int4 candidate) is
            # weight-only, as 4-bit nodes are by default (the recipe refuses both at one level)
            activations = "float"
            reason += "; 4-bit weights: weight-only (dynamic activations need 8-bit weights)"
        integer_kernel = activations != "float" and node.op_type not in unquantized_inputs
        if precision == "int8" and integer_kernel and resolved.granularity == "block":
            # ONNX Runtime's integer MatMul and Conv kernels take one weight scale per output
            # channel (or per tensor); 8-bit blocks are a weight-only form (MatMulNBits). The
            # blocks come from a 4-bit level (the int4 base of an int8 override, --auto's int8
            # candidate): measured, ORT fused them into a MatMulIntegerToFloat that fails to run.
            resolved = dataclasses.replace(resolved, granularity="per-channel", block_size=None)
            reason += (
                "; 8-bit weights with int8 activations: one scale per output channel "
                "(8-bit blocks are weight-only, activations: float)"
            )
        settings[node.name] = NodeSettings(precision, resolved, activations, source, reason)
    return settings
