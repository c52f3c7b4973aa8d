"""The typing pass: the float part of a written model in FP16 or BF16, strongly typed.

TensorRT 11 builds strongly typed networks only: a layer computes in the type its inputs have in
the file, and Q/DQ give INT8 or FP8 where they stand. A QDQ model that is FP32 elsewhere runs
every other op in FP32 there. This pass writes the types into the file: every node asked to
compute in a low type (its plan precision fp16/bf16, or a quantized node in a model whose
`quantization.float_type` is fp16/bf16) gets that type on its float inputs and outputs, its
float constants are stored in it, Q/DQ scales follow the nodes they feed, and Casts go only where
the recipe allows a boundary: graph inputs and outputs keep their types (`float_io: keep`), and
a node the keep rules (write/keep_fp32.py) or the plan keep in FP32 gets Casts around it.

Which input of an op must share the node's type comes from the op's ONNX schema at the model's
opset (its type constraints), not from a table of ops: an input bound to a type parameter that
also types an output, or another input, takes the node's type; an input alone with its
parameter keeps the type it arrives in when the schema allows it (Shape, Pow's exponent); an
input of a fixed type (Resize's scales) keeps that type. An op whose schema has no low form
at this opset stays FP32 (the rule `no-low-type`).

The pass runs last in the build stage, after bias correction: every earlier step measures the
FP32 QDQ model, and this one changes only types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.write.keep_fp32 import NodeFacts, keep_reason, scale_keep_reason

FLOAT = TensorProto.FLOAT
LOW_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
NAMES = {FLOAT: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}
_NUMPY = {
    TensorProto.FLOAT16: np.float16,
    TensorProto.BFLOAT16: ml_dtypes.bfloat16,
    FLOAT: np.float32,
}
_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})
# Ops whose output type is an attribute, not a type parameter bound to an input.
_ATTRIBUTE_TYPED = {"Cast": "to", "Constant": "value", "ConstantOfShape": "value"}


@dataclass(frozen=True)
class TypedNode:
    """What one node computes in: `computes_in` (fp16, bf16, fp32) and, when it was asked for a
    low type and computes in FP32, the rule that kept it and why."""

    computes_in: str
    kept_by: str | None = None
    reason: str | None = None

    def to_dict(self) -> dict:
        entry: dict = {"computes_in": self.computes_in}
        if self.kept_by is not None:
            entry["kept_by"] = self.kept_by
            entry["reason"] = self.reason
        return entry


@dataclass
class Typing:
    """The typed model, each float node's record (by node name), every Cast inserted and why."""

    model: onnx.ModelProto
    nodes: dict[str, TypedNode] = field(default_factory=dict)
    casts: list[dict] = field(default_factory=list)
    qdq_kept: dict[str, str] = field(default_factory=dict)  # Q/DQ node -> why it stays FP32

    def summary(self, float_type: str, float_io: str) -> dict:
        """report.json's `float_type` block."""
        counts: dict[str, int] = {}
        kept: dict[str, int] = {}
        for record in self.nodes.values():
            counts[record.computes_in] = counts.get(record.computes_in, 0) + 1
            if record.kept_by is not None:
                kept[record.kept_by] = kept.get(record.kept_by, 0) + 1
        return {
            "float_type": float_type,
            "io": float_io,
            "nodes_by_type": dict(sorted(counts.items())),
            "kept_fp32": dict(sorted(kept.items())),
            "qdq_kept_fp32": dict(sorted(self.qdq_kept.items())),
            "casts": self.casts,
        }


