"""The roles nodes play in attention blocks, read from the graph's structure (not from names).

Recipes select nodes by role (`quantization.overrides[i].roles`): the attention split of dynamic
INT8 quantizes the Q and K projections at run time and the V projection with a calibrated
range, and exporters name those MatMuls in as many ways as there are models. The structure is
the same everywhere: a Softmax between two MatMuls whose inputs are both activations,
`scores = Q Kᵀ` before it and `context = softmax(scores) V` after it. Walking back from the
scores MatMul's first input finds the Q projection, from its second input the K projection,
from the context MatMul's second input the V projection: the first MatMul or Gemm with a
constant weight on each path, through the ops that reshape, transpose, scale, mask, add a bias
or rotate (RoPE) a projection's output, and through nothing else.

A fused QKV projection (one MatMul split into three) has every role its outputs reach. The
walks stop at any other MatMul/Gemm, so a rotary embedding's own MatMul (no constant weight)
ends a path without a role.

One role outside attention: `mlp-down`, the down projection of a gated MLP (SwiGLU, GeGLU:
down(act(gate(x)) * up(x))): a weighted MatMul whose input is a Mul of a projection's output
(up) and a non-linear function of another projection (gate). Its input is where a decoder's
activation outliers are largest (SmolLM2-135M W8A8 with SmoothQuant: +13.8% perplexity, +3.2%
with these inputs left float; benchmarks/README.md, "W8A8"), so recipes can treat it apart.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import TensorProto

from qtool.plan.graph import GraphIndex

ATTENTION_ROLES = (
    "attention-q",  # the projection that feeds the scores MatMul's first input (queries)
    "attention-k",  # the projection that feeds its second input (keys, often transposed)
    "attention-v",  # the projection that feeds the context MatMul's second input (values)
    "attention-scores",  # Q Kᵀ: both inputs activations, its output reaches a Softmax
    "attention-context",  # softmax(scores) V
)
MLP_ROLES = ("mlp-down",)  # a gated MLP's down projection: down(act(gate(x)) * up(x))
ROLES = (*ATTENTION_ROLES, *MLP_ROLES)

# Element-wise ops that compose a gate's activation function (SiLU = x * sigmoid(x), GELU through
# Erf or a Tanh polynomial), and those among them that make it non-linear.
_GATE_STEPS = frozenset(
    {"Sigmoid", "Tanh", "Erf", "Gelu", "Relu", "Softplus", "HardSigmoid", "HardSwish", "Mul",
     "Add", "Div", "Pow", "Sqrt", "Cast", "Identity"}
)  # fmt: skip
_NONLINEAR = frozenset(
    {"Sigmoid", "Tanh", "Erf", "Gelu", "Relu", "Softplus", "HardSigmoid", "HardSwish"}
)
_GATE_DEPTH = 12

# Ops between a projection and the attention MatMuls: layout, scaling, masking, bias, RoPE.
_THROUGH = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Neg",
        "Reshape",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Slice",
        "Split",
        "Concat",
        "Expand",
        "Cast",
        "Identity",
        "Where",
        "Dropout",
        "Sqrt",
    }
)
_MATMULS = frozenset({"MatMul", "Gemm"})
# The longest path walked from an attention MatMul back to a projection (RoPE adds ~10 nodes).
_MAX_DEPTH = 24


def _weighted(node: onnx.NodeProto, graph: GraphIndex) -> bool:
    weight = node.input[1] if len(node.input) > 1 else ""
    return node.op_type in _MATMULS and graph.is_float_constant(weight)


def _projections(tensor: str, graph: GraphIndex) -> list[str]:
    """Names of the weighted MatMul/Gemm nodes whose outputs reach `tensor` through _THROUGH."""
    found: dict[str, None] = {}
    seen: set[str] = set()
    frontier = [(tensor, 0)]
    while frontier:
        name, depth = frontier.pop()
        producer = graph.producer.get(name)
        if producer is None or producer.name in seen or depth > _MAX_DEPTH:
            continue
        seen.add(producer.name)
        if producer.op_type in _MATMULS:
            if _weighted(producer, graph):
                found.setdefault(producer.name)
            continue
        if producer.op_type not in _THROUGH:
            continue
        frontier.extend((i, depth + 1) for i in producer.input if graph.is_float_activation(i))
    return list(found)


def _two_activations(node: onnx.NodeProto, graph: GraphIndex) -> bool:
    return (
        node.op_type == "MatMul"
        and len(node.input) == 2
        and all(graph.is_float_activation(i) for i in node.input)
    )


def _back_to(tensor: str, graph: GraphIndex, wanted: str) -> onnx.NodeProto | None:
    """The first node of type `wanted` behind `tensor`, walking back through single-activation
    steps of _THROUGH (a mask Add, a scale Div)."""
    for _ in range(_MAX_DEPTH):
        producer = graph.producer.get(tensor)
        if producer is None:
            return None
        if producer.op_type == wanted:
            return producer
        if producer.op_type not in _THROUGH:
            return None
        inputs = [i for i in producer.input if graph.is_float_activation(i)]
        if not inputs:
            return None
        tensor = inputs[0]
    return None


def _forward_to_matmul(tensor: str, graph: GraphIndex) -> list[onnx.NodeProto]:
    """MatMuls that read `tensor` (through _THROUGH steps) as their first input."""
    found = []
    frontier = [(tensor, 0)]
    while frontier:
        name, depth = frontier.pop()
        if depth > _MAX_DEPTH:
            continue
        for consumer in graph.consumers.get(name, []):
            if consumer.op_type == "MatMul" and consumer.input[0] == name:
                found.append(consumer)
            elif consumer.op_type in _THROUGH:
                frontier.extend((out, depth + 1) for out in consumer.output if out)
    return found


def _gate_projections(tensor: str, graph: GraphIndex) -> set[str]:
    """Weighted MatMul/Gemm nodes that reach `tensor` through a gate activation's element-wise
    steps, on a path that passes at least one non-linear op."""
    found: set[str] = set()
    seen: set[tuple[str, bool]] = set()
    frontier = [(tensor, 0, False)]
    while frontier:
        name, depth, nonlinear = frontier.pop()
        producer = graph.producer.get(name)
        if producer is None or depth > _GATE_DEPTH or (producer.name, nonlinear) in seen:
            continue
        seen.add((producer.name, nonlinear))
        if producer.op_type in _MATMULS:
            if nonlinear and _weighted(producer, graph):
                found.add(producer.name)
            continue
        if producer.op_type not in _GATE_STEPS:
            continue
        passed = nonlinear or producer.op_type in _NONLINEAR
        frontier.extend(
            (i, depth + 1, passed) for i in producer.input if graph.is_float_activation(i)
        )
    return found


def _gated_down_projections(graph: GraphIndex) -> list[str]:
    """Weighted MatMuls whose input is up(x) * act(gate(x)), up and gate two other projections."""
    found = []
    for node in graph.nodes:
        if not _weighted(node, graph):
            continue
        product = graph.producer.get(node.input[0])
        if product is None or product.op_type != "Mul" or len(product.input) != 2:
            continue
        if not all(graph.is_float_activation(i) for i in product.input):
            continue
        for up_side, gate_side in ((0, 1), (1, 0)):
            up = graph.producer.get(product.input[up_side])
            if up is None or not _weighted(up, graph):
                continue
            if _gate_projections(product.input[gate_side], graph) - {up.name, node.name}:
                found.append(node.name)
                break
    return found


def float_tensors_of(model: onnx.ModelProto) -> set[str]:
    """The tensors the model declares FP32 (inputs, value_info, outputs: a prepared model has
    its shapes inferred), for callers that have no float-tensor set of their own."""
    graph = model.graph
    infos = list(graph.input) + list(graph.value_info) + list(graph.output)
    return {
        info.name
        for info in infos
        if info.type.HasField("tensor_type")
        and info.type.tensor_type.elem_type == TensorProto.FLOAT
    }


def node_roles(model: onnx.ModelProto, float_tensors: Iterable[str]) -> dict[str, set[str]]:
    """Node name -> the roles it plays (ROLES; nodes with none are left out)."""
    graph = GraphIndex(model, set(float_tensors))
    roles: dict[str, set[str]] = {}

    def add(names: Iterable[str], role: str) -> None:
        for name in names:
            roles.setdefault(name, set()).add(role)

    for softmax in (n for n in graph.nodes if n.op_type == "Softmax"):
        scores = _back_to(softmax.input[0], graph, "MatMul")
        if scores is None or not _two_activations(scores, graph):
            continue
        contexts = [
            m for m in _forward_to_matmul(softmax.output[0], graph) if _two_activations(m, graph)
        ]
        if not contexts:
            continue
        add([scores.name], "attention-scores")
        add(_projections(scores.input[0], graph), "attention-q")
        add(_projections(scores.input[1], graph), "attention-k")
        for context in contexts:
            add([context.name], "attention-context")
            add(_projections(context.input[1], graph), "attention-v")
    add(_gated_down_projections(graph), "mlp-down")
    return roles
