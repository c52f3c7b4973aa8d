"""How far ORT's fused run of a quantized model is from its unfused QDQ semantics.

ORT_DISABLE_ALL runs the QDQ graph literally (DequantizeLinear -> float op -> QuantizeLinear),
which is what calibration and sensitivity analysis assume; ORT_ENABLE_ALL runs the integer
kernels. Where they differ, the integer kernels round (requantization) or saturate (uint8 x int8
on x86 without VNNI) differently.

The two sessions never run side by side: the unfused one runs first over every batch, its
outputs are written to a scratch folder (`UnfusedReference`), and it is freed before the fused
session is created; the comparison then reads the reference back a slice at a time. On an LLM,
both sessions at once with both runs' logits were most of `qtool quantize`'s peak memory
(SmolLM2-135M int8: 1.1 GB of verification on top of a 0.1 GB process for a 138 MB file; the
unfused session 0.16 GB, the fused one 0.36 GB, each run's logits 0.1 GB).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qtool.errors import DataError, ModelError, OutputError
from qtool.metrics.signal import CHUNK_ELEMENTS, SignalQuality
from qtool.ort.sessions import as_declared, create_session, feed_rows, ort_reason, runs_by_rows

if TYPE_CHECKING:
    import onnxruntime


@dataclass(frozen=True)
class ReferenceRun:
    """One unfused run: which batch, which of its rows, and a .npy file per model output."""

    batch: int
    rows: slice
    files: tuple[Path, ...]


class UnfusedReference:
    """The unfused session's outputs on the verification batches, on disk until `close`."""

    def __init__(
        self, names: list[str], runs: list[ReferenceRun], folder: tempfile.TemporaryDirectory
    ):
        self.names = names
        self.runs = runs
        self._folder = folder

    def close(self) -> None:
        self._folder.cleanup()

    def __enter__(self) -> UnfusedReference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bad_batch(index: int, exc: Exception) -> DataError:
    """The error for a verification batch ORT cannot run, naming the batch and ORT's reason."""
    return DataError(f"batch {index} cannot run the quantized model: {ort_reason(exc)}")


def run_unfused(
    quantized: bytes | Path, feeds: Sequence[dict[str, np.ndarray]], threads: int = 1
) -> UnfusedReference:
    """Run `quantized` unfused (ORT_DISABLE_ALL, no memory arena) on every batch of `feeds` and
    keep its outputs in a scratch folder (the system's temporary directory); the session is
    gone when this returns. A model ORT cannot load raises ModelError, a batch it cannot run
    DataError naming the batch."""
    session = create_session(quantized, threads=threads, optimize=False, arena=False)
    names = [o.name for o in session.get_outputs()]
    folder = tempfile.TemporaryDirectory(prefix="qtool-unfused-")
    runs: list[ReferenceRun] = []
    try:
        for index, feed in enumerate(feeds):
            try:
                batch_runs = list(_rows_and_outputs(session, names, feed, index, folder, len(runs)))
            except OSError as exc:  # the scratch folder: full or not writable
                raise OutputError(
                    f"cannot keep the unfused run's outputs in {folder.name}: {exc} (TMPDIR "
                    "names the folder qtool uses; verification needs room for the outputs of "
                    f"{len(feeds)} batches)"
                ) from exc
            runs.extend(batch_runs)
        if not runs:
            raise DataError("comparing fused and unfused runs needs at least one batch of inputs")
    except BaseException:
        folder.cleanup()
        raise
    return UnfusedReference(names, runs, folder)


def _rows_and_outputs(
    session: onnxruntime.InferenceSession,
    names: list[str],
    feed: dict[str, np.ndarray],
    batch: int,
    folder: tempfile.TemporaryDirectory,
    first: int,
) -> Iterator[ReferenceRun]:
    """The runs of one batch, each run's outputs saved as it comes (one run's alive at a time);
    a batch ORT cannot run raises DataError naming it. A large batch (an LLM's logits) runs a few
    rows at a time (runs_by_rows)."""
    runs = None
    number = first
    while True:
        try:
            if runs is None:  # as_declared: an FP16-input model (float_io: float_type)
                runs = runs_by_rows(session, names, as_declared(feed, session))
            step = next(runs, None)
        except Exception as exc:  # ORT raises private types for bad feeds
            raise bad_batch(batch, exc) from exc
        if step is None:
            return
        rows, outputs = step
        files = tuple(Path(folder.name) / f"{number}-{k}.npy" for k in range(len(names)))
        for path, output in zip(files, outputs, strict=True):
            np.save(path, np.ascontiguousarray(output), allow_pickle=False)
        del outputs, step
        yield ReferenceRun(batch, rows, files)
        number += 1


def compare_fused_unfused(
    quantized: bytes | Path,
    feeds: Sequence[dict[str, np.ndarray]],
    threads: int = 1,
    fused: onnxruntime.InferenceSession | None = None,
    reference: UnfusedReference | None = None,
) -> dict[str, float]:
    """Per model output: SQNR (dB) of the ORT_ENABLE_ALL session against ORT_DISABLE_ALL; inf
    means bit-identical outputs over all batches. The SQNR is qtool.metrics.signal's, the one
    evaluate and analyze print.

    `reference`: run_unfused's outputs on `feeds` when the caller made them (before creating
    `fused`, so that the sessions were not alive together); closed here. `fused`: the caller's
    ORT_ENABLE_ALL session of `quantized`, else one is created after the unfused run."""
    feeds = list(feeds)
    if reference is None:
        reference = run_unfused(quantized, feeds, threads)
    with reference:
        if fused is None:
            fused = create_session(quantized, threads=threads, optimize=True)
        quality = {name: SignalQuality() for name in reference.names}
        for run in reference.runs:
            try:
                feed = as_declared(feeds[run.batch], fused)
                candidate = fused.run(reference.names, feed_rows(feed, run.rows))
            except Exception as exc:  # ORT raises private types for bad feeds
                raise bad_batch(run.batch, exc) from exc
            for name, path, output in zip(reference.names, run.files, candidate, strict=True):
                for ref, out in _slices(path, np.asarray(output), name):
                    quality[name].update(ref, out)
            # Not alive through the next run: an LLM's logits are 0.5 GB (Gemma 3, 512 tokens).
            del candidate, output
    return {name: quality[name].sqnr_db() for name in reference.names}


def _slices(path: Path, output: np.ndarray, name: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(reference, fused) pairs of flat slices of one output, CHUNK_ELEMENTS at a time: the
    reference is read from its file a slice at a time (a memory map would keep every page it
    touched resident until the end of the output). Only sums of squares are read from them, so
    flattening changes no figure but the float64 summation order."""
    with open(path, "rb") as handle:
        version = np.lib.format.read_magic(handle)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(handle)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(handle)
        if tuple(shape) != output.shape:
            raise ModelError(
                f"output {name!r} has shape {output.shape} in ORT's fused run and "
                f"{tuple(shape)} unfused"
            )
        flat = output.reshape(-1)
        for start in range(0, flat.size, CHUNK_ELEMENTS):
            count = min(CHUNK_ELEMENTS, flat.size - start)
            yield np.fromfile(handle, dtype=dtype, count=count), flat[start : start + count]
