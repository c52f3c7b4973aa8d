"""Decide, from the graph alone, which nodes run quantized and where each QDQ pair goes.

The placement follows what ONNX Runtime's CPU provider and TensorRT fuse (DESIGN.md):
activation inputs of a quantized node get a per-tensor Q/DQ pair; weights are stored as int8
initializers with a per-output-channel DequantizeLinear; Conv (and the element-wise ops that have
QLinear forms) also quantize their output, because ORT only forms QLinearConv from DQ->Conv->Q.
A Relu, or a Clip(0, max) such as ReLU6, right after a quantized node is folded into that output's
QuantizeLinear for asymmetric uint8 targets (a zero point of 0 clamps negatives exactly as Relu
does, and the range taken from the clamp's own output never exceeds its max), as ORT's own
quantizer does; shape-only and max-pooling ops get no pair of their own: the tensor after them
reuses the range of the tensor before them, so ORT can drop DQ->Reshape->Q and run them on uint8.
Calibration needs only `Layout.stats_tensors()`, so this runs before any statistics exist.
The per-node decisions go into a `Plan` (qtool/plan.py); the slots here say where the tensors go.

What each op type allows (which inputs are weights and how their slots are built, whether its
output is quantized, the form written per target and precision) is its rule in the op registry
(qtool/plan/ops/, docs/op-registry.md): this module applies the rules to a graph and names no
op type itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from qtool.errors import ModelError
from qtool.plan.graph import GraphIndex
from qtool.plan.node_settings import NodeSettings, resolve_node_settings
from qtool.plan.ops import find_rule, precision_key, rules, unplaced_reason
from qtool.plan.ops.registry import Entry, OpRule
from qtool.plan.plan import FLOAT_TYPES, NodePlan, Plan, WeightPlan
from qtool.plan.settings import QuantizationSpec
from qtool.plan.slots import ActivationSlot, BiasSlot, WeightSlot, slot_key
from qtool.plan.tied import tie_weights

# The slot types live in qtool/plan/slots.py (the op families build them); this is where the
# rest of qtool imports them from.
__all__ = ["ActivationSlot", "BiasSlot", "Layout", "WeightSlot", "plan_layout", "slot_key"]

# Ranges the FP16 typing pass checks (write/keep_fp32.py): FP16's 5-bit exponent overflows and
# underflows where FP32's does not; BF16 keeps FP32's exponent, so it needs none.
_RANGED_TYPES = ("fp16",)


@dataclass
class Layout:
    """The Plan and where its Q/DQ tensors go. `activations` is keyed by `slot_key` (the tensor
    for int8 pairs); `typed_tensors` are the float tensors of nodes that compute in FP16, whose
    calibration ranges the typing pass checks against FP16's limits."""

    plan: Plan = field(default_factory=Plan)
    activations: dict[str, ActivationSlot] = field(default_factory=dict)
    weights: dict[str, WeightSlot] = field(default_factory=dict)
    biases: dict[str, BiasSlot] = field(default_factory=dict)
    # Relu / Clip(0, max) node name -> its output, for clamps folded into a QuantizeLinear.
    folded_clamps: dict[str, str] = field(default_factory=dict)
    # Weight -> the layer input whose Hessian (XᵀX over calibration) GPTQ needs for it.
    gptq_inputs: dict[str, str] = field(default_factory=dict)
    # Every MatMul/Gemm weight -> its layer input (the node that planned it): where the Hessian
    # methods that any weight may use (AWQ, scale estimation) find its Hessian.
    weight_inputs: dict[str, str] = field(default_factory=dict)
    typed_tensors: list[str] = field(default_factory=list)
    # Tensors quantized at run time (dynamic int8: one DynamicQuantizeLinear each, shared by the
    # nodes that read it); they have no range to calibrate, so stats_tensors leaves them out.
    dynamic: list[str] = field(default_factory=list)
    # quantization.dynamic_ranges: one range per tensor or per token (row) for those tensors.
    dynamic_ranges: str = "per-tensor"

    def stats_tensors(self) -> list[str]:
        slots = {slot.stats_tensor for slot in self.activations.values()}
        return sorted(slots | set(self.typed_tensors))

    def hessian_tensors(self) -> list[str]:
        return sorted(set(self.gptq_inputs.values()))

    def quantized_nodes(self) -> list[str]:
        return [node.name for node in self.plan.quantized()]


