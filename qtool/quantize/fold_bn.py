"""Fold inference-mode BatchNormalization into the Conv, ConvTranspose or Gemm before it.

An export that leaves BatchNormalization in the graph (torch's dynamo exporter with
`optimize=False`, many converted models) breaks ORT's QDQ fusion: DQ -> Conv -> BN -> Q is not a
pattern ORT turns into QLinearConv, so every such Conv would run in float behind its QDQ pairs.
Folding is exact algebra: y = (conv(x) - mean) * gamma / sqrt(var + eps) + beta is a conv with
weights scaled per output channel and a new bias.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_PRODUCERS = frozenset({"Conv", "ConvTranspose", "Gemm"})


def _attr(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(helper.make_attribute(name, value))


def _scaled_weight(producer: onnx.NodeProto, weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The weight with output channel c multiplied by scale[c], in the producer's layout."""
    if producer.op_type == "Conv":
        return weight * scale.reshape([-1] + [1] * (weight.ndim - 1))
    if producer.op_type == "ConvTranspose":  # [C_in, C_out / group, *kernel]
        group = int(_attr(producer, "group", 1))
        c_in, per_group = weight.shape[0], weight.shape[1]
        grouped = weight.reshape(group, c_in // group, per_group, *weight.shape[2:])
        factors = scale.reshape(group, 1, per_group, *([1] * (weight.ndim - 2)))
        return (grouped * factors).reshape(weight.shape)
    if _attr(producer, "transB", 0):  # Gemm, weight [N, K]
        return weight * scale[:, None]
    return weight * scale[None, :]  # Gemm, weight [K, N]


def _foldable(
    bn: onnx.NodeProto,
    producer: onnx.NodeProto | None,
    consumers: dict[str, int],
    constants: dict[str, onnx.TensorProto],
    graph_outputs: set[str],
) -> bool:
    if bn.domain not in ("", "ai.onnx") or len(bn.output) != 1 or len(bn.input) != 5:
        return False
    if _attr(bn, "training_mode", 0):
        return False
    if (
        producer is None
        or producer.op_type not in _PRODUCERS
        or producer.domain not in ("", "ai.onnx")
    ):
        return False
    tensor = bn.input[0]
    if consumers.get(tensor, 0) != 1 or tensor in graph_outputs:
        return False
    if any(name not in constants for name in bn.input[1:]):
        return False
    weight = producer.input[1] if len(producer.input) > 1 else ""
    bias = producer.input[2] if len(producer.input) > 2 else ""
    if weight not in constants or (bias and bias not in constants):
        return False
    if constants[weight].data_type != onnx.TensorProto.FLOAT:
        return False
    if producer.op_type == "Gemm" and _attr(producer, "transA", 0):
        return False
    return True


def fold_batch_norms(graph: onnx.GraphProto) -> int:
    """Fold every foldable BatchNormalization; returns how many were folded.

    New weight and bias initializers get new names (`{weight}_bn_folded`), so a weight shared with
    another node is never changed under it.
    """
    constants = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    graph_outputs = {o.name for o in graph.output}
    removed: set[int] = set()
    for bn in graph.node:
        if bn.op_type != "BatchNormalization":
            continue
        producer = producers.get(bn.input[0])
        if not _foldable(bn, producer, consumers, constants, graph_outputs):
            continue
        gamma, beta, mean, var = (
            numpy_helper.to_array(constants[n]).astype(np.float64) for n in bn.input[1:]
        )
        epsilon = float(_attr(bn, "epsilon", 1e-5))
        scale = gamma / np.sqrt(var + epsilon)
        weight_name = producer.input[1]
        weight = numpy_helper.to_array(constants[weight_name]).astype(np.float64)
        channels = scale.shape[0]
        bias = np.zeros(channels)
        if len(producer.input) > 2 and producer.input[2]:
            bias = np.broadcast_to(
                numpy_helper.to_array(constants[producer.input[2]]).astype(np.float64).reshape(-1),
                (channels,),
            )
            if producer.op_type == "Gemm":
                bias = bias * float(_attr(producer, "beta", 1.0))
        new_weight = _scaled_weight(producer, weight, scale).astype(np.float32)
        new_bias = ((bias - mean) * scale + beta).astype(np.float32)
        w_name, b_name = f"{weight_name}_bn_folded", f"{bn.output[0]}_bias_bn_folded"
        graph.initializer.extend(
            [numpy_helper.from_array(new_weight, w_name), numpy_helper.from_array(new_bias, b_name)]
        )
        inputs = [producer.input[0], w_name, b_name]
        del producer.input[:]
        producer.input.extend(inputs)
        if producer.op_type == "Gemm":
            _set_attr(producer, "beta", 1.0)
        producer.output[0] = bn.output[0]
        removed.add(id(bn))
    if removed:
        kept = [node for node in graph.node if id(node) not in removed]
        del graph.node[:]
        graph.node.extend(kept)
    return len(removed)
