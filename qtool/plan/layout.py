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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from qtool.errors import ModelError
from qtool.plan.node_settings import NodeSettings, resolve_node_settings
from qtool.plan.plan import NodePlan, Plan, WeightPlan
from qtool.plan.settings import SUPPORTED_OP_TYPES, QuantizationSpec

SUPPORTED_OPS = frozenset(SUPPORTED_OP_TYPES)
# Ops with a constant weight: Gather's is its table (its other input is integer indices).
WEIGHTED_OPS = frozenset({"Conv", "Gemm", "MatMul", "Gather"})
# Ops whose ORT QLinear form needs a quantized output as well as quantized inputs.
OUTPUT_QUANTIZED_OPS = (SUPPORTED_OPS - WEIGHTED_OPS) | {"Conv"}
# Ops that move or select values without creating new ones: the output range is the input range.
PASSTHROUGH_OPS = frozenset({"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "MaxPool"})
# Ops ORT's CPU provider can run on quantized data that qtool does not place QDQ pairs around yet:
# the report says so instead of claiming the runtime has no kernel.
_ORT_CPU_QUANTIZED_FORMS = {
    "Sigmoid": "QLinearSigmoid",
    "LeakyRelu": "QLinearLeakyRelu",
    "Softmax": "QLinearSoftmax",
    "Where": "QLinearWhere",
    "ReduceMean": "QLinearReduceMean",
    "Resize": "Resize on uint8",
    "Split": "Split on uint8",
    "Pad": "Pad on uint8",
}


@dataclass(frozen=True)
class ActivationSlot:
    """A tensor whose consumers read a dequantized copy.

    `source` is what the QuantizeLinear reads: the tensor itself, or the input of a folded Relu.
    `stats_tensor` is the tensor whose calibration statistics set the range (the tensor before a
    chain of pass-through ops, so both sides of a Reshape share one scale).
    """

    tensor: str
    source: str
    stats_tensor: str


@dataclass(frozen=True)
class WeightSlot:
    """A constant weight stored as an integer tensor.

    `axis` is DequantizeLinear's axis: the output-channel axis (None: per-tensor), or with
    `block_size` the axis the blocks run along. `reduction` says how ORT's kernels walk the
    weight along the summed axis, which decides which products share a 16-bit pair sum on CPUs
    without VNNI: "k-rows" (MatMul / Gemm weight [K, N]), "k-cols" (Gemm transB [N, K]), "conv"
    (im2col order: kernel positions outer, input channels of the group inner), "depthwise"
    (ORT's depthwise kernel accumulates in 32 bits) or "gather" (an embedding table [V, D]).
    `transposed`: a Gemm transB weight stored as [K, N] (see WeightPlan).
    """

    tensor: str
    axis: int | None
    reduction: str = "k-rows"
    group: int = 1
    block_size: int | None = None
    transposed: bool = False


@dataclass(frozen=True)
class BiasSlot:
    """A bias stored as int32 with scale = input scale x weight scale."""

    tensor: str
    activation: str
    weight: str


@dataclass
class Layout:
    plan: Plan = field(default_factory=Plan)
    activations: dict[str, ActivationSlot] = field(default_factory=dict)
    weights: dict[str, WeightSlot] = field(default_factory=dict)
    biases: dict[str, BiasSlot] = field(default_factory=dict)
    # Relu / Clip(0, max) node name -> its output, for clamps folded into a QuantizeLinear.
    folded_clamps: dict[str, str] = field(default_factory=dict)
    # Weight -> the layer input whose Hessian (XᵀX over calibration) GPTQ needs for it.
    gptq_inputs: dict[str, str] = field(default_factory=dict)

    def stats_tensors(self) -> list[str]:
        return sorted({slot.stats_tensor for slot in self.activations.values()})

    def hessian_tensors(self) -> list[str]:
        return sorted(set(self.gptq_inputs.values()))

    def quantized_nodes(self) -> list[str]:
        return [node.name for node in self.plan.quantized()]


class _Graph:
    """Producer/consumer indexes over a graph, built once."""

    def __init__(self, model: onnx.ModelProto, float_tensors: set[str]) -> None:
        graph = model.graph
        self.nodes = list(graph.node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_outputs = {o.name for o in graph.output}
        self.float_tensors = float_tensors
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for out in node.output:
                self.producer[out] = node
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)

    def is_float_activation(self, name: str) -> bool:
        return bool(name) and name not in self.initializers and name in self.float_tensors

    def is_float_constant(self, name: str) -> bool:
        init = self.initializers.get(name)
        return init is not None and init.data_type == TensorProto.FLOAT


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def plan_layout(
    model: onnx.ModelProto,
    spec: QuantizationSpec,
    float_tensors: set[str],
    activation_method: str | None = None,
    recipe_path: str = "recipe",
) -> Layout:
    """Decide every node's precision (the Plan) and the QDQ slots; `model` must be prepared."""
    graph = _Graph(model, float_tensors)
    settings = resolve_node_settings(model, spec, recipe_path)
    layout = Layout()
    wanted: list[str] = []  # activation tensors to quantize, in discovery order
    quantized_nodes: set[str] = set()
    weight_plans: dict[str, WeightPlan] = {}  # one plan per weight, even when nodes share it

    for node in graph.nodes:
        chosen = settings[node.name]
        outcome = _quantize_node(node, graph, spec, chosen, layout)
        if outcome is not None:
            source, reason = outcome
            layout.plan.add(NodePlan(node.name, node.op_type, "float", source, reason))
            continue
        quantized_nodes.add(node.name)
        weight = next((layout.weights[n] for n in node.input if n in layout.weights), None)
        with_activations = chosen.activations == "int8" and node.op_type != "Gather"
        layout.plan.add(
            NodePlan(
                node.name,
                node.op_type,
                chosen.precision if weight is not None else "int8",
                chosen.source,
                chosen.reason,
                activation_method=activation_method if with_activations else None,
                weight=None
                if weight is None
                else weight_plans.setdefault(weight.tensor, _weight_plan(weight, chosen, spec)),
                activations="int8" if with_activations else "float",
            )
        )
        if weight is not None and layout.plan[node.name].weight.method == "gptq":
            layout.gptq_inputs.setdefault(weight.tensor, node.input[0])
        if not with_activations:
            continue
        wanted.extend(name for name in node.input if graph.is_float_activation(name))
        if node.op_type in OUTPUT_QUANTIZED_OPS:
            out = node.output[0]
            clamp = _single_clamp_consumer(out, graph)
            target = clamp.output[0] if clamp is not None else out
            if target not in graph.graph_outputs:
                wanted.append(target)

    for tensor in dict.fromkeys(wanted):
        if tensor in layout.activations:
            continue
        source = tensor
        producer = graph.producer.get(tensor)
        if (
            producer is not None
            and _is_zero_floor_clamp(producer, graph)
            and not spec.symmetric_activations
            and _clamp_foldable(producer, graph, quantized_nodes)
        ):
            source = producer.input[0]
            layout.folded_clamps[producer.name] = tensor
        layout.activations[tensor] = ActivationSlot(tensor, source, _stats_root(tensor, graph))

    _annotate_float_nodes(layout, graph, spec.target)
    return layout


def _weight_plan(slot: WeightSlot, chosen: NodeSettings, spec: QuantizationSpec) -> WeightPlan:
    settings = chosen.weights
    if slot.block_size is not None:
        granularity = "block"
    elif slot.axis is None:
        granularity = "per-tensor"
    else:
        granularity = "per-channel"
    symmetric = bool(settings.symmetric)
    notes = []
    if slot.reduction == "gather" and spec.target == "ort-cpu" and settings.bits == 8:
        if symmetric and slot.block_size is not None:
            symmetric = False
            notes.append("asymmetric: GatherBlockQuantized has no signed 8-bit form")
    if settings.granularity == "block" and slot.block_size is None:
        notes.append(_NO_BLOCKS.get(slot.reduction, "blocks need a 2-D weight"))
    if slot.block_size is not None and settings.block_size != slot.block_size:
        notes.append(f"block {slot.block_size}: the largest that divides the table's rows")
    method = settings.method or "minmax"
    if method == "gptq" and slot.reduction not in ("k-rows", "k-cols"):
        method = "mse"
        notes.append("gptq is for MatMul/Gemm weights; this one uses mse")
    activations_int8 = chosen.activations == "int8" and slot.reduction != "gather"
    if settings.bits == 8 and activations_int8 and slot.block_size is None:
        fmt = "s8"
        reason = "default: int8 symmetric, full range"
    else:
        fmt = ("s" if symmetric else "u") + str(settings.bits)
        where = (
            f"blocks of {slot.block_size} along axis {slot.axis}"
            if slot.block_size is not None
            else granularity
        )
        role = "weight-only" if not activations_int8 else "with int8 activations"
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
        signed_scales=spec.target == "ort-cpu"
        and symmetric
        and settings.bits == 4
        and slot.reduction != "gather",
    )


_NO_BLOCKS = {
    "conv": "Conv weights use one scale per output channel",
    "depthwise": "Conv weights use one scale per output channel",
    "gather": "no block size divides the table's rows: one scale per row",
}


def _quantize_node(
    node: onnx.NodeProto,
    graph: _Graph,
    spec: QuantizationSpec,
    chosen: NodeSettings,
    layout: Layout,
) -> tuple[str, str] | None:
    """Record the node's weight/bias slots and return None, or (source, why it stays float)."""
    if chosen.precision == "float":
        if chosen.source == "not-listed":
            return "unsupported", _UNLISTED  # refined for pass-through ops later
        return chosen.source, chosen.reason
    if node.op_type not in SUPPORTED_OPS:
        return "unsupported", _UNLISTED
    data_inputs = [name for name in node.input if name]
    if node.op_type in WEIGHTED_OPS:
        reason = _weighted_node(node, graph, spec, chosen, layout)
        if reason is not None:
            return "unsupported", reason
        has_weight = any(name in layout.weights for name in node.input)
        if not has_weight and chosen.activations == "float":
            return chosen.source, f"{chosen.reason}: activations float and no constant weight"
        return None
    if chosen.activations == "float":
        return chosen.source, f"{chosen.reason}: activations float and no weight to store"
    if any(not graph.is_float_activation(name) for name in data_inputs):
        return "unsupported", "has a constant or non-float input"
    return None


_UNLISTED = "op type not quantized"


def _block_size_for(size: int, wanted: int, target: str) -> int | None:
    """Gather tables: GatherBlockQuantized wants the block to divide the row (ORT 1.31)."""
    if target != "ort-cpu":
        return wanted
    for block in (wanted, 128, 64, 32, 16):
        if block <= wanted and size % block == 0:
            return block
    return None


def _weighted_node(
    node: onnx.NodeProto,
    graph: _Graph,
    spec: QuantizationSpec,
    chosen: NodeSettings,
    layout: Layout,
) -> str | None:
    inputs = list(node.input) + [""] * (3 - len(node.input))
    settings = chosen.weights
    blocked = settings.granularity == "block"
    per_tensor = settings.granularity == "per-tensor"
    activations_int8 = chosen.activations == "int8"
    if node.op_type == "Gather":
        table, indices = inputs[0], inputs[1]
        if not graph.is_float_constant(table):
            return "data input is not a constant float table"
        if graph.is_float_activation(indices) or indices in graph.initializers:
            return "indices are constant or float"
        dims = list(graph.initializers[table].dims)
        if len(dims) != 2 or _attribute(node, "axis", 0) != 0:
            return "only 2-D tables gathered along axis 0 are quantized"
        block = None
        if blocked or spec.target == "ort-cpu":
            block = _block_size_for(dims[1], settings.block_size or 128, spec.target)
        axis = 1 if block is not None else 0
        _add_weight(layout, node, graph, WeightSlot(table, axis, "gather", block_size=block))
        return None
    if node.op_type == "MatMul":
        a, b = inputs[0], inputs[1]
        if not graph.is_float_activation(a) and not graph.is_float_constant(a):
            return "input A is not float"
        if graph.is_float_constant(a):
            return "constant first input (weight on the left) is not supported"
        if graph.is_float_constant(b):
            dims = graph.initializers[b].dims
            if blocked:
                slot = WeightSlot(b, len(dims) - 2, "k-rows", block_size=settings.block_size)
            else:
                axis = None if per_tensor or len(dims) != 2 else 1
                slot = WeightSlot(b, axis, "k-rows")
            _add_weight(layout, node, graph, slot)
        elif not graph.is_float_activation(b):
            return "input B is not float"
        return None
    x, w, bias = inputs[0], inputs[1], inputs[2]
    if not graph.is_float_activation(x):
        return "input is not a float activation"
    if not graph.is_float_constant(w):
        return "weight is not a constant float initializer"
    group = 1
    transposed = False
    block_size = None
    if node.op_type == "Gemm":
        if _attribute(node, "transA", 0) != 0:
            return "Gemm with transA=1 is not supported"
        trans_b = bool(_attribute(node, "transB", 0))
        axis = 0 if trans_b else 1
        reduction = "k-cols" if trans_b else "k-rows"
        w_dims = list(graph.initializers[w].dims)
        channels = w_dims[axis]
        if blocked:
            # Stored [K, N] with blocks along K: the only layout ORT fuses into MatMulNBits.
            axis, block_size, transposed = 0, settings.block_size, trans_b
            reduction = "k-rows"
        bias_ok = bool(bias) and graph.is_float_constant(bias)
        if bias_ok:
            bias_dims = list(graph.initializers[bias].dims)
            alpha_beta_default = (
                _float_attr(node, "alpha") == 1.0 and _float_attr(node, "beta") == 1.0
            )
            bias_ok = bias_dims == [channels] and alpha_beta_default
    else:  # Conv
        axis = 0
        bias_ok = bool(bias) and graph.is_float_constant(bias)
        group = _attribute(node, "group", 1)
        w_dims = list(graph.initializers[w].dims)
        # ORT's QLinearConv takes its depthwise kernel when each group has one input and one
        # output channel; every other Conv runs as im2col x GEMM.
        depthwise = group > 1 and len(w_dims) >= 2 and w_dims[1] == 1 and w_dims[0] == group
        reduction = "depthwise" if depthwise else "conv"
    if per_tensor:
        axis = None
    slot = WeightSlot(w, axis, reduction, group, block_size, transposed)
    _add_weight(layout, node, graph, slot)
    integer_bias = activations_int8 and block_size is None and settings.bits == 8
    if bias_ok and integer_bias:
        layout.biases.setdefault(bias, BiasSlot(bias, x, w))
    return None


def _add_weight(layout: Layout, node: onnx.NodeProto, graph: _Graph, slot: WeightSlot) -> None:
    """Record `slot` for `node`, refusing a weight with no elements: there is nothing to take a
    range of, and the failure would otherwise come from the min/max kernel, naming neither the
    node nor the tensor."""
    dims = list(graph.initializers[slot.tensor].dims)
    if 0 in dims:
        raise ModelError(
            f"node {node.name!r} ({node.op_type}): weight {slot.tensor!r} has shape {dims}, "
            "which holds no values to quantize (a zero-size dimension); fix the model or list "
            "the node in quantization.exclude"
        )
    layout.weights.setdefault(slot.tensor, slot)


def _float_attr(node: onnx.NodeProto, name: str) -> float:
    for attr in node.attribute:
        if attr.name == name:
            return float(attr.f)
    return 1.0


def _constant_scalar(name: str, graph: _Graph) -> float | None:
    init = graph.initializers.get(name) if name else None
    if init is None or int(np.prod(init.dims, dtype=np.int64)) != 1:
        return None
    return float(numpy_helper.to_array(init).reshape(-1)[0])


def _is_zero_floor_clamp(node: onnx.NodeProto, graph: _Graph) -> bool:
    """Relu, or Clip with a constant floor of 0 and a constant positive ceiling (ReLU6)."""
    if node.op_type == "Relu":
        return True
    if node.op_type != "Clip" or len(node.input) < 3:
        return False
    floor = _constant_scalar(node.input[1], graph)
    ceiling = _constant_scalar(node.input[2], graph)
    return floor == 0.0 and ceiling is not None and ceiling > 0.0


def _single_clamp_consumer(tensor: str, graph: _Graph) -> onnx.NodeProto | None:
    consumers = graph.consumers.get(tensor, [])
    if (
        len(consumers) == 1
        and _is_zero_floor_clamp(consumers[0], graph)
        and tensor not in graph.graph_outputs
    ):
        clamp = consumers[0]
        if clamp.output[0] not in graph.graph_outputs:
            return clamp
    return None


def _clamp_foldable(clamp: onnx.NodeProto, graph: _Graph, quantized_nodes: set[str]) -> bool:
    source = clamp.input[0]
    producer = graph.producer.get(source)
    return (
        producer is not None
        and producer.name in quantized_nodes
        and len(graph.consumers.get(source, [])) == 1
        and source not in graph.graph_outputs
        and clamp.output[0] not in graph.graph_outputs
    )


def _stats_root(tensor: str, graph: _Graph) -> str:
    """Walk back through pass-through ops so both sides of a Reshape/MaxPool share one range."""
    current = tensor
    while True:
        producer = graph.producer.get(current)
        if producer is None or producer.op_type not in PASSTHROUGH_OPS:
            return current
        data_input = producer.input[0]
        if not graph.is_float_activation(data_input):
            return current
        current = data_input


def _annotate_float_nodes(layout: Layout, graph: _Graph, target: str) -> None:
    """Replace the generic reason of float nodes with the specific, true one the user needs."""
    quantized_tensors = set(layout.activations)
    nodes_by_name = {node.name: node for node in graph.nodes}
    for node in layout.plan:
        if node.quantized:
            continue
        if node.name in layout.folded_clamps:
            node.source = "folded"
            what = "Relu" if node.op_type == "Relu" else "Clip(0, max)"
            node.reason = (
                f"{what} folded into the preceding quantized output (uint8 zero point 0 clamps "
                "negatives; the range never exceeds the clamp's maximum)"
            )
        elif node.op_type in PASSTHROUGH_OPS and node.reason == _UNLISTED:
            node.source = "passthrough"
            if nodes_by_name[node.name].output[0] in quantized_tensors:
                node.reason = (
                    "shape/max op between QDQ pairs with one scale: ORT runs it on uint8 data"
                )
            else:
                node.reason = "shape/max op: no quantized neighbour"
        elif node.reason == _UNLISTED:
            node.reason = _unquantized_op_reason(node.op_type, target)
            if node.op_type in SUPPORTED_OPS:
                node.source = "not-listed"


def _unquantized_op_reason(op_type: str, target: str) -> str:
    if op_type in SUPPORTED_OPS:
        return "op type not listed in quantization.op_types"
    if target == "tensorrt":
        return f"qtool places no QDQ pair around {op_type}; TensorRT chooses its precision"
    form = _ORT_CPU_QUANTIZED_FORMS.get(op_type)
    if form is not None:
        return f"qtool does not quantize {op_type} yet (ORT's CPU provider has {form}): stays float"
    return f"ORT's CPU provider has no quantized kernel for {op_type}: stays float"