def _rule_of(node: onnx.NodeProto) -> OpRule | None:
    """The node's op rule; None for op types qtool knows nothing about (any op can occur)."""
    return find_rule(node.op_type)


def _pair_type(chosen: NodeSettings, rule: OpRule) -> str | None:
    """The type of the Q/DQ pairs on the node's float inputs, int8 or fp8, or "dynamic" (a
    DynamicQuantizeLinear, no pair); None: weight-only (an embedding's indices are integers,
    so a Gather has none either)."""
    if chosen.activations in ("int8", "dynamic", "fp8") and rule.activation_inputs:
        return chosen.activations
    return None


def _key(spec: QuantizationSpec, precision: str, pairs: str | None) -> str:
    """The registry key of a quantized node: its precision and its activations' pair type (a
    dynamic node's form also by the recipe's dynamic_ranges)."""
    return precision_key(precision, pairs or "float", spec.dynamic_ranges)


def _entry(rule: OpRule, spec: QuantizationSpec, precision: str, pairs: str | None) -> Entry:
    """The registry entry the node is written by; RegistryError when the rule has none."""
    return rule.entry(spec.target, _key(spec, precision, pairs))


def plan_layout(
    model: onnx.ModelProto,
    spec: QuantizationSpec,
    float_tensors: set[str],
    activation_method: str | None = None,
    recipe_path: str = "recipe",
) -> Layout:
    """Decide every node's precision (the Plan) and the QDQ slots; `model` must be prepared."""
    graph = GraphIndex(model, float_tensors)
    # A weight read by several nodes (a tied embedding) is stored once: its readers' settings
    # are made to agree, and each leader is planned before the nodes that follow it.
    unquantized_inputs = {r.op_type for r in rules() if not r.activation_inputs}
    settings_by_node = resolve_node_settings(
        model, spec, recipe_path, float_tensors, unquantized_inputs
    )
    tied = tie_weights(graph, settings_by_node)
    settings = tied.settings
    layout = Layout()
    wanted: list[tuple[str, str]] = []  # (tensor, pair type) to quantize, in discovery order
    dynamic: dict[str, None] = {}  # tensors quantized at run time, in discovery order
    quantized_nodes: set[str] = set()
    weight_plans: dict[str, WeightPlan] = {}  # one plan per weight, even when nodes share it

    for node in tied.order:
        chosen = settings[node.name]
        outcome = _quantize_node(node, graph, spec, chosen, layout)
        if isinstance(outcome, tuple):
            source, reason = outcome
            precision = chosen.precision if chosen.precision in FLOAT_TYPES else None
            precision = precision or spec.float_precision
            _check_float_entry(node, spec, precision)
            layout.plan.add(
                NodePlan(
                    node.name,
                    node.op_type,
                    precision,
                    source,
                    reason,
                    activations=precision if precision != "float" else "int8",
                )
            )
            continue
        rule = outcome
        quantized_nodes.add(node.name)
        weight_name = graph.weight_of(node, layout.weights)
        weight = layout.weights[weight_name] if weight_name is not None else None
        pairs = _pair_type(chosen, rule)
        precision = chosen.precision
        if weight is None and precision == "int4":
            precision = "int8"  # an op without a weight: its activations are what is quantized
        entry = _entry(rule, spec, precision, pairs)
        layout.plan.add(
            NodePlan(
                node.name,
                node.op_type,
                precision,
                chosen.source,
                chosen.reason,
                activation_method=activation_method if pairs in ("int8", "fp8") else None,
                weight=None
                if weight is None
                else weight_plans.setdefault(
                    weight.tensor, _weight_plan(weight, chosen, spec, rule, entry)
                ),
                activations=pairs or "float",
            )
        )
        if weight is not None and rule.weights is not None and rule.weights.gptq:
            layout.weight_inputs.setdefault(weight.tensor, node.input[0])
            if layout.plan[node.name].weight.method == "gptq":
                layout.gptq_inputs.setdefault(weight.tensor, node.input[0])
        if pairs is None:
            continue
        if pairs == "dynamic":  # no pair, no range: a DynamicQuantizeLinear at run time
            dynamic.update((n, None) for n in node.input if graph.is_float_activation(n))
            continue
        wanted.extend((name, pairs) for name in node.input if graph.is_float_activation(name))
        if entry.quantizes_output(rule):
            out = node.output[0]
            clamp = _single_clamp_consumer(out, graph)
            target = clamp.output[0] if clamp is not None else out
            if target not in graph.graph_outputs:
                wanted.append((target, pairs))

    for tensor, dtype in dict.fromkeys(wanted):
        key = slot_key(tensor, dtype)
        if key in layout.activations:
            continue
        source = tensor
        producer = graph.producer.get(tensor)
        if (
            producer is not None
            and tensor not in dynamic  # a dynamic reader needs the clamp's output itself
            and _folds(producer, graph)
            and not spec.symmetric_activations
            and _clamp_foldable(producer, graph, quantized_nodes)
        ):
            source = producer.input[0]
            layout.folded_clamps[producer.name] = tensor
        layout.activations[key] = ActivationSlot(tensor, source, _stats_root(tensor, graph), dtype)

    layout.dynamic = list(dynamic)
    layout.dynamic_ranges = spec.dynamic_ranges
    layout.typed_tensors = _typed_tensors(layout.plan, graph, spec)
    _annotate_float_nodes(layout, graph, spec.target)
    _note_float_readers(layout, graph, tied.leaders)
    layout.plan.nodes = {n.name: layout.plan[n.name] for n in graph.nodes}  # graph order
    return layout


