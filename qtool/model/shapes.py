"""ONNX shape inference on a weight-free copy of the graph.

`onnx.shape_inference.infer_shapes` serializes the whole model to hand it to C++ and parses the
result back: for a 90 MB BERT that is most of preparation's time, spent copying weights whose only
relevance to inference is their type and shape. Inference reads initializer *values* only where an
op takes a shape-like input (Reshape/Expand/Slice/Tile/... and data propagation through Shape
arithmetic), and those are small integer vectors. So large initializers travel as graph inputs
of the same type and shape instead: the inferred types are the same, at the cost of the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, shape_inference

from qtool.errors import ModelError

__all__ = ["Inference", "infer", "static_shape", "write_inference"]

# Initializers with more elements than this travel as typed graph inputs (no data): no shape-like
# input is anywhere near this long, and every weight matrix is far longer.
_MAX_VALUE_ELEMENTS = 1024
_GRAPH_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


@dataclass(frozen=True)
class Inference:
    """What inference found for the main graph, in the order ONNX writes it."""

    inputs: list[onnx.ValueInfoProto]  # the skeleton's: graph inputs and the large initializers
    value_info: list[onnx.ValueInfoProto]
    outputs: list[onnx.ValueInfoProto]
    # Nodes carrying subgraphs, by index: inference writes value_info inside their bodies too.
    subgraph_nodes: dict[int, onnx.NodeProto]

    def types(self) -> dict[str, onnx.TypeProto]:
        return {vi.name: vi.type for vi in [*self.inputs, *self.value_info, *self.outputs]}


def infer(model: onnx.ModelProto) -> Inference:
    """Run ONNX shape inference (non-strict, with data propagation) without touching `model`.

    Non-strict: a node ONNX cannot infer (custom domain) must not stop inference elsewhere.
    """
    inferred = _run(_skeleton(model), model.graph.name)
    graph = inferred.graph
    subgraph_nodes = {
        i: node
        for i, node in enumerate(graph.node)
        if any(a.type in _GRAPH_ATTRS for a in node.attribute)
    }
    return Inference(list(graph.input), list(graph.value_info), list(graph.output), subgraph_nodes)


def write_inference(model: onnx.ModelProto, inference: Inference) -> None:
    """Store an inference result in `model`, which must have the graph it was computed on."""
    graph = model.graph
    del graph.value_info[:]
    graph.value_info.extend(inference.value_info)
    del graph.output[:]
    graph.output.extend(inference.outputs)
    for index, inferred in inference.subgraph_nodes.items():
        # Only the bodies: the node's own fields (its name) may have changed since inference.
        bodies = {a.name: a for a in inferred.attribute if a.type in _GRAPH_ATTRS}
        for attr in graph.node[index].attribute:
            if attr.name in bodies:
                attr.CopyFrom(bodies[attr.name])


def static_shape(t: onnx.TypeProto | None) -> list[int] | None:
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    dims = t.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return [int(d.dim_value) for d in dims]


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every large initializer replaced by a typed graph input of its name."""
    src = model.graph
    skeleton = onnx.ModelProto()
    # Only what inference reads: the IR version, the opsets and the model-local functions.
    skeleton.ir_version = model.ir_version
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph = skeleton.graph
    graph.name = src.name
    graph.node.extend(src.node)
    graph.input.extend(src.input)
    graph.output.extend(src.output)
    graph.value_info.extend(src.value_info)
    graph.sparse_initializer.extend(src.sparse_initializer)
    for init in src.initializer:
        if int(np.prod(init.dims, dtype=np.int64)) <= _MAX_VALUE_ELEMENTS:
            graph.initializer.append(init)
        else:
            graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, init.dims))
    return skeleton


def _run(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise ModelError(f"ONNX shape inference failed on model {name!r}: {detail}") from exc
