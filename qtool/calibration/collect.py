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

Hessians for GPTQ ride on the same pass: a MatMul input [..., K] that is named in
`hessian_tensors` is fetched with the observed tensors (each fetched once when it is both) and
added to its running XᵀX, one K x K float64 matrix per tensor. The batch is cast to float64 for
that product and dropped before the next batch, so memory stays flat in the sample count.

SmoothQuant's per-channel min/max and row samples ride on it too (`channel_observers`,
qtool/calibration/channels.py): each observer's tensor is fetched with the others, once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import onnx
import onnxruntime
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from qtool.calibration.channels import ChannelObserver
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.observers import HistogramObserver, TensorStats
from qtool.data.batches import Batch
from qtool.errors import CalibrationError, ModelError
from qtool.model.inline_write import write_model
from qtool.ort.sessions import create_session, ort_reason
from qtool.phases import phase
from qtool.progress import bars


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


def save_with_extra_outputs(
    model: onnx.ModelProto, tensors: list[str], path: Path, serialized: Path | None = None
) -> None:
    """Write `model` plus the extra outputs to `path` without copying the ModelProto: the outputs
    are appended for the serialization and removed again, so `model` is unchanged afterwards.
    A model over protobuf's limit gets its weights in `path`.data (qtool.model.external_data).

    `serialized`: a file holding exactly `model`'s serialization (the staged float model). The
    file is then copied and a ModelProto holding only the extra outputs appended: protobuf parses
    concatenated messages as their merge, with repeated fields (graph.output) appended, so ORT
    reads the same model without the whole model being serialized again (on a 90 MB encoder
    0.2 CPU s and a model's worth of fresh memory)."""
    extra = _extra_outputs(model, tensors)
    if serialized is not None:
        tail = onnx.ModelProto()
        tail.graph.output.extend(extra)
        shutil.copyfile(serialized, path)
        with open(path, "ab") as handle:
            handle.write(tail.SerializeToString())
        return
    outputs = model.graph.output
    keep = len(outputs)
    outputs.extend(extra)
    try:
        write_model(model, path)
    finally:
        del outputs[keep:]


def session_with_outputs(
    model: onnx.ModelProto, tensors: list[str], *, optimize: bool = True
) -> onnxruntime.InferenceSession:
    """An ORT session of `model` with `tensors` as extra outputs, for the passes after
    calibration (bias correction, AdaRound, CLE's channel maxima). The file is written to a
    temporary folder and removed once ORT has read it; `model` is unchanged."""
    with tempfile.TemporaryDirectory(prefix="qtool-outputs-") as tmp:
        path = Path(tmp) / "model.onnx"
        save_with_extra_outputs(model, tensors, path)
        return create_session(path, optimize=optimize, spinning=False)


# ORT returns these as numpy float arrays; XᵀX is accumulated in float64 whatever they are.
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}


def _hessian_accumulators(
    model: onnx.ModelProto, tensors: list[str]
) -> dict[str, HessianAccumulator | None]:
    """One accumulator per tensor, sized by its inferred last dimension (None when that is not
    a number: sized by the first batch instead; HessianAccumulator checks every later batch)."""
    graph = model.graph
    typed = {vi.name: vi for vi in list(graph.value_info) + list(graph.input) + list(graph.output)}
    accumulators: dict[str, HessianAccumulator | None] = {}
    for name in tensors:
        if name not in typed:
            raise CalibrationError(f"tensor '{name}' has no inferred type; cannot collect XᵀX")
        tensor_type = typed[name].type.tensor_type
        if tensor_type.elem_type not in _FLOAT_TYPES:
            dtype = onnx.TensorProto.DataType.Name(tensor_type.elem_type)
            raise CalibrationError(
                f"tensor '{name}' is {dtype}; XᵀX (GPTQ) needs a float MatMul input"
            )
        dims = tensor_type.shape.dim if tensor_type.HasField("shape") else None
        if dims is not None and len(dims) == 0:
            raise CalibrationError(f"tensor '{name}' is a scalar; XᵀX needs an input [..., K]")
        last = dims[-1] if dims else None
        known = last is not None and last.HasField("dim_value") and last.dim_value > 0
        accumulators[name] = HessianAccumulator(last.dim_value, name) if known else None
    return accumulators