def _note_float_readers(layout: Layout, graph: GraphIndex, leaders: dict[str, str]) -> None:
    """A float node reading a stored (quantized) weight reads its stored values: say so."""
    for node in graph.nodes:
        plan = layout.plan[node.name]
        weight = graph.weight_of(node, layout.weights)
        if plan.quantized or weight is None or plan.source == "tied":
            continue
        stored = layout.plan.weight_plans().get(weight)
        if stored is None:
            continue
        leader = leaders.get(weight, "another node")
        plan.reason += (
            f"; reads weight '{weight}', stored once as node '{leader}' plans it "
            f"(int{stored.bits}): the dequantized values"
        )


def _weight_plan(
    slot: WeightSlot, chosen: NodeSettings, spec: QuantizationSpec, rule: OpRule, entry: Entry
) -> WeightPlan:
    """How the weight is stored; `rule` and `entry` are those of the node that planned it."""
    settings = chosen.weights
    if slot.block_size is not None:
        granularity = "block"
    elif slot.axis is None:
        granularity = "per-tensor"
    else:
        granularity = "per-channel"
    symmetric = bool(settings.symmetric)
    notes = []
    if entry.unsigned_blocks is not None and symmetric and slot.block_size is not None:
        symmetric = False
        notes.append(f"asymmetric: {entry.unsigned_blocks}")
    if settings.granularity == "block" and slot.block_size is None:
        notes.append(rule.weights.no_blocks)
    if slot.block_size is not None and settings.block_size != slot.block_size:
        notes.append(f"block {slot.block_size}: the largest that divides the table's rows")
    method = settings.method or "minmax"
    if method == "gptq" and not rule.weights.gptq:
        method = "mse"
        notes.append("gptq is for MatMul/Gemm weights; this one uses mse")
    pairs = _pair_type(chosen, rule)
    activations_int8 = pairs in ("int8", "dynamic")  # an integer kernel multiplies the weight
    if chosen.precision == "fp8":
        fmt, symmetric = "e4m3", True
        where = "per output channel" if slot.axis is not None else "per tensor"
        reason = f"fp8 e4m3, {where}, scale = amax / 448"
    elif settings.bits == 8 and activations_int8 and slot.block_size is None:
        fmt = "s8"
        reason = "default: int8 symmetric, full range"
    else:
        fmt = ("s" if symmetric else "u") + str(settings.bits)
        where = (
            f"blocks of {slot.block_size} along axis {slot.axis}"
            if slot.block_size is not None
            else granularity
        )
        role = "weight-only" if not activations_int8 else f"with {pairs} int8 activations"
        reason = f"int{settings.bits} {'symmetric' if symmetric else 'asymmetric'}, {where}, {role}"
    if notes:
        reason += " (" + "; ".join(notes) + ")"
    return WeightPlan(
        slot.tensor,
        int(settings.bits),
        granularity,
        slot.axis,
        fmt,
        reason,
        block_size=slot.block_size,
        method=method,
        symmetric=symmetric,
        transposed=slot.transposed,
        signed_scales=entry.signed_scales and symmetric,
    )


