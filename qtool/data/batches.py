"""Data sources: turn a recipe's `data:` block into a stream of fixed-size, validated batches.

Every source is re-batched to the recipe's batch size so that statistics depend only on the
samples, never on how the source happened to chunk them; only one batch (plus the remainder of the
source's current chunk) is held in memory at a time, so memory stays flat in the number of samples.
Every batch is checked against the declared inputs (names, dtypes, sample shape, NaN/Inf) here,
once, so later stages can trust it and errors name the input and the sample.
"""

from __future__ import annotations

import math
import os
import struct
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from qtool.data.spec import DataSpec, ImageFolder, InputSpec
from qtool.data.text import text_chunks
from qtool.errors import DataError, QtoolError
from qtool.model.load import load_entry_point
from qtool.zip_members import READ_ERRORS, NpyMember

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".webp")


@dataclass
class Batch:
    """One batch: arrays keyed by model input name, and labels when the source has them."""

    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None

    def __len__(self) -> int:
        return len(next(iter(self.inputs.values())))


def iter_batches(
    spec: DataSpec,
    inputs: tuple[InputSpec, ...],
    batch_size: int,
    max_samples: int | None = None,
    seed: int = 0,
    shapes_from: str | None = None,
) -> Iterator[Batch]:
    """Yield validated batches of exactly `batch_size` samples (the last one may be smaller).

    `shapes_from` names who declared `inputs`, for error messages: None for the recipe's
    `inputs:`, else the model file they were read from (whose symbolic dims take any size).
    """
    chunks = _source_chunks(spec, inputs, seed, shapes_from)
    pending: list[Batch] = []
    pending_count = 0
    produced = 0
    sample_index = 0
    labelled: bool | None = None
    for chunk in chunks:
        _validate(chunk, inputs, spec.where, sample_index, shapes_from)
        if labelled is None:
            labelled = chunk.labels is not None
        elif labelled != (chunk.labels is not None):
            raise DataError(
                f"{spec.where}: some batches have labels and others do not (sample {sample_index})"
            )
        sample_index += len(chunk)
        if max_samples is not None:
            room = max_samples - produced - pending_count
            if room <= 0:
                break
            if len(chunk) > room:
                chunk = _slice(chunk, 0, room)
        pending.append(chunk)
        pending_count += len(chunk)
        while pending_count >= batch_size:
            merged = _concat(pending)
            yield _slice(merged, 0, batch_size)
            produced += batch_size
            rest = _slice(merged, batch_size, len(merged))
            pending = [rest] if len(rest) else []
            pending_count = len(rest)
    if pending_count:
        yield _concat(pending)
        produced += pending_count
    if produced == 0:
        raise DataError(f"{spec.where}: the data source yielded no samples")


def count_samples_hint(spec: DataSpec, max_samples: int | None) -> int | None:
    """Number of samples when cheaply known (for progress bars); None when the source streams."""
    total: int | None = None
    if spec.npz is not None:
        try:
            with zipfile.ZipFile(spec.npz) as archive:
                first = next((n for n in archive.namelist() if n != "labels.npy"), None)
                total = None if first is None else _NpyStream(archive, first, spec.npz).rows
        except READ_ERRORS:
            total = None  # iter_batches reports the unreadable file with its reason
    elif spec.npy is not None:
        first_path = next(iter(spec.npy.values()))
        total = int(_open_npy_file(first_path).shape[0])
    elif spec.synthetic:
        total = spec.samples
    if total is not None and max_samples is not None:
        total = min(total, max_samples)
    return total if total is not None else max_samples


def _format_dims(shape: tuple[int | str | None, ...]) -> str:
    """A declared shape as the user reads it: symbolic dims by name ('N'), unnamed ones as '?'."""
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _slice(batch: Batch, start: int, stop: int) -> Batch:
    labels = None if batch.labels is None else batch.labels[start:stop]
    return Batch({k: v[start:stop] for k, v in batch.inputs.items()}, labels)


def _concat(batches: list[Batch]) -> Batch:
    if len(batches) == 1:
        return batches[0]
    names = batches[0].inputs.keys()
    inputs = {n: np.concatenate([b.inputs[n] for b in batches]) for n in names}
    labels = None
    if batches[0].labels is not None:
        labels = np.concatenate([b.labels for b in batches])
    return Batch(inputs, labels)


