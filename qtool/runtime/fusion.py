"""What ONNX Runtime's CPU provider really runs for each node qtool quantized.

A QDQ model only states an intention: ORT's graph optimizer decides, at session creation, which
DQ -> op -> Q groups become integer kernels (QLinearConv, QGemm, MatMulIntegerToFloat, ...) and
which stay DequantizeLinear -> float op. qtool's report must show the outcome, so this module
creates the session exactly as qtool's own sessions do (ort_session: CPU provider, ORT_ENABLE_ALL),
has ORT save the graph it optimized, and reads that graph back.

Mapping a planned node to the ORT node that executes it (see `fusion_truth`) relies on three facts
measured on ORT 1.31 and true of its graph transformers in general:

1. The QDQ fusions (QDQSelectorActionTransformer) create the fused node under the target node's
   own name: Conv -> QLinearConv, Gemm -> QGemm, MatMul -> QLinearMatMul / MatMulIntegerToFloat /
   MatMulNBits, Add -> QLinearAdd ... all keep the name, and so do float-side fusions such as
   Conv + Relu -> FusedConv.
2. When a later transformer replaces a node again, ORT names the replacement with
   `Graph::GenerateNodeName(old name)`, i.e. the old name plus `_token_<n>`: the NHWC layout
   transform turns QLinearConv `/stem/Conv` into com.microsoft QLinearConv `/stem/Conv_token_1`
   and renames the tensors around it (`Transpose_out0`, ...), so tensor names cannot be trusted
   there but the node name can.
3. Where the name is gone, data flow still identifies the node: a fused node reads the int8
   weight initializer qtool wrote for exactly that node (`{weight}_quantized`; MatMulNBits reads
   it transposed as `{weight}_quantized_T`), and it writes the node's output tensor or the output
   of the QuantizeLinear that it absorbed (possibly through an inserted Transpose).

So a node is looked up by exact name, then by name + `_token_<n>` suffixes, then by the weights it
reads and the tensors it writes; a node found by none of them was removed by ORT. Subgraphs
(If/Loop bodies) are not searched: qtool does not quantize inside them.

The reason a node stayed float is worked out by replaying the checks of ORT's QDQ node-group
selectors (qdq_selectors.cc) on the QDQ model (structure: which inputs come from a
DequantizeLinear, what consumes the output) and on ORT's optimized graph (data types, after ORT's
own int8 -> uint8 rewrite). When no check explains it, the reason is None rather than a guess.
What each op's selector checks, and which ORT kernels compute on integers, is the op registry's
(qtool/plan/ops/: each rule's `ort` and `output_quantized`, the ort-cpu target's kernels), the
same rule objects the layout placed the QDQ pairs by; this module holds no table of op types.
"""

from __future__ import annotations

import math
import platform
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
from onnx import TensorProto, numpy_helper

from qtool.errors import ModelError
from qtool.ort.sessions import create_session
from qtool.plan.ops import find_rule
from qtool.plan.ops.registry import NO_FUSION, OrtFusion, float_weight_op_types
from qtool.plan.ops.targets import ORT_CPU

if TYPE_CHECKING:
    import onnxruntime

FUSED = "fused"
FLOAT = "float"
REMOVED = "removed"

_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
# Nodes that layout transforms insert around the node that does the work.
_LAYOUT_OPS = frozenset({"Transpose", "ReorderInput", "ReorderOutput"})
_INT_RANGES = {
    TensorProto.UINT8: (0, 255),
    TensorProto.INT8: (-128, 127),
    TensorProto.UINT16: (0, 65535),
    TensorProto.INT16: (-32768, 32767),
}
_NARROW_TYPES = {TensorProto.INT16, TensorProto.UINT16, TensorProto.INT4, TensorProto.UINT4}


