"""Streaming per-tensor statistics whose size never depends on the number of samples.

The histogram covers [-R, R] where R is always a power of two strictly above every |x| seen.
When a batch exceeds R, R doubles and pairs of bins merge, which is exact: a value's bin at 2R is
the merge of its bin at R. So the final histogram equals the one a single pass over all the data
would build at the final R, whatever the batch size or order (counts are integers, min/max are
exact), which is what makes the stats file independent of the batch size.

Each batch costs one fused pass over the tensor (kernels.observe: min/max and the histogram at the
current range); only a batch that grows the range takes a second pass at the new range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qtool import kernels
from qtool.errors import CalibrationError


@dataclass
class TensorStats:
    """Everything any range method needs about one tensor."""

    name: str
    minimum: float
    maximum: float
    half_range: float  # R: the histogram spans [-R, R]; 0 while every value seen was 0
    counts: np.ndarray  # int64 [bins], uniform over [-R, R]
    samples: int

    @property
    def bin_width(self) -> float:
        return 2.0 * self.half_range / len(self.counts)


def _lower(a: float, b: float) -> float:
    """min in the kernels' total order (-0.0 < +0.0), so the result never depends on batch order."""
    return b if b < a or (b == a and math.copysign(1.0, b) < math.copysign(1.0, a)) else a


def _higher(a: float, b: float) -> float:
    return b if b > a or (b == a and math.copysign(1.0, b) > math.copysign(1.0, a)) else a


def _power_of_two_above(value: float) -> float:
    """Smallest power of two strictly greater than value (value > 0)."""
    exponent = math.floor(math.log2(value)) + 1
    result = math.ldexp(1.0, exponent)
    while result <= value:  # guard against log2 rounding
        result *= 2.0
    return result


# The largest power of two a float32 histogram range can take.
_TOP_RANGE = 2.0**127


class HistogramObserver:
    """Running min/max plus a range-doubling histogram of one activation tensor."""

    def __init__(self, name: str, bins: int, device: str = "cpu") -> None:
        if bins < 4 or bins % 4:
            raise CalibrationError(f"histogram bins must be a positive multiple of 4, got {bins}")
        self.name = name
        self.bins = bins
        self.device = device
        self.minimum = math.inf
        self.maximum = -math.inf
        self.half_range = 0.0
        self.counts = np.zeros(bins, dtype=np.int64)
        self.zeros_pending = 0  # samples seen while every value was exactly 0
        self.samples = 0

    def update(self, values: np.ndarray) -> None:
        if values.size == 0:
            return
        low, high, nonfinite, accumulated = kernels.observe(
            values, self.half_range, self.counts, device=self.device
        )
        if nonfinite:
            raise CalibrationError(
                f"tensor '{self.name}' has {nonfinite} NaN/Inf values during calibration "
                "(check the model and the calibration data)"
            )
        self.samples += int(values.shape[0]) if values.ndim else 1
        self.minimum = _lower(self.minimum, low)
        self.maximum = _higher(self.maximum, high)
        if accumulated:  # every |x| < R: counted at the current range in the same pass
            return
        magnitude = max(abs(low), abs(high))
        if magnitude == 0.0:  # only while R is still 0: observe counts zeros once R > 0
            self.zeros_pending += values.size
            return
        if magnitude >= _TOP_RANGE:
            # A tensor reaching float32's own limit (an attention mask of finfo.min, observed
            # for the FP16 typing pass): the histogram stops at 2^127, its edge bins take the
            # rest; min and max above are exact.
            edge = np.nextafter(np.float32(_TOP_RANGE), np.float32(0))
            values = np.clip(values, -edge, edge)
            self._grow(_TOP_RANGE)
        else:
            self._grow(_power_of_two_above(magnitude))
        *_, accumulated = kernels.observe(values, self.half_range, self.counts, device=self.device)
        if not accumulated:
            raise CalibrationError(
                f"tensor '{self.name}': the histogram kernel rejected a range ({self.half_range}) "
                f"above every value (max |x| = {magnitude}); this is a qtool bug"
            )

    def _grow(self, new_half_range: float) -> None:
        if self.half_range == 0.0:
            self.half_range = new_half_range
            self.counts[self.bins // 2] += self.zeros_pending
            self.zeros_pending = 0
            return
        while self.half_range < new_half_range:
            merged = self.counts.reshape(-1, 2).sum(axis=1)
            self.counts = np.zeros_like(self.counts)
            quarter = self.bins // 4
            self.counts[quarter : quarter + len(merged)] = merged
            self.half_range *= 2.0

    def result(self) -> TensorStats:
        if self.samples == 0:
            raise CalibrationError(f"tensor '{self.name}' received no calibration data")
        counts = self.counts.copy()
        half_range = self.half_range
        if half_range == 0.0:  # every value was 0: any positive range works; keep it canonical
            half_range = 1.0
            counts[self.bins // 2] += self.zeros_pending
        return TensorStats(
            self.name, float(self.minimum), float(self.maximum), half_range, counts, self.samples
        )