def _validate(
    batch: Batch,
    inputs: tuple[InputSpec, ...],
    where: str,
    first: int,
    shapes_from: str | None = None,
) -> None:
    expected = {i.name for i in inputs}
    got = set(batch.inputs)
    if got != expected:
        missing = sorted(expected - got)
        extra = sorted(got - expected)
        detail = "; ".join(
            part
            for part in (
                f"missing {', '.join(missing)}" if missing else "",
                f"unexpected {', '.join(extra)}" if extra else "",
            )
            if part
        )
        raise DataError(f"{where}: batch inputs do not match the model inputs ({detail})")
    lengths = {len(a) for a in batch.inputs.values()}
    if batch.labels is not None:
        lengths.add(len(batch.labels))
    if len(lengths) != 1:
        raise DataError(
            f"{where}: arrays in one batch have different sample counts {sorted(lengths)}"
        )
    for spec in inputs:
        array = batch.inputs[spec.name]
        _check_shape(array.shape, spec, where, shapes_from)
        if np.dtype(array.dtype) != np.dtype(spec.dtype):
            if spec.dtype.startswith("float") and np.issubdtype(array.dtype, np.floating):
                batch.inputs[spec.name] = array.astype(spec.dtype)
            elif spec.dtype.startswith("int") and np.issubdtype(array.dtype, np.integer):
                batch.inputs[spec.name] = array.astype(spec.dtype)
            else:
                raise DataError(
                    f"{where}: input '{spec.name}' has dtype {array.dtype}, expected {spec.dtype}"
                )
        if np.issubdtype(batch.inputs[spec.name].dtype, np.floating):
            finite = np.isfinite(batch.inputs[spec.name])
            if not finite.all():
                bad = int(np.argwhere(~finite)[0][0]) + first
                raise DataError(f"{where}: input '{spec.name}' has NaN or Inf in sample {bad}")


def _check_shape(
    shape: tuple[int, ...], spec: InputSpec, where: str, shapes_from: str | None
) -> None:
    """Refuse an array of `shape` for the input `spec` declares (see iter_batches' shapes_from)."""
    if _fits(shape, spec.shape):
        return
    if shapes_from is None:
        raise DataError(
            f"{where}: input '{spec.name}' has sample shape {list(shape[1:])} but the recipe "
            f"declares inputs.{spec.name}: {list(spec.shape)} (sample shape {list(spec.shape[1:])})"
        )
    raise DataError(
        f"{where}: input '{spec.name}' has shape {list(shape)} but {shapes_from} declares "
        f"{_format_dims(spec.shape)}"
    )


def _fits(shape: tuple[int, ...], declared: tuple[int | str | None, ...]) -> bool:
    """Same rank, and every fixed dim after the batch axis equal; symbolic dims take any size."""
    if len(shape) != len(declared):
        return False
    return all(
        not isinstance(d, int) or d == n for d, n in zip(declared[1:], shape[1:], strict=True)
    )


def _source_chunks(
    spec: DataSpec, inputs: tuple[InputSpec, ...], seed: int, shapes_from: str | None = None
) -> Iterable[Batch]:
    if spec.npz is not None:
        return _npz_chunks(spec.npz, inputs, spec.where, shapes_from)
    if spec.npy is not None:
        return _npy_chunks(spec, spec.where)
    if spec.images is not None:
        return _image_chunks(spec.images, spec.where)
    if spec.python is not None:
        return _python_chunks(spec.python, spec.where)
    if spec.text is not None:
        return (
            Batch(arrays, labels) for arrays, labels in text_chunks(spec.text, inputs, spec.where)
        )
    if spec.synthetic:
        return _synthetic_chunks(inputs, spec.samples, seed)
    raise DataError(f"{spec.where}: no data source given")


def _npz_chunks(
    path: Path, inputs: tuple[InputSpec, ...], where: str, shapes_from: str | None = None
) -> Iterator[Batch]:
    """Stream an .npz member by member, `_CHUNK` samples at a time, never loading whole arrays.

    np.load reads an .npz member completely, so a large calibration file would make memory grow
    with the sample count; reading the .npy header and then row blocks from the zip stream keeps
    it flat (compressed or not). The headers are checked against the members' sizes and the
    declared input shapes before the first row is read, so a header that claims a sample of
    10**12 values is refused instead of allocated, and a member inflates only as far as the rows
    the recipe asks for (a zip bomb in a data file costs what max_samples reads of it).
    """
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None
    try:
        yield from _npz_member_chunks(archive, path, inputs, where, shapes_from)
    except READ_ERRORS as exc:  # a damaged member: CRC, deflate stream, short file
        raise DataError(f"{path}: damaged .npz file ({str(exc)[:200]})") from None