@dataclass(frozen=True)
class NodeRuntime:
    """What ORT does with one planned node.

    `status`: "fused" (an integer kernel runs it), "float" (DequantizeLinear -> float op) or
    "removed" (ORT dropped it). `runs_as` is the ORT op type that executes it, `ort_node` that
    node's name in ORT's optimized graph, `reason` why it stayed float or was removed (None when
    fused, or when no known ORT rule explains it).
    """

    op_type: str
    status: str
    runs_as: str | None
    ort_node: str | None
    reason: str | None

    def to_dict(self) -> dict:
        return {
            "op_type": self.op_type,
            "status": self.status,
            "runs_as": self.runs_as,
            "ort_node": self.ort_node,
            "reason": self.reason,
        }


class _Index:
    """Producer/consumer/initializer lookups over one graph, built once."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.nodes = list(graph.node)
        self.order = {id(node): index for index, node in enumerate(self.nodes)}
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_outputs = {o.name for o in graph.output}
        self.value_types: dict[str, int] = {}
        for info in list(graph.input) + list(graph.value_info) + list(graph.output):
            if info.type.HasField("tensor_type"):
                self.value_types[info.name] = info.type.tensor_type.elem_type
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        self.by_name: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            self.by_name.setdefault(node.name, []).append(node)
            for out in node.output:
                if out:
                    self.producer[out] = node
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)

    def dq_producer(self, tensor: str) -> onnx.NodeProto | None:
        node = self.producer.get(tensor)
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    def quantized_type(self, tensor: str) -> int | None:
        """Element type of an integer tensor: an initializer's, or the zero point's of its Q."""
        if tensor in self.initializers:
            return self.initializers[tensor].data_type
        producer = self.producer.get(tensor)
        if producer is not None and producer.op_type == "QuantizeLinear":
            if len(producer.input) > 2 and producer.input[2]:
                return self.quantized_type(producer.input[2])
            return TensorProto.UINT8  # ONNX default when the zero point is omitted
        return self.value_types.get(tensor)

    def scalar(self, tensor: str) -> float | None:
        init = self.initializers.get(tensor)
        if init is None:
            return None
        values = numpy_helper.to_array(init)
        return float(values.reshape(-1)[0]) if values.size == 1 else None


# Loading


def _load_structure(model: bytes | Path, what: str) -> onnx.ModelProto:
    """The graph without external weight data: fusion depends on structure and dtypes only."""
    try:
        if isinstance(model, bytes):
            return onnx.load_model_from_string(model)
        path = Path(model)
        if not path.is_file():
            raise ModelError(f"{what} {path} does not exist")
        return onnx.load(str(path), load_external_data=False)
    except ModelError:
        raise
    except Exception as exc:  # protobuf raises DecodeError and friends for a corrupt file
        name = "<in-memory model>" if isinstance(model, bytes) else str(model)
        raise ModelError(f"{what} {name} is not a readable ONNX model: {exc}") from None


@dataclass
class OptimizedSession:
    """A session with qtool's settings and the graph ORT optimized for it, from one load: the
    verify stage reads what ORT runs and runs it, where it used to load the model three times."""

    session: onnxruntime.InferenceSession
    # Structure only: initializers of 1 MB or more are external references without their data
    # (fusion depends on node types, names and dtypes; the scalars it reads are small).
    graph: onnx.ModelProto


def optimized_session(
    model: bytes | Path,
    threads: int = 1,
    config: dict[str, str] | None = None,
    arena: bool = True,
) -> OptimizedSession:
    """`model` loaded the way ORT's CPU provider runs it, and the graph it runs.

    Uses the same options as every qtool session (ORT_ENABLE_ALL, sequential, deterministic), so
    the fusions seen here are the ones `qtool evaluate` measures. The graph may contain
    com.microsoft ops (QLinearConv with channels_last, QGemm, ...) and the Transposes of ORT's
    NHWC layout transform; it is hardware specific (ORT warns so when saving) and is meant to be
    read, not shipped. ORT saves it to a temporary folder, large initializers to a side file
    that is never read back (models over 2 GB can be saved too; the weights are not copied).
    `arena=False`: create_session's, for a session that is not timed."""
    with tempfile.TemporaryDirectory(prefix="qtool-ort-") as folder:
        target = Path(folder) / "optimized.onnx"
        session = create_session(
            model, threads=threads, config=config, save_optimized=target, arena=arena
        )
        if not target.is_file():
            name = "<in-memory model>" if isinstance(model, bytes) else str(model)
            raise ModelError(f"ONNX Runtime did not save the optimized graph of {name}")
        graph = onnx.load(str(target), load_external_data=False)
    return OptimizedSession(session, graph)