def collect(
    model: onnx.ModelProto,
    tensors: list[str],
    batches: Iterable[Batch],
    *,
    bins: int,
    hessian_tensors: Sequence[str] = (),
    device: str = "cpu",
    total_samples: int | None = None,
    progress: bool = True,
    threads: int | None = None,
    model_dir: Path | None = None,
    channel_observers: Sequence[ChannelObserver] = (),
    serialized: Path | None = None,
) -> tuple[list[TensorStats], dict[str, HessianAccumulator]]:
    """Statistics for each of `tensors` (in the given order) and XᵀX of each of
    `hessian_tensors` (keyed by name, in the given order), from one ORT run per batch.

    `device` is where the histogram kernels run; XᵀX is always float64 numpy on the CPU, so the
    same batches give the same bytes whatever the device. `model_dir`: the folder that `model`'s
    external data references are relative to, for a model whose weights stay on disk (over 2 GB:
    see qtool.model.external_data); the model with the extra outputs is written there, since ONNX
    Runtime reads external data only from the model file's own folder. `model` is dropped
    once it is written (a caller that passes its only reference frees it before the session is
    created; pipeline.PreparedModel.release). Each of
    `channel_observers` (per-channel statistics for SmoothQuant) is updated in place with its
    tensor from the same runs. `serialized`: a file holding `model`'s exact serialization, which
    the model with the extra outputs is built from (save_with_extra_outputs).
    """
    hessian_names = list(dict.fromkeys(hessian_tensors))
    channel_names = [observer.name for observer in channel_observers]
    # a tensor wanted more than once is fetched once
    fetch = list(dict.fromkeys([*tensors, *hessian_names, *channel_names]))
    where = {name: i for i, name in enumerate(fetch)}
    accumulators = _hessian_accumulators(model, hessian_names)
    with (
        phase("calibrating: loading the model into ONNX Runtime"),
        tempfile.TemporaryDirectory(prefix="qtool-calib-") as tmp,
    ):
        path = Path(tmp) / "calibration.onnx"
        if model_dir is not None:  # a qtool temporary name: a killed run's copy is cleaned up
            handle, name = tempfile.mkstemp(
                prefix=f".calibration.onnx.qtool{os.getpid()}.", suffix=".tmp", dir=model_dir
            )
            os.close(handle)
            path = Path(name)
        try:
            save_with_extra_outputs(model, fetch, path, serialized)
            del model  # the caller's only reference, when it passed that: the session has its own
            # ORT has read the file; it can go. Observers run between batches: no spinning.
            session = create_session(path, threads=threads, spinning=False)
        except ModelError as exc:  # name the model, not the temporary file
            raise ModelError(
                str(exc).replace(str(path), "the model with the observed tensors as outputs")
            ) from None
        finally:
            if model_dir is not None:
                path.unlink(missing_ok=True)
    observers = [HistogramObserver(name, bins * 2, device=device) for name in tensors]
    columns = (
        TextColumn("calibrating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("samples"),
        TimeRemainingColumn(),
    )
    with bars(progress, *columns, line="calibrating: {count} samples") as bar:
        task = bar.add_task("calibrate", total=total_samples)
        for batch in batches:
            try:
                values = session.run(fetch, batch.inputs)
            except Exception as exc:  # ORT raises its own exception types for bad feeds
                raise CalibrationError(
                    f"ONNX Runtime failed on a calibration batch: {ort_reason(exc)}"
                ) from None
            for observer in observers:
                observer.update(values[where[observer.name]])
            for name in hessian_names:
                array = values[where[name]]
                accumulator = accumulators[name]
                if accumulator is None:
                    if array.ndim == 0 or array.shape[-1] < 1:
                        raise CalibrationError(
                            f"tensor '{name}' has shape {array.shape}; XᵀX needs an input [..., K]"
                        )
                    accumulator = accumulators[name] = HessianAccumulator(array.shape[-1], name)
                accumulator.update(array)
            for channel_observer in channel_observers:
                channel_observer.update(values[where[channel_observer.name]])
            del values  # free this batch's outputs before ORT allocates the next batch's
            bar.advance(task, len(batch))
    stats = [observer.result() for observer in observers]
    hessians = {}
    for name, accumulator in accumulators.items():
        if accumulator is None or accumulator.rows == 0:
            raise CalibrationError(f"tensor '{name}' received no calibration data")
        hessians[name] = accumulator
    return stats, hessians


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
    """Statistics for each of `tensors`, in the given order (`collect` without Hessians)."""
    stats, _ = collect(
        model,
        tensors,
        batches,
        bins=bins,
        device=device,
        total_samples=total_samples,
        progress=progress,
        threads=threads,
    )
    return stats
