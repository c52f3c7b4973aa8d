"""FP8 E4M3 activation ranges: the threshold T whose scale T / 448 an activation is quantized by.

FP8 E4M3FN keeps 3 mantissa bits at every magnitude down to 2^-6 (then subnormal steps of 2^-9)
and saturates at 448, so its rounding error is relative, not the uniform step of int8. The range
methods follow the int8 ones where the threshold means the same thing, and differ where the grid
matters:

- minmax: T = amax (ModelOpt's and TensorRT's FP8 "max" calibration);
- percentile: the symmetric percentile of |x|, as for int8;
- entropy: TensorRT's int8 KL threshold (the one ModelOpt converts to FP8 by 448 / 127);
- mse: the T minimising the expected squared error of E4M3 rounding over the histogram of |x|,
  searched on FP8's own grid (an int8 MSE threshold would clip for a uniform grid FP8 lacks).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from qtool.calibration.observers import TensorStats
from qtool.calibration.ranges import compute_range, one_sided_histogram

FP8_MAX = 448.0  # largest finite float8 E4M3FN
# Candidate thresholds for the MSE search, from this share of the extent up to all of it.
_MSE_LOWEST = 0.25
_MSE_CANDIDATES = 192


def to_fp8(values: np.ndarray) -> np.ndarray:
    """`values` rounded to float8 E4M3FN (nearest even), saturated at +-448 (ml_dtypes' cast
    would give NaN past it)."""
    clipped = np.clip(np.asarray(values, dtype=np.float32), -FP8_MAX, FP8_MAX)
    return clipped.astype(ml_dtypes.float8_e4m3fn)


def fp8_round(values: np.ndarray) -> np.ndarray:
    """`values` rounded through E4M3 and back to float32."""
    return to_fp8(values).astype(np.float32)


def _mse_threshold(stats: TensorStats) -> float:
    """The clipping threshold with the least expected squared E4M3 error over |x|."""
    hist, width = one_sided_histogram(stats)
    if hist.sum() == 0:
        return len(hist) * width
    extent = len(hist) * width
    centers = (np.arange(len(hist), dtype=np.float64) + 0.5) * width
    weights = hist.astype(np.float64)
    candidates = np.linspace(_MSE_LOWEST * extent, extent, _MSE_CANDIDATES)
    errors = np.empty(len(candidates))
    for index, threshold in enumerate(candidates):
        scale = threshold / FP8_MAX
        restored = fp8_round(centers / scale).astype(np.float64) * scale
        errors[index] = float(np.dot(weights, (restored - centers) ** 2))
    return float(candidates[int(np.argmin(errors))])


def compute_fp8_range(
    stats: TensorStats, method: str, percentile: float = 99.99, device: str = "cpu"
) -> tuple[float, float]:
    """[-T, T] for one activation tensor quantized to FP8 E4M3 (symmetric: FP8 has no zero
    point other than 0)."""
    bound = max(-min(stats.minimum, 0.0), max(stats.maximum, 0.0))
    if method == "mse":
        threshold = min(_mse_threshold(stats), bound)
        return -threshold, threshold
    return compute_range(stats, method, True, percentile, device)
