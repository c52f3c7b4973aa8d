"""Decide, from the graph alone, which nodes run quantized and where each QDQ pair goes.

The placement follows what ONNX Runtime's CPU provider and TensorRT fuse (DESIGN.md):
activation inputs of a quantized node get a per-tensor Q/DQ pair; weights are stored as int8
initializers with a per-output-channel DequantizeLinear; Conv (and the element-wise ops that have
QLinear forms) also quantize their output, because ORT only forms QLinearConv from DQ->Conv->Q.
A Relu right after a quantized node is folded into that output's QuantizeLinear for asymmetric
uint8 targets (a zero point of 0 clamps negatives exactly as Relu does), as ORT's own quantizer
does; shape-only and max-pooling ops get no pair of their own: the tensor after them reuses the
range of the tensor before them, so ORT can drop DQ->Reshape->Q and run them on uint8.
Calibration needs only `Layout.stats_tensors()`, so this runs before any statistics exist.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

from qtool.recipe import SUPPORTED_OP_TYPES, QuantizationSpec

SUPPORTED_OPS = frozenset(SUPPORTED_OP_TYPES)
WEIGHTED_OPS = frozenset({"Conv", "Gemm", "MatMul"})
# Ops whose ORT QLinear form needs a quantized output as well as quantized inputs.
OUTPUT_QUANTIZED_OPS = (SUPPORTED_OPS - WEIGHTED_OPS) | {"Conv"}
# Ops that move or select values without creating new ones: the output range is the input range.
PASSTHROUGH_OPS = frozenset({"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "MaxPool"})


@dataclass(frozen=True)
class NodeDecision:
    """The fate of one node, with the reason the report shows the user."""

    name: str
    op_type: str
    quantized: bool
    reason: str


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
    """A constant weight stored as int8; `axis` is the output-channel axis (None: per-tensor)."""

    tensor: str
    axis: int | None


@dataclass(frozen=True)
class BiasSlot:
    """A bias stored as int32 with scale = input scale x weight scale."""

    tensor: str
    activation: str
    weight: str


@dataclass
class Layout:
    decisions: list[NodeDecision] = field(default_factory=list)
    activations: dict[str, ActivationSlot] = field(default_factory=dict)
    weights: dict[str, WeightSlot] = field(default_factory=dict)
    biases: dict[str, BiasSlot] = field(default_factory=dict)
    folded_relus: dict[str, str] = field(default_factory=dict)  # Relu node name -> its output

    def stats_tensors(self) -> list[str]:
        return sorted({slot.stats_tensor for slot in self.activations.values()})

    def quantized_nodes(self) -> list[str]:
        return [d.name for d in self.decisions if d.quantized]


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


def _excluded_by(name: str, patterns: tuple[str, ...]) -> str | None:
    for pattern in patterns:
        if name == pattern or fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None


def plan_layout(model: onnx.ModelProto, spec: QuantizationSpec, float_tensors: set[str]) -> Layout:
    """Decide every node's precision and the QDQ slots; `model` must be prepared (typed)."""
    graph = _Graph(model, float_tensors)
    layout = Layout()
    wanted: list[str] = []  # activation tensors to quantize, in discovery order
    quantized_nodes: set[str] = set()
    op_types = set(spec.op_types)

    for node in graph.nodes:
        reason = _quantize_node(node, graph, spec, op_types, layout)
        if reason is not None:
            layout.decisions.append(NodeDecision(node.name, node.op_type, False, reason))
            continue
        quantized_nodes.add(node.name)
        layout.decisions.append(NodeDecision(node.name, node.op_type, True, "quantized"))
        wanted.extend(name for name in node.input if graph.is_float_activation(name))
        if node.op_type in OUTPUT_QUANTIZED_OPS:
            out = node.output[0]
            relu = _single_relu_consumer(out, graph)
            target = relu.output[0] if relu is not None else out
            if target not in graph.graph_outputs:
                wanted.append(target)

    for tensor in dict.fromkeys(wanted):
        if tensor in layout.activations:
            continue
        source = tensor
        producer = graph.producer.get(tensor)
        if (
            producer is not None
            and producer.op_type == "Relu"
            and not spec.symmetric_activations
            and _relu_foldable(producer, graph, quantized_nodes)
        ):
            source = producer.input[0]
            layout.folded_relus[producer.name] = tensor
        layout.activations[tensor] = ActivationSlot(tensor, source, _stats_root(tensor, graph))

    _annotate_float_nodes(layout, graph)
    return layout


