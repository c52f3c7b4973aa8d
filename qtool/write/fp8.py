"""FP8 E4M3 parameters: per-tensor activation scales and per-output-channel weights.

FP8 is symmetric by construction (its zero point is 0 of float8 E4M3FN, the only one TensorRT
accepts): an activation's scale is its range's threshold / 448, a weight channel's its amax /
448, so the largest magnitude lands on E4M3's largest finite value. Weights are stored as float8
initializers behind a DequantizeLinear (half the bytes of FP16 and a quarter of FP32), like the
int8 ones.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from qtool.calibration.fp8_range import FP8_MAX, to_fp8
from qtool.write.params import ActivationParams, WeightParams

_MIN_SCALE = np.float32(1e-12)
FP8_ZERO = np.zeros((), dtype=ml_dtypes.float8_e4m3fn)[()]


def fp8_activation_params(low: float, high: float) -> ActivationParams:
    """Scale threshold / 448 and a float8 zero point for a per-tensor range (low <= 0 <= high)."""
    bound = max(-min(low, 0.0), max(high, 0.0))
    scale = np.float32(bound / FP8_MAX) if bound > 0 else np.float32(1.0)
    return ActivationParams(max(scale, _MIN_SCALE), FP8_ZERO, -bound, bound)


def quantize_fp8_weight(weight: np.ndarray, axis: int | None) -> WeightParams:
    """FP8 E4M3 weight, one scale per output channel along `axis` (None: one for all)."""
    weight = np.asarray(weight, dtype=np.float32)
    if axis is None:
        bound = np.float32(np.abs(weight).max()) if weight.size else np.float32(0.0)
        scale = np.asarray(bound / FP8_MAX if bound > 0 else 1.0, dtype=np.float32)
        return WeightParams(to_fp8(weight / scale), np.maximum(scale, _MIN_SCALE), None)
    moved = np.moveaxis(weight, axis, 0).reshape(weight.shape[axis], -1)
    bound = np.abs(moved).max(axis=1).astype(np.float32)
    scale = np.where(bound > 0, bound / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    scale = np.maximum(scale, _MIN_SCALE)
    shape = [1] * weight.ndim
    shape[axis] = -1
    return WeightParams(to_fp8(weight / scale.reshape(shape)), scale, axis)