def optimized_graph(
    model: bytes | Path, threads: int = 1, config: dict[str, str] | None = None
) -> onnx.ModelProto:
    """The graph ORT's CPU provider runs (optimized_session's, structure only)."""
    return optimized_session(model, threads, config).graph


# Mapping planned nodes to ORT nodes


def _name_candidates(name: str, ort: _Index) -> list[onnx.NodeProto]:
    if not name:
        return []
    exact = [n for n in ort.by_name.get(name, []) if n.op_type not in _QDQ_OPS]
    if exact:
        return exact
    # Float-side activation fusions (Gemm + Relu -> FusedGemm) name the new node "fused <name>".
    fused = [n for n in ort.by_name.get(f"fused {name}", []) if n.op_type not in _QDQ_OPS]
    if fused:
        return fused
    generated = re.compile(re.escape(name) + r"(?:_token_\d+)+")
    return [
        n
        for n in ort.nodes
        if generated.fullmatch(n.name) and n.op_type not in _QDQ_OPS | _LAYOUT_OPS
    ]


def _weight_initializers(node: onnx.NodeProto, qdq: _Index) -> list[str]:
    """The integer initializers behind the node's DequantizeLinear inputs (weights, biases)."""
    names = []
    for tensor in node.input:
        dq = qdq.dq_producer(tensor) if tensor else None
        if dq is not None and dq.input[0] in qdq.initializers:
            names.append(dq.input[0])
    return names


def _written_tensors(node: onnx.NodeProto, qdq: _Index) -> set[str]:
    """The node's outputs and the outputs of the QuantizeLinear nodes that read them."""
    tensors = {out for out in node.output if out}
    for out in list(tensors):
        for consumer in qdq.consumers.get(out, []):
            if consumer.op_type == "QuantizeLinear":
                tensors.add(consumer.output[0])
    return tensors


def _structural_candidates(node: onnx.NodeProto, qdq: _Index, ort: _Index) -> list[onnx.NodeProto]:
    weights = _weight_initializers(node, qdq)
    readers: dict[int, tuple[int, onnx.NodeProto]] = {}
    for candidate in ort.nodes:
        if candidate.op_type in _QDQ_OPS:
            continue
        score = 0
        for tensor in candidate.input:
            for weight in weights:
                if tensor == weight:
                    score += 2
                elif tensor.startswith(weight + "_"):  # e.g. MatMulNBits' transposed copy
                    score += 1
        if score:
            readers[id(candidate)] = (score, candidate)
    writers: dict[int, onnx.NodeProto] = {}
    for tensor in _written_tensors(node, qdq):
        producer = ort.producer.get(tensor)
        seen = 0
        while producer is not None and producer.op_type in _LAYOUT_OPS and seen < 8:
            producer = ort.producer.get(producer.input[0])
            seen += 1
        if producer is not None and producer.op_type not in _QDQ_OPS | _LAYOUT_OPS:
            writers[id(producer)] = producer
    both = [readers[key] for key in readers if key in writers]
    if both:
        ranked = both
    elif readers:
        ranked = list(readers.values())
    else:
        ranked = [(0, n) for n in writers.values()]
    ranked.sort(key=lambda item: (-item[0], ort.order[id(item[1])]))
    return [n for _, n in ranked]


def _find_ort_node(node: onnx.NodeProto, qdq: _Index, ort: _Index) -> onnx.NodeProto | None:
    candidates = _name_candidates(node.name, ort) or _structural_candidates(node, qdq, ort)
    return candidates[0] if candidates else None


