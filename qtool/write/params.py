"""Quantization parameters: scales, zero points and the integer weight and bias tensors.

Weights are symmetric int8 in [-127, 127] (not -128) so that negating a weight never overflows and
TensorRT's symmetric kernels accept them; biases are int32 with scale = input scale x weight scale,
the form both ORT's QLinearConv/QGemm and TensorRT fold into the integer accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool import kernels

_MIN_SCALE = np.float32(1e-8)


@dataclass(frozen=True)
class ActivationParams:
    scale: np.float32
    zero_point: np.generic  # np.uint8 / np.int8, or float8 E4M3FN 0 for FP8 (write/fp8.py)
    low: float
    high: float

    @property
    def dtype(self) -> type:
        return type(self.zero_point)


@dataclass(frozen=True)
class WeightParams:
    values: np.ndarray  # int8 (or uint8 for the U8U8 format), the weight's own shape
    scale: np.ndarray  # float32, [C] or scalar
    axis: int | None
    zero_point: np.ndarray | None = None  # None: 0 in the values' dtype (symmetric)

    def zero_point_array(self) -> np.ndarray:
        """The zero point as stored: the scale's shape, the values' dtype."""
        if self.zero_point is not None:
            return np.asarray(self.zero_point, dtype=self.values.dtype)
        return np.zeros(np.shape(self.scale), dtype=self.values.dtype)


def activation_params(low: float, high: float, symmetric: bool) -> ActivationParams:
    """Scale and zero point for a per-tensor activation range (low <= 0 <= high)."""
    low, high = min(low, 0.0), max(high, 0.0)
    if symmetric:
        bound = max(-low, high)
        scale = np.float32(bound / 127.0) if bound > 0 else np.float32(1.0)
        return ActivationParams(max(scale, _MIN_SCALE), np.int8(0), -bound, bound)
    span = high - low
    scale = np.float32(span / 255.0) if span > 0 else np.float32(1.0)
    scale = max(scale, _MIN_SCALE)
    zero_point = int(np.clip(np.round(-low / float(scale)), 0, 255))
    return ActivationParams(scale, np.uint8(zero_point), low, high)


def quantize_weight(weight: np.ndarray, axis: int | None, device: str = "cpu") -> WeightParams:
    """Symmetric int8 weight, per output channel along `axis` (None: one scale for all)."""
    weight = np.asarray(weight, dtype=np.float32)
    if axis is None:
        low, high, _ = kernels.tensor_minmax(weight, device=device)
        bound = np.float32(max(abs(low), abs(high)))
        scale = np.float32(bound / 127.0) if bound > 0 else np.float32(1.0)
        values = np.clip(np.round(weight / scale), -127, 127).astype(np.int8)
        return WeightParams(values, np.asarray(scale, dtype=np.float32), None)
    lows, highs = kernels.channel_minmax(weight, axis=axis, device=device)
    bound = np.maximum(np.abs(lows), np.abs(highs)).astype(np.float32)
    scale = np.where(bound > 0, bound / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    shape = [1] * weight.ndim
    shape[axis] = -1
    values = np.clip(np.round(weight / scale.reshape(shape)), -127, 127).astype(np.int8)
    return WeightParams(values, scale, axis)


def quantize_bias(bias: np.ndarray, input_scale: np.float32, weight_scale: np.ndarray) -> tuple:
    """int32 bias and its scale (input scale x weight scale, per channel when the weight is)."""
    scale = (np.float32(input_scale) * np.asarray(weight_scale, dtype=np.float32)).astype(
        np.float32
    )
    scale = np.maximum(scale, _MIN_SCALE)
    limit = np.iinfo(np.int32)
    values = np.clip(np.round(np.asarray(bias, np.float64) / scale), limit.min, limit.max)
    return values.astype(np.int32), scale