def _npz_member_chunks(
    archive: zipfile.ZipFile,
    path: Path,
    inputs: tuple[InputSpec, ...],
    where: str,
    shapes_from: str | None,
) -> Iterator[Batch]:
    with archive, open(path, "rb") as raw:
        members = {name.removesuffix(".npy"): name for name in archive.namelist()}
        names = [i.name for i in inputs]
        for name in names:
            if name not in members:
                known = ", ".join(sorted(members))
                raise DataError(f"{path}: has no array '{name}' (arrays: {known})")
        wanted = names + (["labels"] if "labels" in members else [])
        streams = {n: _NpyStream(archive, members[n], path, raw) for n in wanted}
        total = min(stream.rows for stream in streams.values())
        if len({stream.rows for stream in streams.values()}) != 1:
            counts = {n: stream.rows for n, stream in streams.items()}
            raise DataError(f"{path}: arrays have different sample counts {counts}")
        for spec in inputs:  # from the headers, before a row is read or allocated
            _check_shape(streams[spec.name].shape, spec, where, shapes_from)
        for start in range(0, total, _CHUNK):
            count = min(_CHUNK, total - start)
            arrays = {n: streams[n].read(count) for n in wanted}
            labels = arrays.pop("labels", None)
            yield Batch(arrays, labels)


_CHUNK = 64


class _NpyStream:
    """Row-block reader over one .npy member of a zip archive.

    `raw`: the archive file opened once more. An uncompressed member (np.savez's default) is
    then read with readinto straight into the batch's own array, where the zip stream would make
    a bytes object, check its CRC and leave a read-only buffer to copy: three passes over every
    sample instead of one (on 154 MB of ResNet inputs, 0.4 CPU s of calibration)."""

    def __init__(self, archive, member: str, path: Path, raw: BinaryIO | None = None) -> None:
        self.path = path
        # Sizes and header checked before any data is read; no inflation limit, since padded
        # token ids and masks deflate 50-500x, but deflate's own 1032:1 bound and the member's
        # declared size still hold (zipfile stops reading there).
        npy = NpyMember(
            path, archive, member, max_inflation=None, allow_trailing=True, error=DataError
        )
        self.handle = npy.handle
        shape, fortran, dtype = npy.shape, npy.fortran, npy.dtype
        if fortran or not shape:
            npy.close()
            raise DataError(f"{path}: member {member} must be a C-ordered numeric array")
        self.shape, self.dtype = shape, dtype
        self.rows = shape[0]
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize
        self.raw, self.offset = None, 0
        info = npy.info
        if raw is not None and info.compress_type == zipfile.ZIP_STORED:
            self.raw, self.offset = raw, _stored_data_offset(raw, info, path) + npy.header_bytes

    def read(self, count: int) -> np.ndarray:
        if self.row_bytes == 0:  # an empty axis (a KV cache's past of length 0): no bytes
            return np.empty((count, *self.shape[1:]), dtype=self.dtype)
        if self.raw is None:
            data = self.handle.read(count * self.row_bytes)
            if len(data) != count * self.row_bytes:
                raise DataError(f"{self.path}: ends inside an array (truncated file)")
            return np.frombuffer(data, dtype=self.dtype).reshape(count, *self.shape[1:]).copy()
        array = np.empty((count, *self.shape[1:]), dtype=self.dtype)
        view = memoryview(array).cast("B")
        self.raw.seek(self.offset)  # the streams of one archive share the handle
        if self.raw.readinto(view) != len(view):
            raise DataError(f"{self.path}: ends inside an array (truncated file)")
        self.offset += len(view)
        return array


def _stored_data_offset(raw: BinaryIO, info: zipfile.ZipInfo, path: Path) -> int:
    """Where an uncompressed member's bytes start: after its local header (30 bytes, then the
    name and the extra field, whose lengths the header gives; the central directory's copy of
    the extra field may differ)."""
    raw.seek(info.header_offset)
    header = raw.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise DataError(f"{path}: member {info.filename} has a damaged zip header")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length