# Types of every tensor


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor of the main graph, by ONNX type inference on the structure
    (initializers stand in as typed graph inputs, so no weight is copied)."""
    graph = model.graph
    inputs = list(graph.input)
    known = {i.name for i in inputs}
    for init in graph.initializer:
        if init.name not in known:
            dims = [int(d) for d in init.dims]
            inputs.append(helper.make_tensor_value_info(init.name, init.data_type, dims))
    skeleton = helper.make_graph(list(graph.node), graph.name, inputs, list(graph.output))
    skeleton.value_info.extend(graph.value_info)
    probe = helper.make_model(skeleton, opset_imports=list(model.opset_import))
    probe.ir_version = model.ir_version
    inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
    types: dict[str, int] = {}
    for info in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            types[info.name] = info.type.tensor_type.elem_type
    return types


# What an op's schema says about its inputs


@dataclass(frozen=True)
class _Slot:
    """How one input of a node is typed: "bind" (it takes the node's type), "accept" (it keeps
    the type it arrives in if `allowed` has it, else FP32) or "fixed" (that element type)."""

    kind: str
    allowed: frozenset[str] = frozenset()
    elem: int = FLOAT


def _type_string(elem: int) -> str:
    return f"tensor({helper.tensor_dtype_to_string(elem).removeprefix('TensorProto.').lower()})"


_TYPE_STRINGS = {elem: _type_string(elem) for elem in (FLOAT, *LOW_TYPES.values())}
_FIXED = {text: elem for elem, text in _TYPE_STRINGS.items()}


def _schema(node: onnx.NodeProto, opsets: Mapping[str, int]) -> onnx.defs.OpSchema | None:
    domain = node.domain if node.domain not in ("", "ai.onnx") else ""
    version = opsets.get(domain)
    if version is None:
        return None
    try:
        return onnx.defs.get_schema(node.op_type, version, domain)
    except onnx.defs.SchemaError:
        return None


def _formal(params: Sequence, index: int):
    if index < len(params):
        return params[index]
    variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
    return params[-1] if params and params[-1].option == variadic else None


@dataclass(frozen=True)
class _OpTyping:
    """A node's inputs and outputs as its schema types them."""

    inputs: tuple[_Slot | None, ...]  # None: not a float tensor here, untouched
    outputs: tuple[bool, ...]  # True: the output takes the node's type
    gap: str | None  # why the node cannot compute in the low type asked (None: it can)


def _op_typing(
    node: onnx.NodeProto,
    schema: onnx.defs.OpSchema | None,
    types: Mapping[str, int],
    low: int | None,
) -> _OpTyping:
    floaty = {FLOAT, *LOW_TYPES.values()}
    if schema is None:
        gap = f"{node.domain or 'ai.onnx'} {node.op_type} has no ONNX schema here to type it by"
        slots = tuple(
            _Slot("fixed", elem=FLOAT) if types.get(n) in floaty else None for n in node.input
        )
        return _OpTyping(slots, tuple(False for _ in node.output), gap)
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    bound: dict[str, list[tuple[str, int]]] = {}
    for index, name in enumerate(node.input):
        formal = _formal(schema.inputs, index)
        if name and formal is not None and types.get(name) in floaty:
            bound.setdefault(formal.type_str, []).append(("in", index))
    for index, name in enumerate(node.output):
        formal = _formal(schema.outputs, index)
        if name and formal is not None and types.get(name) in floaty:
            bound.setdefault(formal.type_str, []).append(("out", index))
    inputs: list[_Slot | None] = [None] * len(node.input)
    outputs = [False] * len(node.output)
    gap = None
    for type_str, uses in bound.items():
        if type_str not in allowed:  # a fixed type: tensor(float)
            for role, index in uses:
                if role == "in":
                    inputs[index] = _Slot("fixed", elem=_FIXED.get(type_str, FLOAT))
            continue
        flows = any(role == "out" for role, _ in uses) or len(uses) > 1
        if not flows:
            inputs[uses[0][1]] = _Slot("accept", allowed[type_str])
            continue
        if low is not None and _TYPE_STRINGS[low] not in allowed[type_str]:
            formal = next(iter(uses))
            gap = (
                f"ONNX {node.op_type}-{schema.since_version} allows no "
                f"{NAMES[low].upper()} for {type_str} ({'input' if formal[0] == 'in' else 'output'}"
                f" {formal[1]})"
            )
        for role, index in uses:
            if role == "in":
                inputs[index] = _Slot("bind")
            else:
                outputs[index] = True
    if node.op_type in _ATTRIBUTE_TYPED:
        outputs = [types.get(out) in floaty for out in node.output]
    return _OpTyping(tuple(inputs), tuple(outputs), gap)


