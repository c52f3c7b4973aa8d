"""Fake quantizers: what the QDQ pairs and stored weights compute, in differentiable torch.

Activations: y = (clamp(round(x / s) + z, qmin, qmax) - z) * s, QuantizeLinear then
DequantizeLinear (round half to even, as ONNX and torch both round). The rounding passes the
gradient straight through (STE); clamping stops it outside the range. With `learn` the scale is
a parameter trained as LSQ does (Esser et al. 2020): the same expression differentiated in s,
the gradient scaled by 1/sqrt(numel * qmax) so the scale moves at the pace of the weights.

Weights: the dequantized weight comes from the very function the writer stores it with
(choose_weight for int8 kernel weights, so the CPU's pair-safe format is what trains;
quantize_low_bit for 4-bit and blocked weights), with a straight-through gradient. Training
therefore sees exactly the weight values ONNX Runtime will multiply with.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from qtool.quantize.int4 import BlockwiseWeight, dequantize
from qtool.quantize.params import ActivationParams, WeightParams

_MIN_SCALE = 1e-8


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round() forward, identity backward."""
    return x + (torch.round(x) - x).detach()


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x forward, gradient times `factor` backward (LSQ's step-size gradient scale)."""
    return (x - x * factor).detach() + x * factor


def activation_range(params: ActivationParams) -> tuple[int, int]:
    return (-128, 127) if params.dtype is np.int8 else (0, 255)


class ActivationQuantizer(nn.Module):
    """One QDQ pair: per-tensor scale (a parameter with LSQ) and a fixed zero point."""

    def __init__(self, params: ActivationParams, learn: bool = False) -> None:
        super().__init__()
        scale = torch.tensor(float(params.scale), dtype=torch.float32)
        if learn:
            self.scale = nn.Parameter(scale)
        else:
            self.register_buffer("scale", scale)
        self.learn = learn
        self.register_buffer("zero_point", torch.tensor(float(params.zero_point)))
        self.qmin, self.qmax = activation_range(params)
        self.dtype = params.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale.clamp(min=_MIN_SCALE)
        if self.learn:
            scale = scale_gradient(scale, 1.0 / math.sqrt(x.numel() * self.qmax))
        q = torch.clamp(round_ste(x / scale) + self.zero_point, self.qmin, self.qmax)
        return (q - self.zero_point) * scale

    def params(self) -> ActivationParams:
        """The pair as the writer stores it (the scale as float32, exactly what trained)."""
        scale = np.float32(max(float(self.scale.detach()), _MIN_SCALE))
        zero = int(self.zero_point)
        low = float((self.qmin - zero) * scale)
        high = float((self.qmax - zero) * scale)
        return ActivationParams(scale, self.dtype(zero), low, high)


def dequantized_weight(params: WeightParams | BlockwiseWeight, transposed: bool) -> np.ndarray:
    """The float32 weight DequantizeLinear reconstructs, in the torch parameter's layout."""
    if isinstance(params, BlockwiseWeight):
        weight = dequantize(params)
    else:
        values = params.values.astype(np.float32)
        zero = params.zero_point_array().astype(np.float32)
        scale = np.asarray(params.scale, np.float32)
        if params.axis is not None:
            shape = [1] * values.ndim
            shape[params.axis] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        weight = ((values - zero) * scale).astype(np.float32)
    return np.ascontiguousarray(weight.T) if transposed else weight


class StoredWeightQuantizer(nn.Module):
    """A parametrization: the weight as the writer would store it, straight-through gradient.

    `store` maps the float weight (numpy, torch layout) to the writer's parameters.
    """

    def __init__(
        self, store: Callable[[np.ndarray], WeightParams | BlockwiseWeight], transposed: bool
    ) -> None:
        super().__init__()
        self.store = store
        self.transposed = transposed

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        params = self.store(weight.detach().cpu().numpy())
        stored = torch.from_numpy(dequantized_weight(params, self.transposed)).to(weight.device)
        return weight + (stored - weight).detach()
