"""Run the float model in ONNX Runtime batch by batch and feed every tensor to its observer.

The tensors to observe are added as extra graph outputs, so one ORT run per batch yields all of
them; each is reduced to bounded statistics before the next batch runs, so memory depends on the
batch size and the model, never on the number of calibration samples.

Memory: the model with the extra outputs is written to a temporary file and the session created
from that path. A session built from bytes keeps them (onnxruntime's Python wrapper holds
`_model_bytes`), and an augmented copy of the ModelProto would double the model again, so the
outputs are appended to the caller's graph only while it is serialized. ORT returns outputs as
numpy arrays over its own buffers (no copy) and float32 contiguous arrays go to the kernels as
they are, so the only per-batch memory is what the session itself allocates.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path

import onnx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from qtool.calibration.observers import HistogramObserver, TensorStats
from qtool.data import Batch
from qtool.errors import CalibrationError, ModelError
from qtool.ort_session import create_session, ort_reason
from qtool.phases import phase


def _extra_outputs(model: onnx.ModelProto, tensors: list[str]) -> list[onnx.ValueInfoProto]:
    """Value infos for the `tensors` that are not graph outputs yet (types from shape inference)."""
    graph = model.graph
    existing = {o.name for o in graph.output}
    typed = {vi.name: vi for vi in list(graph.value_info) + list(graph.input) + list(graph.output)}
    extra = []
    for name in tensors:
        if name in existing:
            continue
        if name not in typed:
            raise CalibrationError(f"tensor '{name}' has no inferred type; cannot observe it")
        value = onnx.ValueInfoProto()
        value.CopyFrom(typed[name])
        extra.append(value)
        existing.add(name)
    return extra


def save_with_extra_outputs(model: onnx.ModelProto, tensors: list[str], path: Path) -> None:
    """Write `model` plus the extra outputs to `path` without copying the ModelProto: the outputs
    are appended for the serialization and removed again, so `model` is unchanged afterwards."""
    extra = _extra_outputs(model, tensors)
    outputs = model.graph.output
    keep = len(outputs)
    outputs.extend(extra)
    try:
        path.write_bytes(model.SerializeToString())
    finally:
        del outputs[keep:]


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
    with (
        phase("calibrating: loading the model into ONNX Runtime"),
        tempfile.TemporaryDirectory(prefix="qtool-calib-") as tmp,
    ):
        path = Path(tmp) / "calibration.onnx"
        save_with_extra_outputs(model, tensors, path)
        try:
            session = create_session(path, threads=threads)  # ORT has read the file; it can go
        except ModelError as exc:  # name the model, not the temporary file
            raise ModelError(
                str(exc).replace(str(path), "the model with the observed tensors as outputs")
            ) from None
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
