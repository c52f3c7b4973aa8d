"""Raise a model's default-domain opset to 21, the first with blocked (INT4) DequantizeLinear.

Only bumping the opset number (what ORT's own INT4 tool does) breaks models: ops whose signature
changed on the way keep their old form, e.g. MiniLM then fails to load with "Unrecognized
attribute: axes for operator ReduceL2" (Reduce* moved `axes` from attribute to input in opsets
13/18). `onnx.version_converter` carries an adapter per op and version step and handles nearly
everything (Reduce*, Split, Squeeze/Unsqueeze, Softmax/LogSoftmax, Pad, Resize, Clip, ...).
What it gets wrong is fixed here explicitly, each found by converting single-op models with
onnx 1.23 and comparing ORT outputs before and after:

- local functions are dropped by the converter: they are inlined first;
- Hardmax below opset 13 (softmax-style "flatten to 2-D at axis" semantics) is passed through
  unchanged, silently changing results: rewritten first to Flatten -> Hardmax -> Reshape, which
  means the same in every opset;
- GroupNormalization 18 (scale and bias per group) is passed through to 21 (per channel), where
  ORT then rejects the model: the constant scale and bias are repeated per channel afterwards
  (main graph only; a non-constant scale is an error naming the node).

The converter runs on the model without its large weights (it copies the whole protobuf and
cannot serialise more than 2 GB): external_data.convert_without_weights, which leaves them in
place in the model.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, inliner, numpy_helper, shape_inference, version_converter

from qtool.errors import ModelError, first_line
from qtool.model import external_data
from qtool.model.external_data import tensor_array

__all__ = ["TARGET_OPSET", "upgrade_to_opset21", "upgrade_to_opset21_in_place"]

TARGET_OPSET = 21
_TARGET_IR = helper.find_min_ir_version_for([helper.make_opsetid("", TARGET_OPSET)])
_MIN_SOURCE_OPSET = 7  # the oldest opset ONNX Runtime loads
_DEFAULT_DOMAINS = ("", "ai.onnx")


def upgrade_to_opset21(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` at default-domain opset 21 (unchanged copy if already >= 21).

    The IR version is raised to the one opset 21 needs (10, which also introduces INT4). Raises
    ModelError naming the node when an op cannot be converted, and when the model's opset is
    below 7. The result is checked with onnx.checker (without its weights).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    upgrade_to_opset21_in_place(out)
    return out


def upgrade_to_opset21_in_place(model: onnx.ModelProto) -> None:
    """`upgrade_to_opset21` on `model` itself: the converter runs on the model without its
    weights (external_data.convert_without_weights), so preparing a model holds its weights once
    (copying first and detaching them after held them five times)."""
    source = _default_opset(model)
    if source >= TARGET_OPSET:
        return
    if source < _MIN_SOURCE_OPSET:
        raise ModelError(
            f"model {model.graph.name!r} has opset {source}; upgrading needs opset "
            f"{_MIN_SOURCE_OPSET} or later"
        )
    if model.functions:
        model.CopyFrom(inliner.inline_local_functions(model))
    if source < 13:
        _rewrite_old_hardmax(model.graph)
    original = external_data.weightless_copy(model)

    def convert(skeleton: onnx.ModelProto) -> onnx.ModelProto:
        try:
            converted = version_converter.convert_version(skeleton, TARGET_OPSET)
        except Exception as exc:  # the C++ converter raises bare RuntimeError/ValueError
            raise _conversion_error(skeleton, source, exc) from None
        if source >= 18:
            _group_norm_scale_per_channel(converted)
        converted.ir_version = max(converted.ir_version, _TARGET_IR)
        return converted

    converted = external_data.convert_without_weights(model, convert, _group_norm_inputs(model))
    _check_conversion(original, converted)


def _group_norm_inputs(model: onnx.ModelProto) -> set[str]:
    """GroupNormalization's scale and bias: read by the fix after conversion."""
    return {
        name
        for node in model.graph.node
        if node.op_type == "GroupNormalization"
        for name in node.input[1:]
    }


def _check_conversion(original: onnx.ModelProto, converted: onnx.ModelProto) -> None:
    """onnx.checker on the converted skeleton; a failure the original has too is not the
    converter's. Both are skeletons (their weights are references), checked without the data."""
    try:
        external_data.check_skeleton(converted)
    except Exception as exc:
        try:
            external_data.check_skeleton(original)
        except Exception:
            return
        raise ModelError(
            f"model {original.graph.name!r} upgraded to opset {TARGET_OPSET} is invalid: "
            f"{first_line(exc)}"
        ) from None


