"""A placement check for `target: tensorrt`, built from TensorRT's documented rules.

qtool has no TensorRT engine to read here (runtime/tensorrt_engine.py builds one where the
`tensorrt` package and a GPU are present), so it does not claim to know what TensorRT runs. What
it can say honestly is whether the file follows the rules TensorRT documents for explicitly
quantized, strongly typed ONNX models ("Working with Quantized Types", "Strongly Typed
Networks" in TensorRT's developer guide; onnx-tensorrt's operator support matrix):

- Q/DQ types: QuantizeLinear outputs INT8 or FP8 (E4M3), DequantizeLinear takes INT8, FP8 or
  INT4; no UINT8, no INT32 (so no int32 bias behind a DequantizeLinear);
- symmetric quantization: every zero point is 0;
- scales are positive (and finite);
- activations are quantized per tensor; weights per channel along the output-channel axis
  (Conv 0, ConvTranspose 1, MatMul's [K, N] weight N, Gemm's by transB), or in blocks along the
  reduction axis (INT4);
- weight-only quantization is INT4 only; a weighted op's quantized input and weight share one
  type (INT8 with INT8, FP8 with FP8), which is what TensorRT fuses into one kernel;
- the strong typing: in a model written with a low float type every float op computes in it
  unless the report gives the reason it does not, and a Cast stands only at a graph input or
  output or beside such a node.

Each finding names the rule, the node and what breaks it. The report states the basis in words:
checked against TensorRT's rules, not built by TensorRT here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

BASIS = "checked against TensorRT's documented rules, not built by TensorRT here"

_Q_OUT = {TensorProto.INT8, TensorProto.FLOAT8E4M3FN}
_DQ_IN = _Q_OUT | {TensorProto.INT4}
_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
_QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class Finding:
    rule: str
    node: str
    detail: str

    def to_dict(self) -> dict:
        return {"rule": self.rule, "node": self.node, "detail": self.detail}


@dataclass
class _Graph:
    """The lookups every rule needs, built once."""

    model: onnx.ModelProto
    explained: Mapping[str, str]  # node -> why it computes in FP32 (typing records)
    float_type: str  # fp32, fp16, bf16
    nodes: list[onnx.NodeProto] = field(init=False)
    initializers: dict[str, onnx.TensorProto] = field(init=False)
    producer: dict[str, onnx.NodeProto] = field(init=False)
    consumers: dict[str, list[onnx.NodeProto]] = field(init=False)
    types: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        graph = self.model.graph
        self.nodes = list(graph.node)
        self.initializers = {i.name: i for i in graph.initializer}
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.consumers = {}
        for node in self.nodes:
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        inferred = onnx.shape_inference.infer_shapes(_skeleton(self.model), strict_mode=False)
        infos = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
        self.types = {
            i.name: i.type.tensor_type.elem_type
            for i in infos
            if i.type.HasField("tensor_type") and i.type.tensor_type.elem_type
        }
        self.graph_inputs = {i.name for i in graph.input}
        self.graph_outputs = {o.name for o in graph.output}

    def array(self, name: str) -> np.ndarray | None:
        init = self.initializers.get(name)
        return None if init is None else numpy_helper.to_array(init)

    def of(self, op_types: tuple[str, ...]) -> list[onnx.NodeProto]:
        return [n for n in self.nodes if n.op_type in op_types]


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with initializers as typed inputs, for type inference without copying data."""
    graph = model.graph
    inputs = list(graph.input)
    known = {i.name for i in inputs}
    for init in graph.initializer:
        if init.name not in known:
            inputs.append(
                onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    skeleton = onnx.helper.make_graph(list(graph.node), graph.name, inputs, list(graph.output))
    skeleton.value_info.extend(graph.value_info)
    probe = onnx.helper.make_model(skeleton, opset_imports=list(model.opset_import))
    probe.ir_version = model.ir_version
    return probe


def _name(elem: int | None) -> str:
    return "unknown" if not elem else TensorProto.DataType.Name(elem)


def _quantized_type(node: onnx.NodeProto, g: _Graph) -> int | None:
    """The integer/float8 type a Q writes or a DQ reads (its zero point's, else the data's)."""
    if len(node.input) > 2 and node.input[2]:
        zero = g.initializers.get(node.input[2])
        if zero is not None:
            return zero.data_type
    if node.op_type == "DequantizeLinear":
        data = g.initializers.get(node.input[0])
        if data is not None:
            return data.data_type
        return g.types.get(node.input[0])
    return TensorProto.UINT8  # ONNX's default when a QuantizeLinear has no zero point


def _types(g: _Graph) -> tuple[int, list[Finding]]:
    found = []
    nodes = g.of(_QDQ)
    for node in nodes:
        elem = _quantized_type(node, g)
        allowed = _Q_OUT if node.op_type == "QuantizeLinear" else _DQ_IN
        if elem not in allowed:
            names = ", ".join(sorted(_name(t) for t in allowed))
            found.append(
                Finding(
                    "qdq-types",
                    node.name,
                    f"{_name(elem)}; TensorRT's {node.op_type} takes {names}",
                )
            )
    return len(nodes), found


def _zero_points(g: _Graph) -> tuple[int, list[Finding]]:
    found = []
    nodes = g.of(_QDQ)
    for node in nodes:
        if len(node.input) < 3 or not node.input[2]:
            continue
        zero = g.array(node.input[2])
        if zero is None:
            found.append(Finding("zero-point", node.name, "the zero point is not a constant"))
        elif np.any(zero.astype(np.float32) != 0):
            found.append(
                Finding(
                    "zero-point",
                    node.name,
                    f"zero point {zero.reshape(-1)[0]!r}: TensorRT quantizes symmetrically",
                )
            )
    return len(nodes), found


def _scales(g: _Graph) -> tuple[int, list[Finding]]:
    found = []
    nodes = g.of(_QDQ)
    for node in nodes:
        scale = g.array(node.input[1])
        if scale is None:
            found.append(Finding("positive-scale", node.name, "the scale is not a constant"))
            continue
        values = scale.astype(np.float32)
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            found.append(
                Finding("positive-scale", node.name, f"smallest scale {float(values.min()):g}")
            )
    return len(nodes), found


# Weighted ops: the weight input and its output-channel axis (Gemm: by transB).
_WEIGHTED = {"Conv": 1, "ConvTranspose": 1, "MatMul": 1, "Gemm": 1}


def _output_axis(node: onnx.NodeProto, rank: int) -> int:
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    return rank - 1  # MatMul: [..., K, N]


def _reduction_axis(node: onnx.NodeProto, rank: int) -> int:
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 1 if trans_b else 0
    if node.op_type in ("Conv", "ConvTranspose"):
        return 1
    return rank - 2


def _dq_of(name: str, g: _Graph) -> onnx.NodeProto | None:
    producer = g.producer.get(name)
    return producer if producer is not None and producer.op_type == "DequantizeLinear" else None


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 1)


