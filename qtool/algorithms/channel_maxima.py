"""Per-channel maxima of chosen float tensors over calibration data (one ORT pass).

Cross-layer equalization through Clip(0, 6) needs to know, per channel, how high the Clip's input
ever goes (cle.py: a channel that never reaches the bound may be scaled up to it, one that does
must stay as it is). The float model is run once with the tensors exposed as extra outputs (as
bias correction and calibration expose theirs), and only a running max per channel is kept:
memory is a few floats per channel whatever the number of samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx

from qtool.calibration.collect import session_with_outputs
from qtool.errors import CalibrationError, DataError
from qtool.ort_session import ort_reason


def channel_maxima(
    model: onnx.ModelProto, tensors: list[str], batches: Iterable[Mapping[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], int]:
    """Max per channel (axis 1) of each of `tensors` over every sample of `batches`, and the
    number of samples (the form cle.equalize asks for).

    Raises CalibrationError when no batch came, DataError when ORT rejects one."""
    if not tensors:
        return {}, 0
    session = session_with_outputs(model, tensors)
    maxima: dict[str, np.ndarray] = {}
    samples = 0
    for index, feed in enumerate(batches):
        try:
            values = session.run(tensors, dict(feed))
        except Exception as exc:  # ORT raises private types for bad feeds
            raise DataError(f"channel maxima: batch {index} failed: {ort_reason(exc)}") from None
        for name, value in zip(tensors, values, strict=True):
            array = np.asarray(value, np.float64)
            if array.ndim < 2:
                raise CalibrationError(f"channel maxima: tensor '{name}' has no channel axis")
            high = array.max(axis=tuple(a for a in range(array.ndim) if a != 1))
            maxima[name] = high if name not in maxima else np.maximum(maxima[name], high)
        samples += len(values[0])
    if not maxima:
        raise CalibrationError("channel maxima need at least one calibration batch")
    return maxima, samples