def _default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in _DEFAULT_DOMAINS:
            return o.version
    raise ModelError(f"model {model.graph.name!r} imports no ai.onnx opset")


def _all_graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for body in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _all_graphs(body)


def _rewrite_old_hardmax(graph: onnx.GraphProto) -> None:
    """Hardmax-1/11 at axis a == Hardmax over the last axis of x flattened to 2-D at a."""
    for g in list(_all_graphs(graph)):
        nodes: list[onnx.NodeProto] = []
        for node in g.node:
            if node.op_type != "Hardmax" or node.domain not in _DEFAULT_DOMAINS:
                nodes.append(node)
                continue
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            x, y = node.input[0], node.output[0]
            base = node.name or y
            shape, flat, hard = f"{base}_shape", f"{base}_flat", f"{base}_hardmax2d"
            nodes += [
                helper.make_node("Shape", [x], [shape], name=f"{base}_Shape"),
                helper.make_node("Flatten", [x], [flat], name=f"{base}_Flatten", axis=axis),
                helper.make_node("Hardmax", [flat], [hard], name=node.name, axis=1),
                helper.make_node("Reshape", [hard, shape], [y], name=f"{base}_Reshape"),
            ]
        del g.node[:]
        g.node.extend(nodes)


def _conversion_error(model: onnx.ModelProto, source: int, exc: Exception) -> ModelError:
    """Name the node whose adapter failed: convert each op alone until one fails too."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    types = _known_types(model)

    def value_info(name: str) -> onnx.ValueInfoProto:
        if name in types:
            return helper.make_value_info(name, types[name])
        return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)

    for node in model.graph.node:
        if node.domain not in _DEFAULT_DOMAINS:
            continue
        graph = helper.make_graph(
            [node],
            "single",
            [value_info(n) for n in node.input if n],
            [value_info(n) for n in node.output if n],
        )
        single = helper.make_model(graph, opset_imports=[helper.make_opsetid("", source)])
        try:
            version_converter.convert_version(single, TARGET_OPSET)
        except Exception:
            return ModelError(
                f"cannot upgrade node {node.name or node.output[0]!r} ({node.op_type}) of model "
                f"{model.graph.name!r} from opset {source} to {TARGET_OPSET}: {reason}"
            )
    return ModelError(
        f"cannot upgrade model {model.graph.name!r} from opset {source} to {TARGET_OPSET}: {reason}"
    )


def _known_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Types of the main graph's values, as far as shape inference gets (nothing if it fails)."""
    try:
        inferred = shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        inferred = model
    graph = inferred.graph
    types = {vi.name: vi.type for vi in [*graph.input, *graph.value_info, *graph.output]}
    for init in graph.initializer:
        types[init.name] = helper.make_tensor_type_proto(init.data_type, list(init.dims))
    return types


def _group_norm_scale_per_channel(model: onnx.ModelProto) -> None:
    """GroupNormalization-18 scale/bias [G] -> opset-21 [C]: each group's value per channel."""
    graph = model.graph
    norms = [
        n for n in graph.node if n.op_type == "GroupNormalization" and n.domain in _DEFAULT_DOMAINS
    ]
    if not norms:
        return
    inits = {i.name: i for i in graph.initializer}
    inferred = shape_inference.infer_shapes(model, strict_mode=False)
    shapes = {
        vi.name: vi.type.tensor_type.shape
        for vi in [*inferred.graph.input, *inferred.graph.value_info]
    }
    for node in norms:
        groups = next(a.i for a in node.attribute if a.name == "num_groups")
        channels = _channel_count(shapes.get(node.input[0]))
        where = f"GroupNormalization node {node.name or node.output[0]!r}"
        for slot in (1, 2):
            name = node.input[slot]
            if name not in inits:
                raise ModelError(
                    f"{where}: its {'scale' if slot == 1 else 'bias'} {name!r} is not a constant; "
                    f"opset 21 needs it per channel, opset 18 per group: cannot convert"
                )
            value = tensor_array(inits[name])
            if value.shape == (channels,) or channels == groups:
                continue
            if channels is None:
                raise ModelError(f"{where}: channel count unknown; cannot convert to opset 21")
            per_channel = np.repeat(value, channels // groups)
            new_name = f"{name}_per_channel"
            if new_name not in inits:
                inits[new_name] = numpy_helper.from_array(per_channel, new_name)
                graph.initializer.append(inits[new_name])
            node.input[slot] = new_name


def _channel_count(shape: onnx.TensorShapeProto | None) -> int | None:
    if shape is None or len(shape.dim) < 2 or not shape.dim[1].HasField("dim_value"):
        return None
    return int(shape.dim[1].dim_value)
