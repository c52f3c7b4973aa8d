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

A staged model with more than PART_BYTES of weights runs as consecutive parts instead, one
session at a time over every batch (qtool/calibration/parts.py, `_collect_by_parts`): one session
of the whole model held every weight and, by its last batch, every Hessian.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from qtool.calibration.channels import ChannelObserver
from qtool.calibration.hessians import HessianAccumulator, HessianSpill
from qtool.calibration.observers import HistogramObserver, TensorStats
from qtool.calibration.parts import Part, split_model
from qtool.data.batches import Batch
from qtool.errors import CalibrationError, ModelError, OutputError
from qtool.model.inline_write import write_model
from qtool.model.memory import release_freed_memory
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


class _Observed:
    """Everything one calibration pass updates from the tensors it fetches: the range
    observers, the Hessian accumulators, SmoothQuant's per-channel observers."""

    def __init__(
        self,
        model: onnx.ModelProto,
        tensors: list[str],
        hessian_names: list[str],
        channel_observers: Sequence[ChannelObserver],
        bins: int,
        device: str,
    ) -> None:
        self.ranges = {name: HistogramObserver(name, bins * 2, device=device) for name in tensors}
        self.hessians = _hessian_accumulators(model, hessian_names)
        self.channels: dict[str, list[ChannelObserver]] = {}
        for observer in channel_observers:
            self.channels.setdefault(observer.name, []).append(observer)

    def names(self) -> list[str]:
        """Every tensor observed, once."""
        return list(dict.fromkeys([*self.ranges, *self.hessians, *self.channels]))

    def update(self, values: Mapping[str, np.ndarray]) -> None:
        """Feed each observer its tensor of one batch (those of `values` it observes)."""
        for name, array in values.items():
            if name in self.ranges:
                self.ranges[name].update(array)
            if name in self.hessians:
                accumulator = self.hessians[name]
                if accumulator is None:
                    if array.ndim == 0 or array.shape[-1] < 1:
                        raise CalibrationError(
                            f"tensor '{name}' has shape {array.shape}; XᵀX needs an input [..., K]"
                        )
                    accumulator = self.hessians[name] = HessianAccumulator(array.shape[-1], name)
                accumulator.update(array)
            for observer in self.channels.get(name, ()):
                observer.update(array)

    def results(
        self, tensors: list[str]
    ) -> tuple[list[TensorStats], dict[str, HessianAccumulator]]:
        stats = [self.ranges[name].result() for name in tensors]
        hessians = {}
        for name, accumulator in self.hessians.items():
            if accumulator is None or accumulator.rows == 0:
                raise CalibrationError(f"tensor '{name}' received no calibration data")
            hessians[name] = accumulator
        return stats, hessians


def _session(
    holder: list[onnx.ModelProto],
    fetch: list[str],
    model_dir: Path | None,
    serialized: Path | None,
    threads: int | None,
    what: str = "the model with the observed tensors as outputs",
) -> onnxruntime.InferenceSession:
    """An ORT session of the model in `holder` with `fetch` as outputs, written to a temporary
    file (in `model_dir` when its weights are external data there) and removed once ORT has
    read it. The model is taken out of `holder`, so a caller that held it only there holds no
    reference while ORT loads it."""
    model = holder.pop()
    with tempfile.TemporaryDirectory(prefix="qtool-calib-") as tmp:
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
            return create_session(path, threads=threads, spinning=False)
        except ModelError as exc:  # name the model, not the temporary file
            raise ModelError(str(exc).replace(str(path), what)) from None
        finally:
            if model_dir is not None:
                path.unlink(missing_ok=True)


def _run(session: onnxruntime.InferenceSession, fetch: list[str], feed: dict) -> list:
    try:
        return session.run(fetch, feed)
    except Exception as exc:  # ORT raises its own exception types for bad feeds
        raise CalibrationError(
            f"ONNX Runtime failed on a calibration batch: {ort_reason(exc)}"
        ) from None