def _open_npy_file(path: Path) -> np.ndarray:
    """An .npy file memory-mapped, after its header is checked against the file's size: numpy
    would read (np.load) or map a header's claim of 10**12 elements before noticing the file is
    4 KiB, and fail with an allocation or mmap error that names neither."""
    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(handle)
            header = handle.tell()
            size = os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, SyntaxError, RecursionError) as exc:
        problem = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: not a readable .npy file ({problem})") from None
    if dtype.hasobject or any(dim < 0 for dim in shape):
        raise DataError(f"{path}: must be a numeric array, got {dtype} {list(shape)}")
    needed = math.prod(shape) * dtype.itemsize
    if header + needed > size:
        raise DataError(
            f"{path}: ends inside an array (its header says {dtype} {list(shape)}, "
            f"{needed} bytes, but the file holds {size - header})"
        )
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # numpy's own reasons (an empty array cannot be mapped)
        raise DataError(f"{path}: not a readable .npy file ({exc})") from None


def _npy_chunks(spec: DataSpec, where: str) -> Iterator[Batch]:
    arrays = {name: _open_npy_file(path) for name, path in (spec.npy or {}).items()}
    labels = _open_npy_file(spec.labels) if spec.labels is not None else None
    total = min(len(a) for a in arrays.values())
    step = 256
    for start in range(0, total, step):
        chunk = {n: np.asarray(a[start : start + step]) for n, a in arrays.items()}
        rows = None if labels is None else np.array(labels[start : start + step])
        yield Batch(chunk, rows)


def _image_chunks(folder: ImageFolder, where: str) -> Iterator[Batch]:
    try:
        from PIL import Image
    except ImportError:
        raise DataError(
            f"{where}.images: reading image folders needs Pillow: pip install 'qtool[images]'"
        ) from None
    files = sorted(p for p in folder.dir.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise DataError(f"{folder.dir}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    classes = sorted({p.parent.name for p in files if p.parent != folder.dir})
    class_index = {name: i for i, name in enumerate(classes)}
    mean = np.asarray(folder.mean, dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(folder.std, dtype=np.float32).reshape(-1, 1, 1)
    for path in files:
        try:
            with Image.open(path) as image:
                image = image.convert(folder.mode).resize(
                    (folder.size[1], folder.size[0]), Image.BILINEAR
                )
                pixels = np.asarray(image, dtype=np.float32)
        except Exception as exc:
            raise DataError(f"{path}: cannot read image ({exc})") from None
        pixels = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        sample = ((pixels / folder.scale) - mean) / std
        label = None
        if classes:
            label = np.asarray([class_index[path.parent.name]], dtype=np.int64)
        yield Batch({folder.input: sample[None].astype(np.float32)}, label)


def _python_chunks(entry: str, where: str) -> Iterator[Batch]:
    try:
        function = load_entry_point(entry, "data function")
    except QtoolError as exc:
        raise DataError(f"{where}.python: {exc}") from None
    try:
        items = iter(function())
    except Exception as exc:
        raise DataError(f"{entry}: raised {type(exc).__name__}: {exc}") from exc
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except Exception as exc:
            raise DataError(f"{entry}: raised {type(exc).__name__}: {exc}") from exc
        labels = None
        if isinstance(item, tuple) and len(item) == 2:
            item, labels = item
            labels = np.asarray(labels)
        if not isinstance(item, dict):
            raise DataError(
                f"{entry}: each item must be a dict of arrays or a (dict, labels) tuple, "
                f"got {type(item).__name__}"
            )
        yield Batch({str(k): np.asarray(v) for k, v in item.items()}, labels)


def _synthetic_chunks(inputs: tuple[InputSpec, ...], samples: int, seed: int) -> Iterator[Batch]:
    """Seeded random data, only ever used when the recipe says `synthetic: true`."""
    rng = np.random.default_rng(seed)
    step = 64
    for start in range(0, samples, step):
        count = min(step, samples - start)
        arrays = {}
        for spec in inputs:
            shape = (count, *spec.shape[1:])
            if spec.dtype.startswith("float"):
                arrays[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
            elif spec.dtype == "bool":
                arrays[spec.name] = rng.integers(0, 2, shape).astype(bool)
            else:
                arrays[spec.name] = rng.integers(0, 100, shape).astype(spec.dtype)
        yield Batch(arrays, None)
