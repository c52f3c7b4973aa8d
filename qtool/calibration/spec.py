"""The calibration stage's settings: data, batching and how ranges are derived."""

from __future__ import annotations

from dataclasses import dataclass

from qtool.data.spec import DataSpec

METHODS = ("minmax", "entropy", "percentile", "mse")

# calibration.bins: the observers keep 2 * bins bins over [-R, R] and halve them in pairs as R
# doubles, so bins must be even; the MSE threshold search is quadratic in bins (0.8 s per tensor
# at 16384, 12 s at 65536), which bounds it above.
MIN_BINS, MAX_BINS = 256, 16384


@dataclass(frozen=True)
class CalibrationSpec:
    data: DataSpec
    batch_size: int = 32
    max_samples: int | None = None
    method: str = "entropy"
    percentile: float = 99.99
    bins: int = 2048