def _columns(label: str) -> tuple:
    return (
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("samples"),
        TimeRemainingColumn(),
    )


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
    external data references are relative to, for a model whose weights stay on disk (a staged
    float model: see qtool.model.external_data); the model with the extra outputs is written
    there, since ONNX Runtime reads external data only from the model file's own folder. Such a
    model with more than PART_BYTES of weights is calibrated part by part
    (qtool/calibration/parts.py). `model` is dropped once it is written (a caller that passes its
    only reference frees it before the session is created; pipeline.PreparedModel.release). Each
    of `channel_observers` (per-channel statistics for SmoothQuant) is updated in place with its
    tensor from the same runs. `serialized`: a file holding `model`'s exact serialization, which
    the model with the extra outputs is built from (save_with_extra_outputs).
    """
    hessian_names = list(dict.fromkeys(hessian_tensors))
    channel_names = [observer.name for observer in channel_observers]
    # a tensor wanted more than once is fetched once
    fetch = list(dict.fromkeys([*tensors, *hessian_names, *channel_names]))
    observed = _Observed(model, tensors, hessian_names, channel_observers, bins, device)
    parts = None if model_dir is None else split_model(model, fetch, PART_BYTES)
    if parts is not None:
        del model
        _collect_by_parts(parts, batches, observed, model_dir, threads, progress, total_samples)
        return observed.results(tensors)
    holder = [model]
    del model  # the session has its own: `_session` drops the last reference before ORT loads
    with phase("calibrating: loading the model into ONNX Runtime"):
        session = _session(holder, fetch, model_dir, serialized, threads)
    with bars(progress, *_columns("calibrating"), line="calibrating: {count} samples") as bar:
        task = bar.add_task("calibrate", total=total_samples)
        for batch in batches:
            values = _run(session, fetch, batch.inputs)
            observed.update(dict(zip(fetch, values, strict=True)))
            del values  # free this batch's outputs before ORT allocates the next batch's
            bar.advance(task, len(batch))
    return observed.results(tensors)


# Weights per part when a staged model is calibrated part by part: the session's share of the
# calibration peak (SmolLM2-135M, 542 MB in one session: 1.56 GB, the whole model and every
# Hessian held; in parts of this size, see benchmarks/README.md).
PART_BYTES = 64 << 20


def _collect_by_parts(
    parts: list[Part],
    batches: Iterable[Batch],
    observed: _Observed,
    model_dir: Path,
    threads: int | None,
    progress: bool,
    total_samples: int | None,
) -> None:
    """Run `parts` one after the other over every batch. The batches are read once, by the
    first part; each batch's tensors a later part reads (graph inputs included) wait in a
    scratch folder, and each part's Hessians are handed to a scratch file once its pass is done,
    so memory holds one part's weights and statistics at a time."""
    graph_inputs_later = {name for part in parts[1:] for name in part.feeds}
    passed = {name for part in parts for name in part.passes_on}
    graph_feeds = sorted({name for part in parts for name in part.feeds} - passed)
    from_parts = {name for part in parts for name in part.observed}
    from_batches = [name for name in observed.names() if name not in from_parts]
    line = "calibrating {description}: {count} samples"
    with (
        tempfile.TemporaryDirectory(prefix="qtool-parts-") as scratch,
        bars(progress, *_columns("calibrating {task.description}"), line=line) as bar,
    ):
        waiting = _Waiting(Path(scratch))
        spill = HessianSpill()
        sizes: list[int] = []
        for number, part in enumerate(parts):
            fetch = list(dict.fromkeys([*part.observed, *part.passes_on]))
            what = f"part {number + 1} of {len(parts)} of the model"
            with phase(f"calibrating: loading {what} into ONNX Runtime"):
                session = _session([part.model], fetch, model_dir, None, threads, what)
            task = bar.add_task(f"part {number + 1}/{len(parts)}", total=total_samples)
            if number == 0:
                for index, batch in enumerate(batches):
                    missing = [name for name in graph_feeds if name not in batch.inputs]
                    if missing:  # what ORT says of one session's missing feed, said up front
                        raise CalibrationError(
                            f"calibration batch {index} has no input {missing[0]!r}"
                        )
                    observed.update({name: batch.inputs[name] for name in from_batches})
                    feed = {name: batch.inputs[name] for name in part.feeds}
                    for name in graph_inputs_later & set(batch.inputs):
                        waiting.put(index, name, batch.inputs[name])
                    _run_part(session, fetch, feed, part, observed, waiting, index)
                    sizes.append(len(batch))
                    bar.advance(task, len(batch))
            else:
                for index, size in enumerate(sizes):
                    feed = {name: waiting.get(index, name) for name in part.feeds}
                    _run_part(session, fetch, feed, part, observed, waiting, index)
                    bar.advance(task, size)
            del session
            waiting.keep_only({n for following in parts[number + 1 :] for n in following.feeds})
            finished = [*part.observed, *(from_batches if number == 0 else ())]
            for name in finished:  # read back from disk when the build needs it
                accumulator = observed.hessians.get(name)
                if accumulator is not None:
                    spill.store(accumulator)
            # the part's weights and Hessians went in pieces glibc keeps for reuse otherwise: the
            # next part's would come on top (SmolLM2-135M: +50 MB per part)
            release_freed_memory()


def _run_part(
    session: onnxruntime.InferenceSession,
    fetch: list[str],
    feed: dict,
    part: Part,
    observed: _Observed,
    waiting: _Waiting,
    index: int,
) -> None:
    values = dict(zip(fetch, _run(session, fetch, feed), strict=True))
    observed.update({name: values[name] for name in part.observed})
    for name in part.passes_on:
        waiting.put(index, name, values[name])


class _Waiting:
    """Tensors of each batch that a later part reads, one .npy file each until no part needs
    them (tensor names are arbitrary strings: files are numbered)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.numbers: dict[str, int] = {}
        self.files: dict[str, list[Path]] = {}

    def _path(self, index: int, name: str) -> Path:
        number = self.numbers.setdefault(name, len(self.numbers))
        return self.folder / f"{index}_{number}.npy"

    def put(self, index: int, name: str, array: np.ndarray) -> None:
        path = self._path(index, name)
        try:
            np.save(path, np.asarray(array), allow_pickle=False)
        except OSError as exc:
            raise OutputError(
                f"{self.folder}: cannot hold the tensors calibration passes between the parts "
                f"of the model ({exc.strerror}); free space in the temporary folder or point "
                "TMPDIR at a larger one"
            ) from None
        self.files.setdefault(name, []).append(path)

    def get(self, index: int, name: str) -> np.ndarray:
        return np.load(self._path(index, name), allow_pickle=False)

    def keep_only(self, needed: set[str]) -> None:
        """Remove the files of every tensor not in `needed` (no later part reads it)."""
        for name in [n for n in self.files if n not in needed]:
            for path in self.files.pop(name):
                path.unlink(missing_ok=True)


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