def _granularity(g: _Graph) -> tuple[int, list[Finding]]:
    found = []
    checked = 0
    weighted_inputs = set()
    for node in g.of(tuple(_WEIGHTED)):
        index = _WEIGHTED[node.op_type]
        if len(node.input) <= index:
            continue
        dq = _dq_of(node.input[index], g)
        if dq is None or dq.input[0] not in g.initializers:
            continue
        weighted_inputs.add(dq.name)
        checked += 1
        rank = len(g.initializers[dq.input[0]].dims)
        scale = g.array(dq.input[1])
        if scale is None or scale.size <= 1:
            continue
        axis = _axis(dq) % rank
        if scale.ndim == rank:  # blocked
            want = _reduction_axis(node, rank)
            if axis != want:
                found.append(
                    Finding(
                        "weight-axis",
                        dq.name,
                        f"blocks along axis {axis}; TensorRT blocks {node.op_type} weights along "
                        f"the reduction axis {want}",
                    )
                )
            continue
        want = _output_axis(node, rank)
        if axis != want:
            found.append(
                Finding(
                    "weight-axis",
                    dq.name,
                    f"per-channel scales on axis {axis}; TensorRT wants the output-channel axis "
                    f"{want} of {node.op_type} '{node.name}'",
                )
            )
    for dq in g.of(("DequantizeLinear",)):
        if dq.name in weighted_inputs or dq.input[0] in g.initializers:
            continue
        checked += 1
        scale = g.array(dq.input[1])
        if scale is not None and scale.size > 1:
            found.append(
                Finding(
                    "activation-per-tensor",
                    dq.name,
                    f"{scale.size} scales on an activation; TensorRT quantizes activations per "
                    "tensor",
                )
            )
    return checked, found


def _pairs(g: _Graph) -> tuple[int, list[Finding]]:
    """Weight-only is INT4 only; a quantized input and weight of one op share one type."""
    found = []
    checked = 0
    for node in g.of(tuple(_WEIGHTED)):
        index = _WEIGHTED[node.op_type]
        if len(node.input) <= index:
            continue
        weight_dq = _dq_of(node.input[index], g)
        if weight_dq is None:
            continue
        checked += 1
        weight_type = _quantized_type(weight_dq, g)
        data_dq = _dq_of(node.input[0], g)
        if data_dq is None:
            if weight_type != TensorProto.INT4:
                found.append(
                    Finding(
                        "weight-only-int4",
                        node.name,
                        f"{_name(weight_type)} weight on float activations: TensorRT's "
                        "weight-only quantization is INT4",
                    )
                )
            continue
        data_type = _quantized_type(data_dq, g)
        if data_type != weight_type:
            found.append(
                Finding(
                    "matching-types",
                    node.name,
                    f"input {_name(data_type)} with weight {_name(weight_type)}: TensorRT fuses "
                    "a quantized input and weight of one type",
                )
            )
    return checked, found


