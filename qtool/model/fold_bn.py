"""Fold inference-mode BatchNormalization into the Conv, ConvTranspose or Gemm that feeds it.

Exports keep BatchNormalization when constant folding is off (TorchScript
`do_constant_folding=False`, `training=TrainingMode.PRESERVE`; dynamo `optimize=False`). Left in,
the quantizer places DQ -> Conv -> Q around the Conv while BatchNormalization sits between the
Conv and its consumers, and ONNX Runtime cannot form QLinearConv: the layer is reported int8 but
runs in float. Folding first gives the graph every other exporter writes, with per-channel
weights quantized after the BN scale is applied (the ranges quantization actually sees).

Even the default TorchScript export (constant folding on) keeps BatchNorm1d after a bias-free
Linear: a rank-2 MatMul with a constant weight, followed by BatchNormalization. That pair folds
into a Gemm with the BN's shift as its bias, the form ORT fuses into QGemm.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.model.external_data import tensor_array
from qtool.model.graph_edit import STANDARD_DOMAINS, consumer_counts, delete_indexes

__all__ = ["fold_batch_norms"]

_PRODUCERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}
)


def fold_batch_norms(
    graph: onnx.GraphProto, types: dict[str, onnx.TypeProto] | None = None
) -> bool:
    """Fold every foldable BatchNormalization; True when any was folded.

    A BatchNormalization folds when it runs in inference mode (training_mode=0, no running-stat
    outputs), its scale/B/mean/var are initializers, the producer's weight (and bias, if any) are
    float initializers, and the producer's output is read by the BatchNormalization only. The
    producer keeps its name and takes over the BatchNormalization's output tensor; rewritten
    weights keep their names unless another node reads them too. A MatMul folds (becoming a Gemm)
    only where `types` (shape inference of `graph`) says its first input has rank 2.
    """
    inits = {t.name: t for t in graph.initializer}
    consumers = consumer_counts(graph)
    graph_outputs = {o.name for o in graph.output}
    producers = {o: node for node in graph.node for o in node.output if o}
    used = set(inits) | set(producers) | {i.name for i in graph.input}
    folded: list[int] = []
    for index, bn in enumerate(graph.node):
        if bn.op_type != "BatchNormalization" or bn.domain not in STANDARD_DOMAINS:
            continue
        producer = producers.get(bn.input[0])
        if producer is None or not _foldable(bn, producer, inits, consumers, graph_outputs):
            continue
        if producer.op_type == "MatMul" and not _rank2_matmul(producer, inits, types or {}):
            continue
        params = _bn_params(bn, inits)
        if producer.op_type in ("Gemm", "MatMul"):
            result = _fold_gemm(producer, params, inits)
        else:
            result = _fold_conv(producer, params, inits)
        if result is None:
            continue
        weight, bias = result
        _store(graph, producer, 1, weight, consumers, inits, used, fallback=None)
        _store(graph, producer, 2, bias, consumers, inits, used, fallback=bn.input[2])
        if producer.op_type == "MatMul":
            producer.op_type = "Gemm"  # MatMul(A[M,K], W[K,N]) + C[N]: Gemm's defaults
        producer.output[0] = bn.output[0]
        producers[bn.output[0]] = producer  # a BatchNormalization right after folds too
        folded.append(index)
    delete_indexes(graph.node, folded)
    return bool(folded)


def _attr(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def _foldable(
    bn: onnx.NodeProto,
    producer: onnx.NodeProto,
    inits: dict[str, onnx.TensorProto],
    consumers: Counter[str],
    graph_outputs: set[str],
) -> bool:
    if _attr(bn, "training_mode", 0) != 0 or any(bn.output[1:]):
        return False  # training mode normalises with batch statistics: nothing constant to fold
    if len(bn.input) != 5 or any(name not in inits for name in bn.input[1:]):
        return False
    if producer.op_type not in _PRODUCERS or producer.domain not in STANDARD_DOMAINS:
        return False
    x = bn.input[0]
    if consumers[x] != 1 or x in graph_outputs or len(producer.output) != 1:
        return False
    weight = producer.input[1] if len(producer.input) > 1 else ""
    bias = producer.input[2] if len(producer.input) > 2 else ""
    if weight not in inits or inits[weight].data_type not in _FLOAT_TYPES:
        return False
    return not bias or (bias in inits and inits[bias].data_type == inits[weight].data_type)


def _rank2_matmul(
    node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], types: dict[str, onnx.TypeProto]
) -> bool:
    """MatMul(A, W) with A of rank 2 and W a 2-D initializer: a Gemm without bias."""
    if len(node.input) != 2 or len(inits[node.input[1]].dims) != 2:
        return False
    t = types.get(node.input[0])
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return False
    return (
        len(t.tensor_type.shape.dim) == 2
        and t.tensor_type.elem_type == inits[node.input[1]].data_type
    )


def _bn_params(bn: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> tuple:
    """(multiplier, offset) in float64: y = x * multiplier + offset per channel."""
    scale, b, mean, var = (
        tensor_array(inits[n]).astype(np.float64).reshape(-1) for n in bn.input[1:]
    )
    multiplier = scale / np.sqrt(var + float(_attr(bn, "epsilon", 1e-5)))
    return multiplier, b - mean * multiplier


def _fold_conv(
    node: onnx.NodeProto, params: tuple, inits: dict[str, onnx.TensorProto]
) -> tuple[np.ndarray, np.ndarray] | None:
    multiplier, offset = params
    w = tensor_array(inits[node.input[1]])
    channels = multiplier.shape[0]
    if w.ndim < 2:
        return None
    if node.op_type == "Conv":
        if w.shape[0] != channels:
            return None
        w64 = w.astype(np.float64) * multiplier.reshape((channels,) + (1,) * (w.ndim - 1))
    else:  # ConvTranspose: W is [C_in, C_out / group, k...], output channel g * C_out/g + j
        group = int(_attr(node, "group", 1))
        per_group = w.shape[1]
        if group * per_group != channels or w.shape[0] % group:
            return None
        grouped = w.astype(np.float64).reshape((group, w.shape[0] // group, *w.shape[1:]))
        m = multiplier.reshape((group, 1, per_group) + (1,) * (w.ndim - 2))
        w64 = (grouped * m).reshape(w.shape)
    bias = _bias(node, inits, channels)
    if bias is None:
        return None
    return w64.astype(w.dtype), (bias * multiplier + offset).astype(w.dtype)


def _fold_gemm(
    node: onnx.NodeProto, params: tuple, inits: dict[str, onnx.TensorProto]
) -> tuple[np.ndarray, np.ndarray] | None:
    """Y = alpha * A' B' + beta * C with BN over Y's columns: scale B's output columns."""
    multiplier, offset = params
    w = tensor_array(inits[node.input[1]])
    trans_b = int(_attr(node, "transB", 0))
    if w.ndim != 2 or w.shape[0 if trans_b else 1] != multiplier.shape[0]:
        return None
    m = multiplier[:, None] if trans_b else multiplier[None, :]
    c = _bias(node, inits, multiplier.shape[0])
    if c is None:
        return None
    beta = float(_attr(node, "beta", 1.0))
    _set_float_attr(node, "beta", 1.0)
    return (w.astype(np.float64) * m).astype(w.dtype), ((c * beta) * multiplier + offset).astype(
        w.dtype
    )


def _bias(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], channels: int):
    """The producer's bias in float64 (zeros when absent); None if it is not per-channel."""
    if len(node.input) < 3 or not node.input[2]:
        return np.zeros(channels)
    bias = tensor_array(inits[node.input[2]]).astype(np.float64)
    if node.op_type == "Gemm":
        # C broadcasts to [M, N]; any form that broadcasts against the channel vector folds.
        if bias.ndim > 2 or (bias.ndim >= 1 and bias.shape[-1] not in (1, channels)):
            return None
        return bias
    return bias if bias.shape == (channels,) else None


