"""Which of a model's low-bit weights ONNX Runtime runs on a low-bit kernel, and which it expands.

A 4-bit model is always smaller; it is faster only where ORT replaces DequantizeLinear -> MatMul
with MatMulNBits (or gathers from a quantized table with GatherBlockQuantized). Everything else
is dequantized to float and runs at float speed. `qtool evaluate` reads this from the optimized
graph of the model it measured, so the table never implies a speed-up the runtime does not give.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto

from qtool.runtime.fusion import optimized_graph

_LOW_BIT_TYPES = {TensorProto.INT4: "int4", TensorProto.UINT4: "uint4"}
_LOW_BIT_KERNELS = frozenset({"MatMulNBits", "GatherBlockQuantized"})


@dataclass
class LowBitUsage:
    """Counts of 4-bit (and blocked 8-bit) weights by what runs them."""

    kernels: Counter = field(default_factory=Counter)  # ORT op that runs them -> weights
    dequantized: Counter = field(default_factory=Counter)  # consumer op type -> weights

    @property
    def total(self) -> int:
        return sum(self.kernels.values()) + sum(self.dequantized.values())

    def brief(self) -> str:
        """Table-cell form: '2 MatMulNBits, 3 Conv in float'."""
        parts = [f"{n} {op}" for op, n in sorted(self.kernels.items())]
        parts += [f"{n} {op} in float" for op, n in sorted(self.dequantized.items())]
        return ", ".join(parts)

    def describe(self) -> str:
        parts = [f"{n} on {op}" for op, n in sorted(self.kernels.items())]
        parts += [
            f"{n} {op} dequantized to float (float speed)"
            for op, n in sorted(self.dequantized.items())
        ]
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {"kernels": dict(self.kernels), "dequantized": dict(self.dequantized)}


def _low_bit_initializers(model: onnx.ModelProto) -> set[str]:
    return {
        init.name
        for init in model.graph.initializer
        if init.data_type in _LOW_BIT_TYPES or init.name.endswith("_quantized_blocked")
    }


def _is_low_bit_dq(node: onnx.NodeProto, low_bit: set[str]) -> bool:
    if node.op_type != "DequantizeLinear" or not node.input:
        return False
    blocked = any(a.name == "block_size" and a.i > 0 for a in node.attribute)
    return node.input[0] in low_bit or blocked


def written_accuracy_levels(model: onnx.ModelProto) -> Counter:
    """accuracy_level -> count of the MatMulNBits nodes the model file already holds (the
    session option does not change them; it applies only to nodes ORT forms from QDQ)."""
    levels: Counter = Counter()
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            levels[attrs.get("accuracy_level", 0)] += 1
    return levels


def low_bit_usage(model_path: Path, session_config: dict[str, str] | None = None) -> LowBitUsage:
    """Inspect the model as ORT optimizes it (with the same session config as the measurement)."""
    model = onnx.load(str(model_path), load_external_data=False)
    low_bit = _low_bit_initializers(model)
    usage = LowBitUsage()
    weights = {n.input[0] for n in model.graph.node if _is_low_bit_dq(n, low_bit)}
    weights |= {
        n.input[0] for n in model.graph.node if n.op_type == "GatherBlockQuantized" and n.input
    }
    weights |= {  # written as MatMulNBits already (qtool/quantize/matmul_nbits.py)
        n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits" and len(n.input) > 1
    }
    if not weights:
        return usage
    consumers: dict[str, list[str]] = {}
    for node in model.graph.node:
        if _is_low_bit_dq(node, low_bit):
            readers = [n.op_type for n in model.graph.node if node.output[0] in n.input]
            consumers[node.input[0]] = readers
    ort = optimized_graph(model_path, config=session_config)
    for weight in sorted(weights):
        runner = next(
            (
                n.op_type
                for n in ort.graph.node
                if n.op_type in _LOW_BIT_KERNELS
                and any(i == weight or i.startswith(weight + "_") for i in n.input)
            ),
            None,
        )
        if runner is not None:
            usage.kernels[runner] += 1
        else:
            reader = (consumers.get(weight) or ["?"])[0]
            usage.dequantized[reader] += 1
    return usage
