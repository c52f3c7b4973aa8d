"""Constant folding: every standard node computable from constants becomes an initializer.

Folded values come from ONNX Runtime itself, one node at a time on the CPU provider, so they are
exactly what ORT would compute at run time. (`onnx.reference` was tried first and rejected: its
GatherElements fails on the position-id gather that the dynamo exporter emits for BERT.)
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from qtool.model.external_data import tensor_array
from qtool.model.graph_edit import STANDARD_DOMAINS, consumer_counts, delete_indexes, drop_where
from qtool.model.shapes import static_shape

__all__ = ["fold_constants"]

_log = logging.getLogger(__name__)

# Folding these would change results run to run (random ops) or dissolve quantization that is
# already in the model (Q/DQ): they stay even when all their inputs are constant.
_NEVER_FOLD = frozenset(
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "QuantizeLinear",
        "DequantizeLinear",
    }
)
_GRAPH_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
# A folded tensor larger than this AND larger than its inputs together is left as a node: folding
# Expand/Tile/ConstantOfShape would bloat the file without removing any work worth removing.
_MAX_GROWTH_BYTES = 1 << 20
# Inputs that are weights of the consumer however large they are: the zero bias the dynamo exporter
# builds with Expand for a bias-free Conv must become an initializer for the layer to quantize.
_WEIGHT_SLOTS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2)}
# A Transpose of a float weight that other nodes read too stays a node: a tied embedding is read by
# its Gather and, transposed, by the lm_head MatMul; folding the Transpose would store the table
# twice (GPT-2: 38 MB exported, 69 MB prepared). The plan reads MatMul(x, Transpose(W)) as a
# weighted MatMul on W (qtool/plan/ops/matmul.py), so the lm_head is still quantized.
_SHARED_WEIGHT_VIEWS = frozenset({"Transpose"})


class _Constants:
    """Constant tensors by name, decoded to numpy only when a fold reads them.

    Decoding every weight up front would copy the whole model once per folding round; most
    weights feed Conv/MatMul nodes that never fold.
    """

    def __init__(self, initializers: Iterable[onnx.TensorProto]) -> None:
        self._protos = {t.name: t for t in initializers}
        self._arrays: dict[str, np.ndarray] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._arrays or name in self._protos

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = tensor_array(self._protos[name])
        return self._arrays[name]

    def add(self, name: str, value: np.ndarray) -> None:
        self._arrays[name] = value

    def shape(self, name: str) -> list[int] | None:
        if name in self._arrays:
            return list(self._arrays[name].shape)
        return [int(d) for d in self._protos[name].dims] if name in self._protos else None

    def elem_type(self, name: str) -> int:
        if name in self._arrays:
            return helper.np_dtype_to_tensor_dtype(self._arrays[name].dtype)
        return self._protos[name].data_type

    def nbytes(self, name: str) -> int:
        if name in self._arrays:
            return int(self._arrays[name].nbytes)
        proto = self._protos[name]
        itemsize = helper.tensor_dtype_to_np_dtype(proto.data_type).itemsize
        return int(np.prod(proto.dims, dtype=np.int64)) * itemsize


def fold_constants(
    graph: onnx.GraphProto, opsets: dict[str, int], types: dict[str, onnx.TypeProto]
) -> bool:
    """Replace nodes computable from constants by initializers; True when anything changed.

    `types` is the shape inference result for `graph`: it gives Shape/Size of activations whose
    shape is static, and the size of outputs before they are computed.
    """
    consts = _Constants(graph.initializer)
    graph_outputs = {o.name for o in graph.output}
    weights = {
        node.input[i]
        for node in graph.node
        if node.domain in STANDARD_DOMAINS
        for i in _WEIGHT_SLOTS.get(node.op_type, ())
        if i < len(node.input)
    }
    readers = consumer_counts(graph)
    folded: list[int] = []  # node indexes (ids of upb wrappers are not stable)
    new_inits: list[onnx.TensorProto] = []
    for index, node in enumerate(graph.node):
        if _view_of_shared_weight(node, consts, readers):
            continue
        values = _try_fold(node, consts, opsets, types, weights)
        if values is None or any(o in graph_outputs for o in node.output):
            continue
        folded.append(index)
        for name, value in zip([o for o in node.output if o], values, strict=True):
            consts.add(name, value)
            new_inits.append(numpy_helper.from_array(value, name))
    if not new_inits:
        return False
    delete_indexes(graph.node, folded)
    graph.initializer.extend(new_inits)
    names = {t.name for t in new_inits}
    drop_where(graph.value_info, lambda vi: vi.name in names)
    return True


def _view_of_shared_weight(node: onnx.NodeProto, consts: _Constants, readers: Counter[str]) -> bool:
    """A Transpose of a float initializer that another node reads as well (a tied weight)."""
    if node.op_type not in _SHARED_WEIGHT_VIEWS or node.domain not in STANDARD_DOMAINS:
        return False
    data = node.input[0] if node.input else ""
    if data not in consts or readers[data] < 2:
        return False
    return consts.elem_type(data) in _FLOAT_TYPES and len(consts.shape(data) or []) >= 2


_FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
)


def _try_fold(
    node: onnx.NodeProto,
    consts: _Constants,
    opsets: dict[str, int],
    types: dict[str, onnx.TypeProto],
    weights: set[str],
) -> list[np.ndarray] | None:
    if node.domain not in STANDARD_DOMAINS or node.op_type in _NEVER_FOLD:
        return None
    if any(a.type in _GRAPH_ATTRS for a in node.attribute):
        return None
    if node.op_type in ("Shape", "Size"):
        shape = consts.shape(node.input[0])
        shape = shape if shape is not None else static_shape(types.get(node.input[0]))
        return None if shape is None else [_shape_value(node, shape)]
    if node.op_type == "CastLike":
        node = _cast_like_as_cast(node, consts, types)
        if node is None:
            return None
    inputs = [n for n in node.input if n]
    if not all(n in consts for n in inputs):
        return None
    in_bytes = sum(consts.nbytes(n) for n in inputs)
    # A Constant node is a weight written inline, and a weight slot holds a layer's own weight:
    # they always become initializers.
    limit = node.op_type != "Constant" and not any(o in weights for o in node.output)
    for out in node.output if limit else ():
        t = types.get(out)
        shape = static_shape(t)
        itemsize = _itemsize(t.tensor_type.elem_type) if shape is not None else 0
        if shape is not None and _too_big(int(np.prod(shape, dtype=np.int64)) * itemsize, in_bytes):
            return None
    try:
        values = _evaluate(node, consts, opsets)
    except Exception as exc:  # e.g. an op this ORT build has no CPU kernel for
        _log.warning("not folding %s (%s): %s", node.name or node.output[0], node.op_type, exc)
        return None
    if limit and any(_too_big(v.nbytes, in_bytes) for v in values):
        return None
    return values


def _cast_like_as_cast(
    node: onnx.NodeProto, consts: _Constants, types: dict[str, onnx.TypeProto]
) -> onnx.NodeProto | None:
    """CastLike(c, like) reads only the element type of `like`, which is often an activation.

    The dynamo exporter writes every literal it mixes with a tensor (Clip bounds, zero biases)
    as CastLike(literal, tensor): as a Cast to the known type it folds like any constant node.
    """
    like = node.input[1]
    if like in consts:
        elem = consts.elem_type(like)
    else:
        t = types.get(like)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.elem_type:
            return None
        elem = t.tensor_type.elem_type
    attrs = [a for a in node.attribute if a.name == "saturate"]
    cast = helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=elem)
    cast.attribute.extend(attrs)
    return cast


def _itemsize(elem_type: int) -> int:
    """Bytes per element; 8 (the widest common type) when the type is unknown or not numeric."""
    try:
        return helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, ValueError, TypeError):
        return 8


def _too_big(out_bytes: int, in_bytes: int) -> bool:
    return out_bytes > _MAX_GROWTH_BYTES and out_bytes > in_bytes


def _shape_value(node: onnx.NodeProto, shape: list[int]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    # Shape-15 start/end clamp exactly like Python slicing.
    return np.array(shape[attrs.get("start", 0) : attrs.get("end", len(shape))], dtype=np.int64)


def _evaluate(node: onnx.NodeProto, consts: _Constants, opsets: dict[str, int]) -> list[np.ndarray]:
    """Run one node in ONNX Runtime (CPU): folded values are exactly what ORT would compute."""
    feeds = {n: consts[n] for n in dict.fromkeys(n for n in node.input if n)}
    opset = [helper.make_opsetid("", opsets.get("", opsets.get("ai.onnx", 0)))]
    sub = helper.make_model(
        helper.make_graph(
            [node],
            "fold",
            [
                helper.make_tensor_value_info(
                    n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)
                )
                for n, a in feeds.items()
            ],
            [helper.make_empty_tensor_value_info(o) for o in node.output if o],
        ),
        opset_imports=opset,
        ir_version=helper.find_min_ir_version_for(opset),
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        sub.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return [np.asarray(r) for r in session.run(None, feeds)]