def _computes_in(node: onnx.NodeProto, g: _Graph) -> int | None:
    """The float type a node writes (None: no float output; a Shape of an FP32 graph input
    computes nothing in FP32)."""
    for name in node.output:
        elem = g.types.get(name)
        if elem in _FLOATS:
            return elem
    return None


def _typing(g: _Graph) -> tuple[int, list[Finding]]:
    """In a model written with a low float type: every float op in it unless explained, and
    every Cast at a graph boundary or beside an explained (FP32) node."""
    if g.float_type == "fp32":
        return 0, []
    low = TensorProto.FLOAT16 if g.float_type == "fp16" else TensorProto.BFLOAT16
    found = []
    checked = 0
    for node in g.nodes:
        if node.op_type in _QDQ or node.op_type == "Cast":
            continue
        elem = _computes_in(node, g)
        if elem is None:
            continue
        checked += 1
        if elem != low and node.name not in g.explained:
            found.append(
                Finding(
                    "strong-typing",
                    node.name,
                    f"{node.op_type} computes in {_name(elem)} in a {g.float_type} model, and "
                    "report.json gives no reason",
                )
            )
    for cast in g.of(("Cast",)):
        checked += 1
        if _cast_allowed(cast, g):
            continue
        found.append(
            Finding(
                "strong-typing",
                cast.name,
                f"a Cast of '{cast.input[0]}' between two {g.float_type} ops: Casts belong at "
                "graph inputs and outputs and beside the nodes kept FP32",
            )
        )
    return checked, found


def _cast_allowed(cast: onnx.NodeProto, g: _Graph) -> bool:
    source, out = cast.input[0], cast.output[0]
    if source in g.graph_inputs or out in g.graph_outputs or source in g.initializers:
        return True
    if cast.name in g.explained or g.types.get(source) not in _FLOATS:
        return True  # a Cast the report explains, or a model's own (int -> float)
    neighbours = [g.producer.get(source), *g.consumers.get(out, [])]
    return any(
        node is not None and (node.name in g.explained or node.op_type in _QDQ)
        for node in neighbours
    )


@dataclass(frozen=True)
class TrtRule:
    """One documented TensorRT rule: its name, what it checks in words, and the check (the
    number of things checked and the findings)."""

    name: str
    checks: str
    run: Callable[[_Graph], tuple[int, list[Finding]]]


TRT_RULES: tuple[TrtRule, ...] = (
    TrtRule(
        "qdq-types",
        "QuantizeLinear writes INT8 or FP8 E4M3, DequantizeLinear reads INT8, FP8 E4M3 or INT4 "
        "(no UINT8, no INT32)",
        _types,
    ),
    TrtRule("zero-point", "every zero point is 0 (symmetric quantization)", _zero_points),
    TrtRule("positive-scale", "every scale is positive and finite", _scales),
    TrtRule(
        "granularity",
        "activations per tensor; weights per channel on the output-channel axis, or INT4 blocks "
        "along the reduction axis",
        _granularity,
    ),
    TrtRule(
        "pairs",
        "weight-only quantization is INT4; a weighted op's quantized input and weight share one "
        "type",
        _pairs,
    ),
    TrtRule(
        "strong-typing",
        "in a model written FP16/BF16, every float op computes in that type unless report.json "
        "says why not, and Casts stand only at graph inputs/outputs or beside such nodes",
        _typing,
    ),
)


def check_placement(model: onnx.ModelProto, explained: Mapping[str, str], float_type: str) -> dict:
    """The report's `tensorrt.placement` block: per rule what was checked and what broke it.
    `explained`: node -> why it computes in FP32, or why a Cast stands where it does (the typing
    pass's records); `float_type`: the model's (fp32, fp16, bf16)."""
    graph = _Graph(model, explained, float_type)
    rules = []
    findings: list[Finding] = []
    for rule in TRT_RULES:
        checked, found = rule.run(graph)
        rules.append(
            {"rule": rule.name, "checks": rule.checks, "checked": checked, "violations": len(found)}
        )
        findings.extend(found)
    return {
        "basis": BASIS,
        "passed": not findings,
        "rules": rules,
        "violations": [f.to_dict() for f in findings],
    }