def _quantize_node(
    node: onnx.NodeProto,
    graph: GraphIndex,
    spec: QuantizationSpec,
    chosen: NodeSettings,
    layout: Layout,
) -> OpRule | tuple[str, str]:
    """Record the node's weight/bias slots and return its rule, or (source, why it stays float)."""
    if chosen.precision in FLOAT_TYPES:
        if chosen.source == "not-listed":
            return "unsupported", _UNLISTED  # refined for pass-through ops later
        return chosen.source, chosen.reason
    rule = _rule_of(node)
    if rule is None or not rule.quantizable:
        return "unsupported", _UNLISTED
    missing = _no_form(rule, spec, chosen)
    if missing is not None:
        return "unsupported", missing
    data_inputs = [name for name in node.input if name]
    if rule.weights is not None:
        entry = _entry(rule, spec, chosen.precision, _pair_type(chosen, rule))
        declined = entry.declines(node, graph) if entry.declines is not None else None
        if declined is not None:
            return "unsupported", declined
        slots = rule.weights.slots(node, graph, spec, chosen, entry)
        if isinstance(slots, str):
            return "unsupported", slots
        if slots.weight is not None:
            _check_not_empty(node, graph, slots.weight.tensor)
            layout.weights.setdefault(slots.weight.tensor, slots.weight)
        if slots.bias is not None:
            layout.biases.setdefault(slots.bias.tensor, slots.bias)
        has_weight = graph.weight_of(node, layout.weights) is not None
        if not has_weight and chosen.activations == "float":
            return chosen.source, f"{chosen.reason}: activations float and no constant weight"
        if not has_weight and chosen.activations == "dynamic":
            return chosen.source, f"{chosen.reason}: {_DYNAMIC_NEEDS_WEIGHT}"
        return rule
    if chosen.activations == "float":
        return chosen.source, f"{chosen.reason}: activations float and no weight to store"
    if any(not graph.is_float_activation(name) for name in data_inputs):
        return "unsupported", "has a constant or non-float input"
    return rule


_UNLISTED = "op type not quantized"
# ORT's dynamic kernels quantize input A at run time against a constant int8 B; ORT's own
# quantize_dynamic leaves the activation-by-activation MatMuls of attention float too.
_DYNAMIC_NEEDS_WEIGHT = (
    "activations dynamic and no constant weight: ORT's dynamic kernels (DynamicQuantizeMatMul, "
    "MatMulIntegerToFloat) quantize the input at run time against a constant int8 weight, so "
    "it stays float (as ORT's quantize_dynamic leaves it)"
)


def _no_form(rule: OpRule, spec: QuantizationSpec, chosen: NodeSettings) -> str | None:
    """Why the rule has no form at the node's fp8 or dynamic precision on the target (an op
    with no FP8 entry: its activations alone have no FP8 kernel to feed; no dynamic entry:
    ORT has dynamic kernels for MatMul/Gemm only), or None. Other precisions every quantizable
    rule has, or the registry's lookup names what is missing."""
    dynamic = chosen.activations == "dynamic" and rule.activation_inputs
    if chosen.precision == "fp8":
        key, what = _key(spec, "fp8", "fp8"), "fp8"
    elif dynamic:
        key, what = _key(spec, "int8", "dynamic"), "dynamic int8"
    else:
        return None
    if (spec.target, key) in rule.entries:
        return None
    have = ", ".join(rule.precisions(spec.target))
    return (
        f"{rule.op_type} has no {what} form for target {spec.target} (it has {have}): it "
        f"stays in the float type"
    )