# Why a node stayed float


def _ort_fusion(op_type: str) -> OrtFusion:
    """How ORT's QDQ fusion treats `op_type`, from its rule (none: no rule, no fusion)."""
    rule = find_rule(op_type)
    return rule.ort if rule is not None else NO_FUSION


def _is_clamp(node: onnx.NodeProto) -> bool:
    """Relu / Clip: ORT drops one between an op and a QuantizeLinear that clamps as much."""
    rule = find_rule(node.op_type)
    return rule is not None and rule.folds is not None


def _required_dq_inputs(node: onnx.NodeProto) -> list[int]:
    """Input slots ORT's selector wants fed by a DequantizeLinear for this op."""
    present = [i for i, name in enumerate(node.input) if name]
    wanted = _ort_fusion(node.op_type).dq_inputs
    return present if wanted is None else [i for i in present if i in wanted]


def _type_name(elem: int | None) -> str:
    return TensorProto.DataType.Name(elem).lower() if elem is not None else "unknown"


def _missing_dq_reason(node: onnx.NodeProto, qdq: _Index) -> str | None:
    fusion = _ort_fusion(node.op_type)
    for index in _required_dq_inputs(node):
        tensor = node.input[index]
        if qdq.dq_producer(tensor) is not None:
            continue
        constant = qdq.initializers.get(tensor)
        is_float_constant = constant is not None and constant.data_type == TensorProto.FLOAT
        weight_or_bias = index in (fusion.weight_input, fusion.bias_input)
        if fusion.quantizes_float_weights and weight_or_bias and is_float_constant:
            continue  # ORT's WeightBiasQuantization quantizes float constant weights itself
        if index == fusion.weight_input:
            return (
                f"weights '{tensor}' are not a constant int8/uint8 DequantizeLinear "
                f"(ORT quantizes only float constant {'/'.join(float_weight_op_types())} "
                "weights itself)"
            )
        if index == fusion.bias_input:
            return f"bias '{tensor}' is not produced by an int32 DequantizeLinear"
        return f"input '{tensor}' is not produced by a DequantizeLinear"
    return None


def _clip_bounds(clip: onnx.NodeProto, qdq: _Index) -> tuple[float, float] | None:
    if clip.op_type == "Relu":
        return 0.0, math.inf
    low, high = -math.inf, math.inf
    for attr in clip.attribute:  # opset < 11 keeps the bounds as attributes
        if attr.name == "min":
            low = attr.f
        elif attr.name == "max":
            high = attr.f
    for index, name in ((1, "min"), (2, "max")):
        if len(clip.input) > index and clip.input[index]:
            value = qdq.scalar(clip.input[index])
            if value is None:
                return None
            low, high = (value, high) if name == "min" else (low, value)
    return low, high


def _clip_redundant(clip: onnx.NodeProto, quant: onnx.NodeProto, qdq: _Index) -> tuple[bool, str]:
    """Whether the QuantizeLinear clamps at least as much as the Relu/Clip (ORT then drops it)."""
    bounds = _clip_bounds(clip, qdq)
    scale = qdq.scalar(quant.input[1])
    zero_name = quant.input[2] if len(quant.input) > 2 else ""
    zero = qdq.scalar(zero_name) if zero_name else 0.0
    elem = qdq.quantized_type(zero_name) if zero_name else TensorProto.UINT8
    if bounds is None or scale is None or zero is None or elem not in _INT_RANGES:
        return False, "with non-constant bounds or quantization parameters"
    q_min, q_max = _INT_RANGES[elem]
    low, high = (q_min - zero) * scale, (q_max - zero) * scale
    redundant = bounds[0] <= low and bounds[1] >= high
    detail = (
        f"whose {_type_name(elem)} zero point {int(zero)} lets through [{low:g}, {high:g}], "
        f"wider than the {clip.op_type}'s [{bounds[0]:g}, {bounds[1]:g}]"
    )
    return redundant, detail


