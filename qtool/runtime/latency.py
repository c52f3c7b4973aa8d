"""Latency as deployed: every output fetched, sessions timed alternately so that a machine's
drift hits the float and the quantized model alike."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnxruntime

from qtool.ort.sessions import as_declared

WARMUP_RUNS = 5


def latency_feed(
    inputs: Mapping[str, np.ndarray], input_shapes: Iterable[Sequence]
) -> tuple[dict[str, np.ndarray], int]:
    """The first sample of the first batch, or the whole batch when the batch axis is fixed > 1.

    `input_shapes`: the model's input shapes as ONNX Runtime reports them (ints for fixed
    dims), read from the model rather than found by trying a run that may fail."""
    fixed = {shape[0] for shape in input_shapes if shape and isinstance(shape[0], int)}
    if fixed and fixed != {1}:
        # The model cannot run a single sample; time its fixed batch and say so in the result.
        batch = next(iter(inputs.values())).shape[0]
        return {name: np.ascontiguousarray(a) for name, a in inputs.items()}, batch
    return {name: np.ascontiguousarray(a[:1]) for name, a in inputs.items()}, 1


def measure_latency(
    sessions: list[onnxruntime.InferenceSession],
    feed: dict[str, np.ndarray],
    runs: int,
) -> list[tuple[float, float]]:
    """Median and p90 in ms per session (all outputs, as deployed); runs alternate sessions."""
    feeds = [as_declared(feed, session) for session in sessions]  # an FP16-input model
    for session, own in zip(sessions, feeds, strict=True):
        for _ in range(WARMUP_RUNS):
            session.run(None, own)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(runs):
        for k, session in enumerate(sessions):
            start = time.perf_counter_ns()
            session.run(None, feeds[k])
            times[k].append((time.perf_counter_ns() - start) / 1e6)
    return [(float(np.median(t)), float(np.percentile(t, 90))) for t in times]
