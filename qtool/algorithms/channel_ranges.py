"""Per-channel minima and maxima of chosen float tensors over calibration data (one ORT pass).

Cross-layer equalization needs both ends of A's output channels (A's output being the input of
the activation between A and B; cle.py): through Clip(0, 6) the maxima say which channels ever
reach the bound (those keep scale 1, the others may be scaled up to it), and bias absorption
(bias_absorption.py) needs the minima, how far a channel can be shifted down before the activation
would cut what it did not cut before. The float model is run once with the tensors exposed as
extra outputs (as bias correction and calibration expose theirs), and only a running min and max
per channel is kept: memory is a few floats per channel whatever the number of samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from qtool.calibration.collect import session_with_outputs
from qtool.errors import CalibrationError, DataError
from qtool.ort.sessions import ort_reason


@dataclass
class ChannelRanges:
    """Per tensor name, the min and max of each channel (axis 1), and the samples they saw."""

    minima: dict[str, np.ndarray] = field(default_factory=dict)
    maxima: dict[str, np.ndarray] = field(default_factory=dict)
    samples: int = 0


def channel_ranges(
    model: onnx.ModelProto, tensors: list[str], batches: Iterable[Mapping[str, np.ndarray]]
) -> ChannelRanges:
    """Min and max per channel (axis 1) of each of `tensors` over every sample of `batches`
    (the form cle.equalize asks for).

    Raises CalibrationError when no batch came, DataError when ORT rejects one."""
    ranges = ChannelRanges()
    if not tensors:
        return ranges
    session = session_with_outputs(model, tensors)
    for index, feed in enumerate(batches):
        try:
            values = session.run(tensors, dict(feed))
        except Exception as exc:  # ORT raises private types for bad feeds
            raise DataError(f"channel ranges: batch {index} failed: {ort_reason(exc)}") from None
        for name, value in zip(tensors, values, strict=True):
            array = np.asarray(value, np.float64)
            if array.ndim < 2:
                raise CalibrationError(f"channel ranges: tensor '{name}' has no channel axis")
            axes = tuple(a for a in range(array.ndim) if a != 1)
            low, high = array.min(axis=axes), array.max(axis=axes)
            if name in ranges.maxima:
                low = np.minimum(ranges.minima[name], low)
                high = np.maximum(ranges.maxima[name], high)
            ranges.minima[name], ranges.maxima[name] = low, high
        ranges.samples += len(values[0])
    if not ranges.maxima:
        raise CalibrationError("channel ranges need at least one calibration batch")
    return ranges