def _check_float_entry(node: onnx.NodeProto, spec: QuantizationSpec, precision: str) -> None:
    """A quantizable op typed fp16/bf16 is written by its rule's entry for that key: the lookup
    raises when the target offers no such form (BF16 on ort-cpu is refused by the recipe)."""
    rule = _rule_of(node)
    if precision != "float" and rule is not None and rule.quantizable:
        rule.entry(spec.target, precision_key(precision, precision))


def _typed_tensors(plan: Plan, graph: GraphIndex, spec: QuantizationSpec) -> list[str]:
    """The float activations read or written by nodes that compute in FP16: a node typed fp16,
    or a quantized node in a model whose float type is fp16 (its float side is FP16)."""
    tensors: dict[str, None] = {}
    for node in graph.nodes:
        planned = plan[node.name]
        low = planned.precision if planned.precision in FLOAT_TYPES else spec.float_precision
        if low not in _RANGED_TYPES:
            continue
        for name in list(node.input) + list(node.output):
            if name and graph.is_float_activation(name):
                tensors.setdefault(name)
    return list(tensors)


def _check_not_empty(node: onnx.NodeProto, graph: GraphIndex, weight: str) -> None:
    """Refuse a weight with no elements: there is nothing to take a range of, and the failure
    would otherwise come from the min/max kernel, naming neither the node nor the tensor."""
    dims = list(graph.initializers[weight].dims)
    if 0 in dims:
        raise ModelError(
            f"node {node.name!r} ({node.op_type}): weight {weight!r} has shape {dims}, "
            "which holds no values to quantize (a zero-size dimension); fix the model or list "
            "the node in quantization.exclude"
        )


def _folds(node: onnx.NodeProto, graph: GraphIndex) -> bool:
    """A clamp at 0 from below (Relu, Clip(0, max)) that its rule folds into a QuantizeLinear."""
    rule = _rule_of(node)
    return rule is not None and rule.folds is not None and rule.folds.applies(node, graph)


def _single_clamp_consumer(tensor: str, graph: GraphIndex) -> onnx.NodeProto | None:
    consumers = graph.consumers.get(tensor, [])
    if len(consumers) == 1 and _folds(consumers[0], graph) and tensor not in graph.graph_outputs:
        clamp = consumers[0]
        if clamp.output[0] not in graph.graph_outputs:
            return clamp
    return None


def _clamp_foldable(clamp: onnx.NodeProto, graph: GraphIndex, quantized_nodes: set[str]) -> bool:
    source = clamp.input[0]
    producer = graph.producer.get(source)
    return (
        producer is not None
        and producer.name in quantized_nodes
        and len(graph.consumers.get(source, [])) == 1
        and source not in graph.graph_outputs
        and clamp.output[0] not in graph.graph_outputs
    )


def _stats_root(tensor: str, graph: GraphIndex) -> str:
    """Walk back through pass-through ops so both sides of a Reshape/MaxPool share one range."""
    current = tensor
    while True:
        producer = graph.producer.get(current)
        rule = _rule_of(producer) if producer is not None else None
        if rule is None or rule.shares_range is None:
            return current
        data_input = producer.input[0]
        if not graph.is_float_activation(data_input):
            return current
        current = data_input


def _annotate_float_nodes(layout: Layout, graph: GraphIndex, target: str) -> None:
    """Replace the generic reason of float nodes with the specific, true one the user needs."""
    quantized_tensors = set(layout.activations)
    nodes_by_name = {node.name: node for node in graph.nodes}
    for node in layout.plan:
        if node.quantized:
            continue
        rule = find_rule(node.op_type)
        if node.name in layout.folded_clamps:
            node.source = "folded"
            node.reason = rule.folds.reason
        elif rule is not None and rule.shares_range is not None and node.reason == _UNLISTED:
            node.source = "passthrough"
            if nodes_by_name[node.name].output[0] in quantized_tensors:
                node.reason = rule.shares_range.between_pairs
            else:
                node.reason = rule.shares_range.alone
        elif node.reason == _UNLISTED:
            if rule is not None and rule.quantizable:
                node.reason = "op type not listed in quantization.op_types"
                node.source = "not-listed"
            else:
                node.reason = unplaced_reason(node.op_type, target)
