"""Per-channel maxima and minima of chosen float tensors over calibration data (one ORT pass).

Cross-layer equalization through Clip(0, 6) needs to know, per channel, how high the Clip's input
ever goes (cle.py: a channel that never reaches the bound may be scaled up to it, one that does
must stay as it is). The float model is run once with the tensors exposed as extra outputs (as
bias correction and calibration expose theirs), and only a running max/min per channel is kept:
memory is a few floats per channel whatever the number of samples.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from qtool.calibration.collect import save_with_extra_outputs
from qtool.errors import CalibrationError, DataError
from qtool.ort_session import create_session, ort_reason


@dataclass
class ChannelExtremes:
    """Running per-channel max and min of one NC... tensor (channel axis 1), and rows seen."""

    maximum: np.ndarray
    minimum: np.ndarray
    samples: int


def channel_extremes(
    model: onnx.ModelProto, tensors: list[str], batches: Iterable[Mapping[str, np.ndarray]]
) -> dict[str, ChannelExtremes]:
    """Max and min per channel (axis 1) of each of `tensors` over every sample of `batches`.

    Raises CalibrationError when no batch came, DataError when ORT rejects one."""
    if not tensors:
        return {}
    with tempfile.TemporaryDirectory(prefix="qtool-channels-") as tmp:
        path = Path(tmp) / "model.onnx"
        save_with_extra_outputs(model, tensors, path)
        session = create_session(path)
    found: dict[str, ChannelExtremes] = {}
    for index, feed in enumerate(batches):
        try:
            values = session.run(tensors, dict(feed))
        except Exception as exc:  # ORT raises private types for bad feeds
            raise DataError(f"channel maxima: batch {index} failed: {ort_reason(exc)}") from None
        for name, value in zip(tensors, values, strict=True):
            array = np.asarray(value, np.float64)
            if array.ndim < 2:
                raise CalibrationError(f"channel maxima: tensor '{name}' has no channel axis")
            axes = tuple(a for a in range(array.ndim) if a != 1)
            high, low = array.max(axis=axes), array.min(axis=axes)
            seen = found.get(name)
            if seen is None:
                found[name] = ChannelExtremes(high, low, array.shape[0])
            else:
                seen.maximum = np.maximum(seen.maximum, high)
                seen.minimum = np.minimum(seen.minimum, low)
                seen.samples += array.shape[0]
    if len(found) != len(tensors):
        raise CalibrationError("channel maxima need at least one calibration batch")
    return found


def channel_maxima(
    model: onnx.ModelProto, tensors: list[str], batches: Iterable[Mapping[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], int]:
    """Per-channel maxima of `tensors` and the number of samples they were taken over (the
    form cle.equalize asks for)."""
    found = channel_extremes(model, tensors, batches)
    samples = min((e.samples for e in found.values()), default=0)
    return {name: e.maximum for name, e in found.items()}, samples