# The pass


def _has_float(node: onnx.NodeProto, types: Mapping[str, int]) -> bool:
    return any(types.get(name) == FLOAT for name in [*node.input, *node.output] if name)


def _constants(node: onnx.NodeProto, initializers: Mapping[str, onnx.TensorProto]) -> dict:
    found = {}
    for name in node.input:
        init = initializers.get(name)
        if init is not None and init.data_type == FLOAT:
            found[name] = numpy_helper.to_array(init)
    if node.op_type in ("Constant", "ConstantOfShape"):
        for attr in node.attribute:
            if attr.name == "value" and attr.t.data_type == FLOAT:
                found[f"{node.name}.value"] = numpy_helper.to_array(attr.t)
    return found


def type_model(
    model: onnx.ModelProto,
    requested: Mapping[str, str],
    default: str,
    node_io: Mapping[str, tuple[list[str], list[str]]],
    largest: Mapping[str, float],
    keep_io: bool = True,
) -> Typing:
    """`model` with every node typed as `requested` (node name -> fp16, bf16 or fp32; nodes it
    does not name, such as a Gemm's split bias Add, take `default`), kept in FP32 where a keep
    rule says so. `node_io`: each planned node's inputs and outputs in the float model (the
    names `largest`, the calibrated largest magnitudes, are keyed by). `keep_io`: graph inputs
    and outputs keep their types, with Casts behind and before them; else a float graph input
    every reader takes in one low type is declared in it, and so is a low graph output."""
    graph = model.graph
    types = _elem_types(model)
    opsets = {(o.domain if o.domain != "ai.onnx" else ""): o.version for o in model.opset_import}
    initializers = {init.name: init for init in graph.initializer}
    typing = Typing(model)

    # 1. What each float node computes in: the low type asked unless a keep rule says FP32.
    nodes = list(graph.node)  # positions key every table below (wrapper ids are not stable)
    node_type: dict[int, int] = {}
    schemas: dict[int, _OpTyping] = {}
    for at, node in enumerate(nodes):
        if node.op_type in _QDQ or not _has_float(node, types):
            continue
        want = requested.get(node.name, default)
        low = LOW_TYPES.get(want)
        op = _op_typing(node, _schema(node, opsets), types, low)
        schemas[at] = op
        if low is None:
            node_type[at] = FLOAT
            typing.nodes[node.name] = TypedNode("fp32")
            continue
        ins, outs = node_io.get(node.name, (list(node.input), list(node.output)))
        facts = NodeFacts(
            node.op_type,
            want,
            {n: largest[n] for n in [*ins, *outs] if n in largest},
            tuple(n for n in outs if n in largest),
            _constants(node, initializers),
            op.gap,
        )
        kept = keep_reason(facts)
        if kept is None:
            node_type[at] = low
            typing.nodes[node.name] = TypedNode(want)
        else:
            node_type[at] = FLOAT
            typing.nodes[node.name] = TypedNode("fp32", kept[0], kept[1])

    # 2. Q/DQ follow the nodes they feed: a DequantizeLinear is low when every reader is (of
    # one low type), its QuantizeLinear with it (they share the scale); a scale FP16 cannot
    # hold keeps the pair FP32.
    consumers: dict[str, list[int]] = {}
    for at, node in enumerate(nodes):
        for name in node.input:
            if name:
                consumers.setdefault(name, []).append(at)
    for at, node in enumerate(nodes):
        if node.op_type != "DequantizeLinear":
            continue
        readers = consumers.get(node.output[0], [])
        kinds = {node_type.get(r, FLOAT) for r in readers}
        chosen = kinds.pop() if len(kinds) == 1 else FLOAT
        if chosen != FLOAT:
            scale = initializers.get(node.input[1])
            why = None
            if scale is not None:
                why = scale_keep_reason(numpy_helper.to_array(scale), NAMES[chosen])
            if why is not None:
                typing.qdq_kept[node.name] = why
                chosen = FLOAT
        node_type[at] = chosen
        schemas[at] = _op_typing(node, _schema(node, opsets), types, chosen)
    dq_by_input = {n.input[0]: at for at, n in enumerate(nodes) if n.op_type == "DequantizeLinear"}
    for at, node in enumerate(nodes):
        if node.op_type == "QuantizeLinear":
            pair = dq_by_input.get(node.output[0])
            chosen = node_type.get(pair, FLOAT) if pair is not None else FLOAT
            node_type[at] = chosen
            schemas[at] = _op_typing(node, _schema(node, opsets), types, chosen)

    typing.model = _rewrite(
        model, nodes, types, node_type, schemas, initializers, consumers, keep_io, typing
    )
    return typing