def _quantize_node(
    node: onnx.NodeProto,
    graph: _Graph,
    spec: QuantizationSpec,
    op_types: set[str],
    layout: Layout,
) -> str | None:
    """Record the node's weight/bias slots and return None, or return why it stays float."""
    if node.op_type not in op_types or node.op_type not in SUPPORTED_OPS:
        return "op type not quantized"  # refined for pass-through ops later
    pattern = _excluded_by(node.name, spec.exclude)
    if pattern is not None:
        return f"excluded by quantization.exclude pattern '{pattern}'"
    data_inputs = [name for name in node.input if name]
    if node.op_type in WEIGHTED_OPS:
        return _weighted_node(node, graph, spec, layout)
    if any(not graph.is_float_activation(name) for name in data_inputs):
        return "has a constant or non-float input"
    return None


def _weighted_node(
    node: onnx.NodeProto, graph: _Graph, spec: QuantizationSpec, layout: Layout
) -> str | None:
    inputs = list(node.input) + [""] * (3 - len(node.input))
    if node.op_type == "MatMul":
        a, b = inputs[0], inputs[1]
        if not graph.is_float_activation(a) and not graph.is_float_constant(a):
            return "input A is not float"
        if graph.is_float_constant(a):
            return "constant first input (weight on the left) is not supported"
        if graph.is_float_constant(b):
            dims = graph.initializers[b].dims
            axis = 1 if spec.per_channel and len(dims) == 2 else None
            layout.weights.setdefault(b, WeightSlot(b, axis))
        elif not graph.is_float_activation(b):
            return "input B is not float"
        return None
    x, w, bias = inputs[0], inputs[1], inputs[2]
    if not graph.is_float_activation(x):
        return "input is not a float activation"
    if not graph.is_float_constant(w):
        return "weight is not a constant float initializer"
    if node.op_type == "Gemm":
        if _attribute(node, "transA", 0) != 0:
            return "Gemm with transA=1 is not supported"
        axis = 0 if _attribute(node, "transB", 0) else 1
        w_dims = list(graph.initializers[w].dims)
        channels = w_dims[axis]
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
    layout.weights.setdefault(w, WeightSlot(w, axis if spec.per_channel else None))
    if bias_ok:
        layout.biases.setdefault(bias, BiasSlot(bias, x, w))
    return None


def _float_attr(node: onnx.NodeProto, name: str) -> float:
    for attr in node.attribute:
        if attr.name == name:
            return float(attr.f)
    return 1.0


def _single_relu_consumer(tensor: str, graph: _Graph) -> onnx.NodeProto | None:
    consumers = graph.consumers.get(tensor, [])
    if len(consumers) == 1 and consumers[0].op_type == "Relu" and tensor not in graph.graph_outputs:
        relu = consumers[0]
        if relu.output[0] not in graph.graph_outputs:
            return relu
    return None


def _relu_foldable(relu: onnx.NodeProto, graph: _Graph, quantized_nodes: set[str]) -> bool:
    source = relu.input[0]
    producer = graph.producer.get(source)
    return (
        producer is not None
        and producer.name in quantized_nodes
        and len(graph.consumers.get(source, [])) == 1
        and source not in graph.graph_outputs
        and relu.output[0] not in graph.graph_outputs
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


def _annotate_float_nodes(layout: Layout, graph: _Graph) -> None:
    """Replace the generic reason of float nodes with the specific one the user needs to see."""
    quantized_tensors = set(layout.activations)
    nodes_by_name = {node.name: node for node in graph.nodes}
    for index, decision in enumerate(layout.decisions):
        if decision.quantized:
            continue
        if decision.name in layout.folded_relus:
            reason = "folded into the quantized output (uint8 zero point clamps like Relu)"
        elif decision.op_type in PASSTHROUGH_OPS and decision.reason == "op type not quantized":
            if nodes_by_name[decision.name].output[0] in quantized_tensors:
                reason = "shape/max op between QDQ pairs with one scale: ORT runs it on int8 data"
            else:
                reason = "shape/max op: no quantized neighbour"
        elif decision.reason == "op type not quantized":
            if decision.op_type in SUPPORTED_OPS:
                reason = "op type not listed in quantization.op_types"
            else:
                reason = f"{decision.op_type} has no quantized kernel in the target: stays float"
        else:
            continue
        layout.decisions[index] = NodeDecision(decision.name, decision.op_type, False, reason)