def _only_quantized_in_ort(ort_node: onnx.NodeProto, ort: _Index) -> bool:
    """True when ORT's graph has the node's output read by QuantizeLinear nodes only: ORT's QDQ
    propagation moves a QuantizeLinear up through Reshape/Transpose, so the QDQ model alone can
    show no QuantizeLinear where ORT saw one."""
    out = ort_node.output[0] if ort_node.output else ""
    consumers = ort.consumers.get(out, [])
    return (
        bool(consumers)
        and out not in ort.graph_outputs
        and all(c.op_type == "QuantizeLinear" for c in consumers)
    )


def _output_reason(
    node: onnx.NodeProto, ort_node: onnx.NodeProto, qdq: _Index, ort: _Index
) -> str | None:
    op = node.op_type
    rule = find_rule(op)
    fused_form = _ort_fusion(op).form or "a QLinear op"
    out = node.output[0]
    consumers = qdq.consumers.get(out, [])
    # MatMul and Gemm fuse without a QuantizeLinear on the output (their rules quantize none).
    optional = rule is not None and not rule.output_quantized
    if len(consumers) == 1 and _is_clamp(consumers[0]):
        clip = consumers[0]
        after = qdq.consumers.get(clip.output[0], [])
        if (
            out not in qdq.graph_outputs
            and clip.output[0] not in qdq.graph_outputs
            and len(after) == 1
            and after[0].op_type == "QuantizeLinear"
        ):
            redundant, detail = _clip_redundant(clip, after[0], qdq)
            if redundant:
                return None
            return (
                f"a {clip.op_type} ('{clip.name}') between the {op} and its QuantizeLinear, "
                f"{detail}: ORT fuses only when the QuantizeLinear makes it redundant"
            )
    quants = [c for c in consumers if c.op_type == "QuantizeLinear"]
    others = [c for c in consumers if c.op_type != "QuantizeLinear"]
    if optional and not quants:
        return None
    if out in qdq.graph_outputs:
        return (
            f"its output '{out}' is a graph output, and ORT forms {fused_form} only when a "
            "QuantizeLinear is the output's sole consumer"
        )
    if not quants and _only_quantized_in_ort(ort_node, ort):
        return None
    if not quants:
        if len(others) == 1 and others[0].op_type == "BatchNormalization":
            return (
                f"a BatchNormalization ('{others[0].name}') between the quantized {op} and its "
                "QuantizeLinear"
            )
        return (
            f"its output has no QuantizeLinear, and ORT forms {fused_form} only from "
            f"DQ -> {op} -> Q"
        )
    if others:
        return (
            f"its output also feeds {others[0].op_type} '{others[0].name}' besides the "
            f"QuantizeLinear; ORT fuses only when QuantizeLinear is the sole consumer"
        )
    return None


def _input_types(ort_node: onnx.NodeProto, slots: list[int], ort: _Index) -> dict[int, int | None]:
    types = {}
    for index in slots:
        if index >= len(ort_node.input):
            continue
        dq = ort.dq_producer(ort_node.input[index])
        types[index] = ort.quantized_type(dq.input[0]) if dq is not None else None
    return types


def _output_type(ort_node: onnx.NodeProto, ort: _Index) -> int | None:
    for consumer in ort.consumers.get(ort_node.output[0], []) if ort_node.output else []:
        if _is_clamp(consumer):
            consumer = next(iter(ort.consumers.get(consumer.output[0], [])), consumer)
        if consumer.op_type == "QuantizeLinear":
            return ort.quantized_type(consumer.output[0])
    return None


def _int8_allowed() -> bool:
    """ORT's QDQIsInt8Allowed(): int8 activations fuse into QLinearConv/MatMul only on ARM."""
    return platform.machine().lower() in ("aarch64", "arm64")