def _rewrite(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    types: Mapping[str, int],
    node_type: Mapping[int, int],
    schemas: Mapping[int, _OpTyping],
    initializers: Mapping[str, onnx.TensorProto],
    consumers: Mapping[str, list[int]],
    keep_io: bool,
    typing: Typing,
) -> onnx.ModelProto:
    graph = model.graph
    new_type: dict[str, int] = dict(types)

    # Initializers (and, without keep_io, graph inputs) every reader binds to one low type are
    # stored (declared) in it; others stay and are cast for the low readers.
    graph_inputs = {i.name for i in graph.input}
    retypable = set(initializers) | (set() if keep_io else graph_inputs)
    wanted: dict[str, set[int]] = {}
    for at, node in enumerate(nodes):
        op = schemas.get(at)
        if op is None:
            continue
        for index, name in enumerate(node.input):
            slot = op.inputs[index] if index < len(op.inputs) else None
            if name in retypable and slot is not None:
                want = node_type[at] if slot.kind == "bind" else types.get(name, FLOAT)
                wanted.setdefault(name, set()).add(want if slot.kind != "fixed" else slot.elem)
    converted: dict[str, onnx.TensorProto] = {}
    declared: dict[str, int] = {}
    for name, kinds in wanted.items():
        if types.get(name) != FLOAT or len(kinds) != 1 or (elem := kinds.pop()) == FLOAT:
            continue
        if any(node_type.get(c) is None for c in consumers.get(name, [])):
            continue  # a reader the pass leaves untouched reads it as it is
        new_type[name] = elem
        if name in initializers:
            values = numpy_helper.to_array(initializers[name]).astype(_NUMPY[elem])
            converted[name] = numpy_helper.from_array(values, name)
        else:
            declared[name] = elem

    casts: dict[tuple[str, int], str] = {}
    body: list[onnx.NodeProto] = []

    def cast(tensor: str, elem: int, why: str) -> str:
        key = (tensor, elem)
        if key not in casts:
            name = f"{tensor}_as_{NAMES[elem]}"
            node = f"{tensor}_Cast_{NAMES[elem]}"
            body.append(helper.make_node("Cast", [tensor], [name], name=node, to=elem))
            casts[key] = name
            typing.casts.append({"node": node, "tensor": tensor, "to": NAMES[elem], "why": why})
        return casts[key]

    producers = {out: node for node in nodes for out in node.output if out}
    for at, node in enumerate(nodes):
        op = schemas.get(at)
        chosen = node_type.get(at)
        rewritten = onnx.NodeProto()
        rewritten.CopyFrom(node)
        if op is None or chosen is None:
            body.append(rewritten)
            continue
        for index, name in enumerate(node.input):
            slot = op.inputs[index] if index < len(op.inputs) else None
            if slot is None or not name:
                continue
            arriving = new_type.get(name, FLOAT)
            if slot.kind == "bind":
                target = chosen
            elif slot.kind == "fixed":
                target = slot.elem
            else:
                target = arriving if _TYPE_STRINGS.get(arriving) in slot.allowed else FLOAT
            if arriving != target:
                rewritten.input[index] = cast(
                    name, target, _why(name, node, producers, graph_inputs, typing)
                )
        for index, out in enumerate(node.output):
            if index < len(op.outputs) and op.outputs[index]:
                new_type[out] = chosen
        _retype_attributes(rewritten, chosen)
        body.append(rewritten)

    # Graph outputs keep their type: the low producer writes a renamed tensor, a Cast restores
    # the name (and every reader inside the graph reads the low tensor).
    renamed: dict[str, str] = {}
    for output in graph.output:
        elem = output.type.tensor_type.elem_type
        if keep_io and new_type.get(output.name, elem) != elem:
            renamed[output.name] = f"{output.name}_{NAMES[new_type[output.name]]}"
    if renamed:
        for node in body:
            for index, name in enumerate(node.input):
                if name in renamed:
                    node.input[index] = renamed[name]
            for index, name in enumerate(node.output):
                if name in renamed:
                    node.output[index] = renamed[name]
        for original, low_name in renamed.items():
            body.append(
                helper.make_node(
                    "Cast", [low_name], [original], name=f"{original}_Cast_output", to=FLOAT
                )
            )
            new_type[low_name] = new_type[original]
            new_type[original] = FLOAT
            typing.casts.append(
                {
                    "node": f"{original}_Cast_output",
                    "tensor": original,
                    "to": "fp32",
                    "why": "graph output keeps its type (float_io: keep)",
                }
            )

    inputs = [_declared(i, declared.get(i.name)) for i in graph.input]
    outputs = list(graph.output)
    if not keep_io:
        outputs = [_declared(o, new_type.get(o.name)) for o in outputs]
    initializers_out = [converted.get(i.name, i) for i in graph.initializer]
    value_info = []
    for info in graph.value_info:
        name = renamed.get(info.name, info.name)
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(info)
        copy.name = name
        if copy.type.HasField("tensor_type") and name in new_type:
            copy.type.tensor_type.elem_type = new_type[name]
        value_info.append(copy)
    new_graph = helper.make_graph(
        body,
        graph.name,
        inputs,
        outputs,
        initializer=initializers_out,
        value_info=value_info,
    )
    typed = helper.make_model(
        new_graph,
        opset_imports=list(model.opset_import),
        producer_name=model.producer_name,
        producer_version=model.producer_version,
    )
    typed.ir_version = model.ir_version
    typed.metadata_props.extend(model.metadata_props)
    return typed


