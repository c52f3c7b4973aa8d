"""Run the float model in ONNX Runtime batch by batch and feed every tensor to its observer.

The tensors to observe are added as extra graph outputs, so one ORT run per batch yields all of
them; each is reduced to bounded statistics before the next batch runs, so memory depends on the
batch size and the model, never on the number of calibration samples.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from qtool.calibration.observers import HistogramObserver, TensorStats
from qtool.data import Batch
from qtool.errors import CalibrationError
from qtool.ort_session import create_session, ort_reason


def with_extra_outputs(model: onnx.ModelProto, tensors: list[str]) -> onnx.ModelProto:
    """A copy of `model` that also returns `tensors` (their types come from shape inference)."""
    augmented = onnx.ModelProto()
    augmented.CopyFrom(model)
    graph = augmented.graph
    existing = {o.name for o in graph.output}
    typed = {vi.name: vi for vi in list(graph.value_info) + list(graph.input) + list(graph.output)}
    for name in tensors:
        if name in existing:
            continue
        if name not in typed:
            raise CalibrationError(f"tensor '{name}' has no inferred type; cannot observe it")
        value = onnx.ValueInfoProto()
        value.CopyFrom(typed[name])
        graph.output.append(value)
    return augmented


def collect_statistics(
    model: onnx.ModelProto,
    tensors: list[str],
    batches: Iterable[Batch],
    *,
    bins: int,
    device: str = "cpu",
    total_samples: int | None = None,
    progress: bool = True,
    threads: int | None = None,
) -> list[TensorStats]:
    """Statistics for each of `tensors`, in the given order."""
    session = create_session(
        with_extra_outputs(model, tensors).SerializeToString(), threads=threads
    )
    observers = [HistogramObserver(name, bins * 2, device=device) for name in tensors]
    columns = (
        TextColumn("calibrating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("samples"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task("calibrate", total=total_samples)
        for batch in batches:
            try:
                values = session.run(tensors, batch.inputs)
            except Exception as exc:  # ORT raises its own exception types for bad feeds
                raise CalibrationError(
                    f"ONNX Runtime failed on a calibration batch: {ort_reason(exc)}"
                ) from None
            for observer, array in zip(observers, values, strict=True):
                observer.update(array)
            del values  # free this batch's outputs before ORT allocates the next batch's
            bar.advance(task, len(batch))
    return [observer.result() for observer in observers]