def _type_reason(node: onnx.NodeProto, ort_node: onnx.NodeProto, ort: _Index) -> str | None:
    """Replays the dtype checks of ORT's selectors on the graph ORT saw (after s8 -> u8)."""
    op = node.op_type
    if ort_node.op_type in _QDQ_OPS:
        return None
    fusion = _ort_fusion(op)
    slots = _required_dq_inputs(node)
    types = _input_types(ort_node, slots, ort)
    known = [t for t in types.values() if t is not None]
    narrow = [t for t in known if t in _NARROW_TYPES]
    if narrow:
        return f"{_type_name(narrow[0])} quantization has no ORT CPU QLinear kernel for {op}"
    activation = types.get(fusion.activation_input)
    weight = types.get(1)
    if fusion.int8_activations_arm_only and activation == TensorProto.INT8:
        if not _int8_allowed() or weight != TensorProto.INT8:
            dq = ort.dq_producer(ort_node.input[0])
            quant = ort.producer.get(dq.input[0]) if dq is not None else None
            detail = ""
            if quant is not None and quant.op_type == "QuantizeLinear":
                readers = len(ort.consumers.get(quant.output[0], []))
                if readers > 1:
                    detail = (
                        f"; ORT rewrites an int8 Q/DQ pair to uint8 only when its QuantizeLinear "
                        f"feeds one DequantizeLinear, and '{quant.name}' feeds {readers}"
                    )
            return f"activation is int8 (ORT's CPU QLinear ops want uint8){detail}"
    if fusion.same_input_types and len(set(known)) > 1:
        names = " and ".join(sorted({_type_name(t) for t in known}))
        return f"its inputs are quantized to different types ({names})"
    output = _output_type(ort_node, ort)
    if activation is not None and output is not None and activation != output:
        return (
            f"its input is {_type_name(activation)} but its output is quantized to "
            f"{_type_name(output)}; ORT's QLinear ops need one type"
        )
    bias = fusion.bias_input
    if bias is not None and types.get(bias) not in (None, TensorProto.INT32):
        return f"bias is {_type_name(types[bias])}; ORT needs an int32 bias"
    return None


def _float_reason(
    node: onnx.NodeProto, ort_node: onnx.NodeProto, qdq: _Index, ort: _Index
) -> str | None:
    op = node.op_type
    fusion = _ort_fusion(op)
    if fusion.on_integers:
        return (
            f"ORT runs {op} on quantized data only when one DequantizeLinear feeds it and one "
            "QuantizeLinear with the same scale and zero point reads it"
        )
    if not fusion.kernels:
        return f"ORT has no quantized kernel for {op} on the CPU"
    return (
        _missing_dq_reason(node, qdq)
        or _output_reason(node, ort_node, qdq, ort)
        or _type_reason(node, ort_node, ort)
        or (fusion.check(node) if fusion.check is not None else None)
    )


def _runs_quantized(node: onnx.NodeProto, ort_node: onnx.NodeProto, ort: _Index) -> bool:
    kernel = ort_node.op_type
    if kernel in ORT_CPU.integer_kernels or kernel.startswith("QLinear"):
        return True
    if _ort_fusion(node.op_type).on_integers and ort_node.op_type == node.op_type:
        data = ort_node.input[0] if ort_node.input else ""
        elem = ort.quantized_type(data) if data else None
        return elem in _INT_RANGES
    return False


def _planned_node(name: str, op_type: str, qdq: _Index) -> onnx.NodeProto:
    nodes = qdq.by_name.get(name, [])
    if not nodes:
        raise ModelError(f"planned node '{name}' ({op_type}) is not in the quantized model")
    if len(nodes) > 1:
        raise ModelError(f"node name '{name}' is not unique in the quantized model")
    node = nodes[0]
    # The writer may emit another op under the planned name (a 4-bit MatMul as MatMulNBits, an
    # embedding Gather as GatherBlockQuantized): the forms of the op's registry entries.
    rule = find_rule(op_type)
    written_as = rule.written_op_types if rule is not None else frozenset({op_type})
    if node.op_type not in written_as:
        raise ModelError(
            f"planned node '{name}' is a {op_type} in the plan but a {node.op_type} in the "
            "quantized model"
        )
    return node