def _declared(info: onnx.ValueInfoProto, elem: int | None) -> onnx.ValueInfoProto:
    """A graph input or output declared with element type `elem` (None: as it is)."""
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(info)
    if elem is not None and copy.type.HasField("tensor_type"):
        copy.type.tensor_type.elem_type = elem
    return copy


def _why(
    tensor: str,
    reader: onnx.NodeProto,
    producers: Mapping[str, onnx.NodeProto],
    graph_inputs: set[str],
    typing: Typing,
) -> str:
    """The boundary a Cast stands on, in the report's words."""
    if tensor in graph_inputs:
        return "graph input keeps its type (float_io: keep)"
    producer = producers.get(tensor)
    for node in (producer, reader):
        if node is None:
            continue
        record = typing.nodes.get(node.name)
        if record is not None and record.kept_by is not None:
            return f"around '{node.name}', kept FP32 ({record.kept_by})"
        if record is not None and record.computes_in == "fp32":
            return f"around '{node.name}', planned FP32 (precision float)"
        if node.name in typing.qdq_kept:
            return f"after '{node.name}', kept FP32 (its scale)"
    return f"'{reader.name}' ({reader.op_type}) takes this input in another type (ONNX schema)"


def _retype_attributes(node: onnx.NodeProto, chosen: int) -> None:
    """Cast's `to` and Constant/ConstantOfShape's `value` give their output type: in a low node
    a float one becomes the low type."""
    key = _ATTRIBUTE_TYPED.get(node.op_type)
    if key is None or chosen == FLOAT:
        return
    for attr in node.attribute:
        if attr.name != key:
            continue
        if attr.type == onnx.AttributeProto.INT and attr.i == FLOAT:
            attr.i = chosen
        elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FLOAT:
            values = numpy_helper.to_array(attr.t).astype(_NUMPY[chosen])
            attr.t.CopyFrom(numpy_helper.from_array(values, attr.t.name))