def _set_float_attr(node: onnx.NodeProto, name: str, value: float) -> None:
    for attr in node.attribute:
        if attr.name == name:
            attr.f = value
            return


def _store(
    graph: onnx.GraphProto,
    node: onnx.NodeProto,
    slot: int,
    value: np.ndarray,
    consumers: Counter[str],
    inits: dict[str, onnx.TensorProto],
    used: set[str],
    fallback: str | None,
) -> None:
    """Write `value` as input `slot` of `node`, reusing a tensor name nothing else reads.

    The old tensor's name when only `node` reads it; else `fallback` (the BN's bias, which goes
    away with the BN) when only the BN reads it; else a new unique name.
    """
    old = node.input[slot] if len(node.input) > slot else ""
    for name in (old, fallback):
        if name and consumers[name] == 1:
            inits[name].CopyFrom(numpy_helper.from_array(value, name))
            break
    else:
        name = _unique(f"{old or node.output[0]}_bn_folded", used)
        used.add(name)
        graph.initializer.append(numpy_helper.from_array(value, name))
        inits[name] = graph.initializer[-1]
    while len(node.input) <= slot:
        node.input.append("")
    node.input[slot] = name


def _unique(base: str, used: set[str]) -> str:
    name, k = base, 0
    while name in used:
        k += 1
        name = f"{base}_{k}"
    return name