@dataclass
class Located:
    """Planned nodes of a QDQ (or float) model and the ORT nodes that execute them."""

    qdq: _Index  # the model as written
    ort: _Index  # ORT's optimized graph of it
    planned: dict[str, onnx.NodeProto]  # name -> node in the written model
    found: dict[str, onnx.NodeProto | None]  # name -> ORT node (None: removed)


def locate(
    model: bytes | Path,
    planned: dict[str, str],
    threads: int = 1,
    optimized: onnx.ModelProto | None = None,
) -> Located:
    """Find each planned node (name -> op type) in ORT's optimized graph of `model` by the
    mapping rule of `fusion_truth`; shared by it and the per-node profiler (runtime/profile).
    `optimized`: that graph when the caller has it (optimized_session), else ORT makes it."""
    qdq = _Index(_load_structure(model, "quantized model"))
    nodes = {name: _planned_node(name, op_type, qdq) for name, op_type in planned.items()}
    ort = _Index(optimized if optimized is not None else optimized_graph(model, threads))
    found = {name: _find_ort_node(node, qdq, ort) for name, node in nodes.items()}
    return Located(qdq, ort, nodes, found)


def fusion_truth(
    quantized: bytes | Path,
    planned: dict[str, str],
    threads: int = 1,
    optimized: onnx.ModelProto | None = None,
) -> dict[str, NodeRuntime]:
    """For each planned node (name in qtool's QDQ model -> op type): what ORT's CPU provider runs.

    The mapping rule (module docstring): exact name, then name + ORT's `_token_<n>` suffixes,
    then the ORT node that reads the node's int8 weight initializers and writes its output (or
    the output of the QuantizeLinear it absorbed). It is robust because each of these is an
    identity ORT's transformers preserve: the QDQ actions and float fusions keep the target's
    name, re-created nodes get GenerateNodeName(old name), and no fusion renames the initializers
    it moves into the fused node. Results come back in the order of `planned`.
    """
    located = locate(quantized, planned, threads, optimized)
    qdq, ort = located.qdq, located.ort
    truth: dict[str, NodeRuntime] = {}
    for name, node in located.planned.items():
        found = located.found[name]
        if found is None:
            truth[name] = NodeRuntime(
                node.op_type,
                REMOVED,
                None,
                None,
                "ORT removed it (constant folding or elimination): no node of the optimized "
                "graph has its name, reads its weights or writes its output",
            )
        elif _runs_quantized(node, found, ort):
            truth[name] = NodeRuntime(node.op_type, FUSED, found.op_type, found.name, None)
        else:
            reason = _float_reason(node, found, qdq, ort)
            truth[name] = NodeRuntime(node.op_type, FLOAT, found.op_type, found.name, reason)
    return truth


def fusion_summary(truth: dict[str, NodeRuntime]) -> dict:
    """JSON-ready totals: planned vs fused per op type (and into what), and every unfused node."""
    by_op: dict[str, dict] = {}
    unfused = []
    for name, runtime in truth.items():
        entry = by_op.setdefault(runtime.op_type, {"planned": 0, "fused": 0, "runs_as": {}})
        entry["planned"] += 1
        if runtime.status == FUSED:
            entry["fused"] += 1
        key = runtime.runs_as or REMOVED
        entry["runs_as"][key] = entry["runs_as"].get(key, 0) + 1
        if runtime.status != FUSED:
            unfused.append({"name": name, **runtime.to_dict()})
    for entry in by_op.values():
        entry["runs_as"] = dict(sorted(entry["runs_as"].items()))
    fused = sum(1 for r in truth.values() if r.status == FUSED)
    return {
        "planned": len(truth),
        "fused": fused,
        "float": sum(1 for r in truth.values() if r.status == FLOAT),
        "removed": sum(1 for r in truth.values() if r.status == REMOVED),
        "by_op_type": dict(sorted(by_op.items())),
        "unfused": unfused,
    }
