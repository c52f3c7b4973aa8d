"""Write the QDQ model: the float graph with QuantizeLinear/DequantizeLinear pairs inserted.

Weights and biases are stored already quantized (int8/int32 initializers followed by a
DequantizeLinear) instead of float weights behind a Q/DQ pair: the file is ~4x smaller and ORT and
TensorRT constant-fold nothing at load time. Node and tensor names derive from the original tensor
names, so the output is deterministic and readable in Netron.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.quantize.layout import Layout
from qtool.quantize.params import ActivationParams, WeightParams


@dataclass(frozen=True)
class BiasParams:
    values: np.ndarray  # int32
    scale: np.ndarray  # float32, [C] or scalar


def _dequantize_node(name: str, inputs: list[str], output: str, axis: int | None) -> onnx.NodeProto:
    attrs = {"axis": axis} if axis is not None else {}
    return helper.make_node("DequantizeLinear", inputs, [output], name=name, **attrs)


def write_qdq_model(
    model: onnx.ModelProto,
    layout: Layout,
    activations: dict[str, ActivationParams],
    weights: dict[str, WeightParams],
    biases: dict[str, BiasParams],
) -> onnx.ModelProto:
    """Return a new model; `model` is the prepared float model the layout was planned on."""
    graph = model.graph
    replaced = set(weights) | set(biases)
    new_initializers = [init for init in graph.initializer if init.name not in replaced]
    head_nodes: list[onnx.NodeProto] = []  # weight/bias DequantizeLinear, placed first
    rename: dict[str, str] = {}  # tensor -> dequantized tensor read by consumers

    constants = [
        (name, weights[name].values, weights[name].scale, weights[name].axis)
        for name in sorted(weights)
    ]
    for name in sorted(biases):
        scale = biases[name].scale
        constants.append((name, biases[name].values, scale, 0 if scale.ndim == 1 else None))
    for name, values, scale_values, axis in constants:
        quant, scale, zero = f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"
        new_initializers.append(numpy_helper.from_array(values, quant))
        new_initializers.append(numpy_helper.from_array(scale_values.astype(np.float32), scale))
        new_initializers.append(
            numpy_helper.from_array(np.zeros(scale_values.shape, dtype=values.dtype), zero)
        )
        rename[name] = f"{name}_dequantized"
        head_nodes.append(
            _dequantize_node(f"{name}_DequantizeLinear", [quant, scale, zero], rename[name], axis)
        )

    pairs_after: dict[str, list[onnx.NodeProto]] = {}  # source tensor -> its Q/DQ nodes
    graph_inputs = {i.name for i in graph.input}
    for tensor in sorted(activations):
        slot = layout.activations[tensor]
        params = activations[tensor]
        scale, zero = f"{tensor}_scale", f"{tensor}_zero_point"
        quantized, dequantized = f"{tensor}_quantized", f"{tensor}_dequantized"
        new_initializers.append(
            numpy_helper.from_array(np.asarray(params.scale, np.float32), scale)
        )
        new_initializers.append(numpy_helper.from_array(np.asarray(params.zero_point), zero))
        nodes = [
            helper.make_node(
                "QuantizeLinear",
                [slot.source, scale, zero],
                [quantized],
                name=f"{tensor}_QuantizeLinear",
            ),
            _dequantize_node(
                f"{tensor}_DequantizeLinear", [quantized, scale, zero], dequantized, None
            ),
        ]
        pairs_after.setdefault(slot.source, []).extend(nodes)
        rename[tensor] = dequantized

    folded = set(layout.folded_relus)
    body: list[onnx.NodeProto] = []
    for source in sorted(s for s in pairs_after if s in graph_inputs):
        body.extend(pairs_after[source])
    for node in graph.node:
        if node.name in folded:
            continue
        rewritten = onnx.NodeProto()
        rewritten.CopyFrom(node)
        for index, name in enumerate(rewritten.input):
            if name in rename:
                rewritten.input[index] = rename[name]
        body.append(rewritten)
        for out in node.output:
            body.extend(pairs_after.get(out, []))

    # The prepared model's shapes, for tensors that still exist: without them ORT infers fresh
    # symbols for dims after a Reshape and drops shape-checked fusions (SkipLayerNormalization).
    produced = {out for node in body for out in node.output}
    new_graph = helper.make_graph(
        head_nodes + body,
        graph.name,
        list(graph.input),
        list(graph.output),
        initializer=new_initializers,
        value_info=[vi for vi in graph.value_info if vi.name in produced],
    )
    quantized_model = helper.make_model(
        new_graph,
        opset_imports=list(model.opset_import),
        producer_name="qtool",
        producer_version=_version(),
    )
    quantized_model.ir_version = model.ir_version
    onnx.checker.check_model(quantized_model)
    return quantized_model


def _version() -> str:
    from qtool import __version__

    return __version__
