"""The two shapes cross-layer equalization and bias absorption both work on: a pair of Convs
joined by an activation, and a Conv's weights held as float64 while they are rescaled."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx


@dataclass
class ConvPair:
    first: onnx.NodeProto
    second: onnx.NodeProto
    activation: str = "none"  # "Relu", "Clip" or "none"
    bound: float | None = None  # Clip's upper bound (None: Relu-like, exact for every input)
    pad: bool = False  # a zero Pad between the activation and B

    @property
    def key(self) -> tuple[str, str]:
        return (self.first.name, self.second.name)


@dataclass
class EqualizedConv:
    node: onnx.NodeProto
    weight: np.ndarray  # float64 copy, written back at the end
    bias: np.ndarray | None
    group: int

    @property
    def depthwise(self) -> bool:
        return self.group > 1 and self.weight.shape[1] == 1 and self.group == self.weight.shape[0]
