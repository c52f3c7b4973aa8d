"""What each node costs at each precision: the bytes of its constant inputs as stored.

Measured from models the QDQ writer really builds (all candidates' nodes at int8, all at int4),
not from a formula, so block scales, zero points, packed int4 and int32 biases count as the file
stores them. A node's cost is the bytes of the initializers it reads in the float model (weight,
bias) and of what replaces them in the quantized one (`{name}_quantized`, `_scale`,
`_zero_point`, the writer's names). Activation scales and the Q/DQ nodes are not attributed to a
node (a few bytes per tensor); the report gives the predicted and the measured file size, so the
difference is visible.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import numpy_helper

_SUFFIXES = ("", "_quantized", "_scale", "_zero_point")


def stored_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of a tensor's data as the file holds it (int4 packed two per byte)."""
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return int(numpy_helper.to_array(tensor).nbytes)


def constant_inputs(model: onnx.ModelProto, node_name: str) -> list[str]:
    """The initializers the float model's node `node_name` reads (its weight, bias)."""
    initializers = {i.name for i in model.graph.initializer}
    node = next((n for n in model.graph.node if n.name == node_name), None)
    if node is None:
        return []
    return sorted({name for name in node.input if name in initializers})


def node_bytes(model: onnx.ModelProto, tensors: Iterable[str]) -> int:
    """Bytes of `tensors` in `model`, float or replaced by their quantized form."""
    sizes = {i.name: stored_bytes(i) for i in model.graph.initializer}
    total = 0
    for tensor in tensors:
        total += sum(sizes.get(tensor + suffix, 0) for suffix in _SUFFIXES)
    return total
