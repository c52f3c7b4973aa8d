"""Producer/consumer lookups over a prepared model's graph, shared by the layout and the op rules.

The layout walks the graph once per model; the op families (qtool/plan/ops/) read the same
index when they decide whether a node's inputs are float activations, constant weights or
something qtool cannot quantize, so both see one definition of each.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper


class GraphIndex:
    """Producer/consumer indexes over a graph, built once."""

    def __init__(self, model: onnx.ModelProto, float_tensors: set[str]) -> None:
        graph = model.graph
        self.nodes = list(graph.node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_outputs = {o.name for o in graph.output}
        self.float_tensors = float_tensors
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for out in node.output:
                self.producer[out] = node
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)

    def is_float_activation(self, name: str) -> bool:
        return bool(name) and name not in self.initializers and name in self.float_tensors

    def is_float_constant(self, name: str) -> bool:
        init = self.initializers.get(name)
        return init is not None and init.data_type == TensorProto.FLOAT

    def transposed_constant(self, name: str) -> str | None:
        """The 2-D float initializer W when `name` is Transpose(W) (perm [1, 0]): a tied lm_head
        reads its embedding table this way (qtool/model/tie_weights.py), else None."""
        node = self.producer.get(name)
        if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            return None
        source = node.input[0]
        if not self.is_float_constant(source) or len(self.initializers[source].dims) != 2:
            return None
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        return source if perm == [1, 0] else None

    def weight_of(self, node: onnx.NodeProto, planned: Container[str]) -> str | None:
        """The planned weight `node` reads: an input in `planned`, or the initializer behind a
        Transpose input (a tied lm_head reads its table transposed)."""
        for name in node.input:
            if name in planned:
                return name
            source = self.transposed_constant(name) if name else None
            if source is not None and source in planned:
                return source
        return None

    def constant_scalar(self, name: str) -> float | None:
        """The value of a one-element initializer, else None."""
        init = self.initializers.get(name) if name else None
        if init is None or int(np.prod(init.dims, dtype=np.int64)) != 1:
            return None
        return float(numpy_helper.to_array(init).reshape(-1)[0])


def int_attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def float_attribute(node: onnx.NodeProto, name: str, default: float = 1.0) -> float:
    for attr in node.attribute:
        if attr.name == name:
            return float(attr.f)
    return default
