"""Models too large for one protobuf: their weights travel as external data, never serialized.

Protobuf cannot serialize or parse a message of 2 GiB or more, and everything that hands a model
to C++ (SerializeToString, onnx.checker on a proto, shape inference, the version converter, an
ONNX Runtime session from bytes) goes through one serialization. A model whose tensor data
reaches EXTERNAL_DATA_THRESHOLD is therefore written as two files: a skeleton (the graph, every
initializer of MIN_EXTERNAL_BYTES or more replaced by a reference) and `<name>.data` beside it,
the tensors in graph order at ALIGNMENT-aligned offsets (ONNX Runtime memory-maps aligned external
data on the CPU instead of copying it). The skeleton is built field by field without copying a
tensor's data, and the data file is streamed one tensor at a time, so writing costs one tensor of
extra memory. ONNX Runtime sessions open these files by path, never bytes.

The SHA-256 of such a model is that of the skeleton file followed by its data file: what
`model_sha256` recomputes from the files, and, for a model without external data, simply the
file's own hash. So the stats fingerprint (the prepared model) and the provenance check (evaluate
hashes model.fp32.onnx) mean the same for both layouts, and neither serializes the model whole.

Models under the threshold keep the in-memory path (one SerializeToString): their outputs are
byte-identical to those of a qtool without this module.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import sys
import tempfile
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor

from qtool.errors import ModelError
from qtool.io import Staged, stage

__all__ = [
    "DATA_FIELDS",
    "EXTERNAL_DATA_THRESHOLD",
    "PROTOBUF_LIMIT",
    "StagedModel",
    "check_model",
    "check_skeleton",
    "convert_without_weights",
    "data_nbytes",
    "external_beyond_initializers",
    "external_files",
    "is_lazy",
    "lazy_file",
    "make_lazy",
    "tensor_array",
    "model_sha256",
    "needs_external_data",
    "read_lazy_weights",
    "stages_weights",
    "save_model",
    "stage_model",
    "all_weights_on_disk",
    "weightless_copy",
]

# protobuf refuses to serialize or parse a message of this size or more.
PROTOBUF_LIMIT = 2**31 - 1
# Tensor data at or above this goes to a data file: the limit less room for the graph itself
# (nodes, names, shapes: megabytes even for the largest exporter graphs). Tests lower it.
EXTERNAL_DATA_THRESHOLD = PROTOBUF_LIMIT - (128 << 20)
# A float model with this much tensor data or more is staged as external data too, though one
# protobuf could hold it: its weights then stay in the staged file (lazy) while `quantize`
# reads them one at a time, instead of a parsed proto plus its bytes in memory (Gemma 3 270M,
# 1.08 GB, weight-only int8: build peak 5.1 GB in memory, 3.0 GB staged). Tests lower it.
STAGE_WEIGHTS_THRESHOLD = 256 << 20
# Initializers of at least this many bytes go to the data file (onnx.save's default threshold);
# smaller ones (scales, zero points, shape vectors) stay inline where passes read them.
MIN_EXTERNAL_BYTES = 1024
# onnx.checker on a proto serializes it and parses the copy in C++: above this much tensor data
# the model is checked as a skeleton file instead (same verdict on the graph, no two copies).
CHECK_IN_MEMORY_BYTES = 64 << 20
# Offsets in the data file are multiples of this: the page size, ORT's condition for mmap on Linux.
ALIGNMENT = 4096
_CHUNK = 1 << 24  # streamed hashing of model files

_SUB_BYTE_BITS = {
    TensorProto.INT4: 4,
    TensorProto.UINT4: 4,
    TensorProto.FLOAT4E2M1: 4,
    getattr(TensorProto, "INT2", -1): 2,
    getattr(TensorProto, "UINT2", -1): 2,
    getattr(TensorProto, "FLOAT6E2M3", -1): 6,
    getattr(TensorProto, "FLOAT6E3M2", -1): 6,
}
# Bytes per element of the typed (non-raw) fields, varints at their widest.
_TYPED_FIELDS = (
    ("float_data", 4),
    ("int32_data", 5),
    ("int64_data", 10),
    ("double_data", 8),
    ("uint64_data", 10),
)


def data_location(path: Path) -> str:
    """The data file's name beside `path`: model.int8.onnx -> model.int8.onnx.data."""
    return f"{Path(path).name}.data"


def raw_nbytes(tensor: TensorProto) -> int:
    """Bytes of raw_data that `tensor`'s type and shape need (what ONNX stores, 4-bit packed).

    In Python integers: dims of a damaged or hostile file may multiply past int64, where numpy's
    product would wrap to a small or negative size."""
    count = math.prod(tensor.dims)
    bits = _SUB_BYTE_BITS.get(tensor.data_type)
    if bits is None:
        return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return (count * bits + 7) // 8


def tensor_nbytes(tensor: TensorProto) -> int:
    """What `tensor`'s data adds to a serialized proto, without reading the data (accessing
    raw_data copies it: 60 ms per 64 MB); 0 when it lives in an external file already, unless
    it is a lazy weight (`lazy_file`), which whoever writes the model copies into its file."""
    if tensor.data_location == TensorProto.EXTERNAL:
        return raw_nbytes(tensor) if lazy_file(tensor) is not None else 0
    if tensor.HasField("raw_data"):
        return raw_nbytes(tensor)
    if tensor.data_type == TensorProto.STRING:
        return sum(len(s) for s in tensor.string_data)
    return sum(len(getattr(tensor, name)) * size for name, size in _TYPED_FIELDS)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    """Every tensor a graph holds: initializers, sparse ones, attributes, subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _graph_tensors(attr.g)
            for body in attr.graphs:
                yield from _graph_tensors(body)


def data_nbytes(model: onnx.ModelProto) -> int:
    """Tensor data held inside `model` (main graph, subgraphs, local functions' constants)."""
    total = sum(tensor_nbytes(t) for t in _graph_tensors(model.graph))
    for function in model.functions:
        for node in function.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    total += tensor_nbytes(attr.t)
    return total


def needs_external_data(model: onnx.ModelProto) -> bool:
    """True when `model` must not be serialized into one protobuf (read at call time, so tests
    can lower EXTERNAL_DATA_THRESHOLD)."""
    return data_nbytes(model) >= EXTERNAL_DATA_THRESHOLD


def stages_weights(model: onnx.ModelProto) -> bool:
    """True when the float model `model` is staged as external data: over protobuf's limit, or
    large enough that holding it parsed and serialized costs more than reading its weights
    from the staged file (STAGE_WEIGHTS_THRESHOLD)."""
    return data_nbytes(model) >= min(STAGE_WEIGHTS_THRESHOLD, EXTERNAL_DATA_THRESHOLD)


def clear_default_locations(model: onnx.ModelProto) -> None:
    """Drop the `data_location: DEFAULT` onnx's external-data loader leaves on every tensor it
    read in: the field's default, but written out it makes the same model other bytes than
    one that was inline all along (staged or not, a model's bytes must not depend on it)."""
    for tensor in _graph_tensors(model.graph):
        if tensor.HasField("data_location") and tensor.data_location == TensorProto.DEFAULT:
            tensor.ClearField("data_location")


def read_lazy_weights(model: onnx.ModelProto) -> None:
    """Read every lazy weight of `model` into the proto, in place (a model that one protobuf
    holds, written as one file)."""
    for tensor in _graph_tensors(model.graph):
        if lazy_file(tensor) is not None:
            data = _read_lazy(tensor)
            del tensor.external_data[:]
            # cleared, not set to DEFAULT: the bytes of an inline tensor as any writer has them
            tensor.ClearField("data_location")
            tensor.raw_data = data


# Writing


def _is_repeated(fd) -> bool:
    repeated = getattr(fd, "is_repeated", None)
    return bool(repeated) if repeated is not None else fd.label == fd.LABEL_REPEATED


def copy_fields(src, dst, skip: frozenset[str]) -> None:
    """Copy every field of `src` into `dst` except `skip`, generically (fields added to onnx.proto
    later are copied too); never reads a skipped field, so no tensor data is touched."""
    for fd in src.DESCRIPTOR.fields:
        if fd.name in skip:
            continue
        if _is_repeated(fd):
            values = getattr(src, fd.name)
            if len(values):
                getattr(dst, fd.name).extend(values)
        elif src.HasField(fd.name):
            if fd.message_type is not None:
                getattr(dst, fd.name).CopyFrom(getattr(src, fd.name))
            else:
                setattr(dst, fd.name, getattr(src, fd.name))


# Fields of a TensorProto that hold or locate its data (the rest: name, dims, type)
DATA_FIELDS = frozenset(
    {"raw_data", "external_data", "data_location", *(name for name, _ in _TYPED_FIELDS)}
)


def _goes_external(tensor: TensorProto, keep: Collection[str] = ()) -> bool:
    if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED) or tensor.name in keep:
        return False
    if tensor.data_location == TensorProto.EXTERNAL:  # a lazy weight's bytes are copied over
        return lazy_file(tensor) is not None
    return tensor_nbytes(tensor) >= MIN_EXTERNAL_BYTES


# Lazy weights: initializers of a model held in memory without their data, each an EXTERNAL
# reference whose location is an absolute path (a staged float model's data file). qtool reads
# one at a time (`tensor_array`) and copies their bytes when it writes the model (`_layout`);
# ONNX Runtime and onnx's loader refuse absolute locations, so such a model is never handed to
# either: it is written first (stage_model, save_model, inline_write.write_model).


def lazy_file(tensor: TensorProto) -> tuple[Path, int, int] | None:
    """(file, offset, length) of a lazy weight, None for any other tensor."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    entries = {e.key: e.value for e in tensor.external_data}
    location = Path(entries.get("location", ""))
    if not location.is_absolute():
        return None
    length = int(entries["length"]) if "length" in entries else raw_nbytes(tensor)
    return location, int(entries.get("offset", 0)), length


def make_lazy(model: onnx.ModelProto, folder: Path) -> None:
    """Turn `model`'s external references (relative to `folder`) into lazy weights, in place."""
    for tensor in _graph_tensors(model.graph):
        if tensor.data_location == TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location" and not Path(entry.value).is_absolute():
                    entry.value = str((Path(folder) / entry.value).resolve())


def external_beyond_initializers(model: onnx.ModelProto) -> bool:
    """Whether a tensor other than a main-graph initializer (a node attribute's, a subgraph's)
    keeps its data in an external file."""
    rest = itertools.islice(_graph_tensors(model.graph), len(model.graph.initializer), None)
    return any(t.data_location == TensorProto.EXTERNAL for t in rest)


def is_lazy(model: onnx.ModelProto) -> bool:
    """Whether any initializer of `model` is a lazy weight."""
    return any(lazy_file(t) is not None for t in model.graph.initializer)


def _read_lazy(tensor: TensorProto) -> bytes:
    where = lazy_file(tensor)
    assert where is not None
    path, offset, length = where
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(length)
    except OSError as exc:
        raise ModelError(f"initializer {tensor.name!r}: cannot read {path} ({exc})") from None
    if len(data) != length:
        raise ModelError(
            f"initializer {tensor.name!r}: {path} ends before offset {offset} + {length} bytes"
        )
    return data


# Element types whose raw_data is the array's bytes as numpy holds them (little-endian, one
# numpy element per ONNX element): a lazy one is read straight into its array.
_PLAIN_TYPES = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT16: np.int16,
    TensorProto.UINT16: np.uint16,
    TensorProto.INT32: np.int32,
    TensorProto.UINT32: np.uint32,
    TensorProto.INT64: np.int64,
    TensorProto.UINT64: np.uint64,
}


def _read_plain(tensor: TensorProto, dtype: type) -> np.ndarray:
    """A lazy weight of a plain type read into its array with one readinto: through a proto, its
    bytes were copied twice more (a 2.15 GB decoder: 4 CPU s of its quantization)."""
    where = lazy_file(tensor)
    assert where is not None
    path, offset, length = where
    array = np.empty(tuple(tensor.dims), dtype)
    if array.nbytes != length:
        raise ModelError(
            f"initializer {tensor.name!r}: {length} bytes in {path} for dims "
            f"{list(tensor.dims)} of {np.dtype(dtype).name}"
        )
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            read = handle.readinto(memoryview(array.reshape(-1)).cast("B"))
    except OSError as exc:
        raise ModelError(f"initializer {tensor.name!r}: cannot read {path} ({exc})") from None
    if read != length:
        raise ModelError(
            f"initializer {tensor.name!r}: {path} ends before offset {offset} + {length} bytes"
        )
    return array


def tensor_array(tensor: TensorProto) -> np.ndarray:
    """`tensor`'s values as numpy_helper.to_array gives them; a lazy weight is read from its file
    (one tensor's bytes, the proto untouched: the model's memory does not grow)."""
    if lazy_file(tensor) is None:
        return numpy_helper.to_array(tensor)
    plain = _PLAIN_TYPES.get(tensor.data_type)
    if plain is not None and sys.byteorder == "little":
        return _read_plain(tensor, plain)
    loaded = TensorProto()
    copy_fields(tensor, loaded, DATA_FIELDS)
    loaded.raw_data = _read_lazy(tensor)
    return numpy_helper.to_array(loaded)


@dataclass
class _Layout:
    """The skeleton of a model and the source tensors whose data the data file holds, in order."""

    skeleton: onnx.ModelProto
    tensors: list[TensorProto]
    offsets: list[int]
    lengths: list[int]


def _layout(model: onnx.ModelProto, location: str, keep: Collection[str] = ()) -> _Layout:
    """Build the skeleton: every field of `model`, each large main-graph initializer (but those
    named in `keep`) replaced by a reference to `location` at an aligned offset (computed from its
    type and shape)."""
    skeleton = onnx.ModelProto()
    copy_fields(model, skeleton, frozenset({"graph"}))
    copy_fields(model.graph, skeleton.graph, frozenset({"initializer"}))
    tensors: list[TensorProto] = []
    offsets: list[int] = []
    lengths: list[int] = []
    end = 0
    for init in model.graph.initializer:
        out = skeleton.graph.initializer.add()
        if not _goes_external(init, keep):
            out.CopyFrom(init)
            continue
        copy_fields(init, out, DATA_FIELDS)
        length = raw_nbytes(init)
        offset = -(-end // ALIGNMENT) * ALIGNMENT
        out.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", offset), ("length", length)):
            entry = out.external_data.add()
            entry.key, entry.value = key, str(value)
        tensors.append(init)
        offsets.append(offset)
        lengths.append(length)
        end = offset + length
    return _Layout(skeleton, tensors, offsets, lengths)


def _set_location(skeleton: onnx.ModelProto, location: str) -> None:
    for init in skeleton.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = location


def _serialize_skeleton(skeleton: onnx.ModelProto, name: str) -> bytes:
    data = skeleton.SerializeToString()
    if len(data) >= PROTOBUF_LIMIT:
        raise ModelError(
            f"model {name!r}: its graph without the initializers' data is still over protobuf's "
            "2 GB limit (large tensors inside nodes or subgraphs?)"
        )
    return data


def _raw_bytes(tensor: TensorProto) -> bytes:
    if lazy_file(tensor) is not None:
        return _read_lazy(tensor)
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.from_array(numpy_helper.to_array(tensor)).raw_data  # typed -> raw


def _write_data(layout: _Layout, handle: BinaryIO, digest) -> None:
    """Stream the tensors' bytes into `handle` (and `digest`), zero padding between them."""
    position = 0
    for tensor, offset, length in zip(layout.tensors, layout.offsets, layout.lengths, strict=True):
        if offset > position:
            padding = bytes(offset - position)
            handle.write(padding)
            digest.update(padding)
        data = _raw_bytes(tensor)
        if len(data) != length:
            raise ModelError(
                f"initializer {tensor.name!r} holds {len(data)} bytes of data, but its type and "
                f"shape {list(tensor.dims)} need {length}"
            )
        handle.write(data)
        digest.update(data)
        del data
        position = offset + length


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Write `model` to `path` and its large initializers to `path`.data (not fsynced: for the
    temporary files that ONNX Runtime sessions and the checker open). `model` is not modified."""
    path = Path(path)
    layout = _layout(model, data_location(path))
    path.write_bytes(_serialize_skeleton(layout.skeleton, model.graph.name))
    with open(path.parent / data_location(path), "wb") as handle:
        _write_data(layout, handle, hashlib.sha256())


def check_model(model: onnx.ModelProto, serialized: bytes | None = None) -> None:
    """onnx.checker on a model of any size. One with CHECK_IN_MEMORY_BYTES of tensor data or
    more is checked as its skeleton file beside a sparse data file of the right size (the checker
    reads references, not the weights): no serialization of the whole model, nothing written.
    `serialized`: `model`'s bytes when the caller has them (the checker would serialize again)."""
    small = data_nbytes(model) < min(CHECK_IN_MEMORY_BYTES, EXTERNAL_DATA_THRESHOLD)
    if small and not is_lazy(model):
        onnx.checker.check_model(serialized if serialized is not None else model)
        return
    layout = _layout(model, "model.onnx.data")
    _check_skeleton(layout.skeleton, _data_end(layout), model.graph.name)


def _data_end(layout: _Layout) -> int:
    return layout.offsets[-1] + layout.lengths[-1] if layout.tensors else 0


def _check_skeleton(skeleton: onnx.ModelProto, end: int, name: str) -> None:
    """onnx.checker on a skeleton whose references name one data file: written beside a sparse
    data file of `end` bytes in a temporary folder (the location is set to the file's name)."""
    with tempfile.TemporaryDirectory(prefix="qtool-check-") as folder:
        path = Path(folder) / "model.onnx"
        _set_location(skeleton, data_location(path))
        path.write_bytes(_serialize_skeleton(skeleton, name))
        with open(path.parent / data_location(path), "wb") as handle:
            handle.truncate(end)
        onnx.checker.check_model(str(path))


# The placeholder that large initializers reference while a converter runs without them.
_DETACHED = "qtool-detached-weights"


def convert_without_weights(
    model: onnx.ModelProto,
    convert: Callable[[onnx.ModelProto], onnx.ModelProto],
    keep: Collection[str] = (),
) -> onnx.ModelProto:
    """Run `convert` (a whole-model rewrite that copies its input: onnx's version converter) on
    `model` without its weights, and make `model` the converted model, in place, around its own
    large initializers (all but those named in `keep`, which `convert` may need to read).

    Why in place: a protobuf message frees nothing it held until the whole message goes (upb
    allocates in one arena per message tree; ClearField, CopyFrom and deleting from a repeated
    field release no memory), so copying a model and detaching its data (the old way) peaked at
    five copies of the weights while preparing (a 304 MB decoder: 1.54 GB). Here `convert` sees a
    skeleton whose large initializers are references to a placeholder file (no data read); its
    result's nodes, graph fields and small initializers replace `model`'s, the large initializers
    stay where they are, reordered to the converted order (a pointer swap). Returns the converted
    skeleton (for checks that need no weights: `check_skeleton` of it). An initializer that
    `convert` dropped is dropped from `model` too."""
    layout = _layout(model, _DETACHED, keep)
    converted = convert(layout.skeleton)
    graph, result = model.graph, converted.graph
    for fd in model.DESCRIPTOR.fields:
        if fd.name != "graph":
            model.ClearField(fd.name)
    copy_fields(converted, model, frozenset({"graph"}))
    for fd in graph.DESCRIPTOR.fields:
        if fd.name != "initializer":
            graph.ClearField(fd.name)
    copy_fields(result, graph, frozenset({"initializer"}))
    order: dict[str, int] = {}
    small: dict[str, TensorProto] = {}
    for index, init in enumerate(result.initializer):
        order[init.name] = index
        if not _is_detached(init):
            small[init.name] = init
    kept = {init.name for init in graph.initializer if init.name in order}
    drop = [i for i, t in enumerate(graph.initializer) if t.name not in order or t.name in small]
    for index in reversed(drop):
        del graph.initializer[index]
    for init in small.values():
        graph.initializer.add().CopyFrom(init)
    missing = set(order) - kept - set(small)
    if missing:
        raise ModelError(f"converting the model lost the data of initializer {min(missing)!r}")
    graph.initializer.sort(key=lambda t: order[t.name])
    return converted


def weightless_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`'s skeleton as `convert_without_weights` gives it to a converter (no data read):
    what `check_skeleton` checks for the model before a conversion."""
    return _layout(model, _DETACHED).skeleton


def _is_detached(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == _DETACHED for e in tensor.external_data
    )


def check_skeleton(skeleton: onnx.ModelProto) -> None:
    """onnx.checker on a skeleton from `convert_without_weights` (its weights are references):
    checked beside a sparse placeholder file as large as its references need."""
    end = 0
    for init in skeleton.graph.initializer:
        if _is_detached(init):
            entries = {e.key: int(e.value) for e in init.external_data if e.key != "location"}
            end = max(end, entries.get("offset", 0) + entries.get("length", 0))
    checked = onnx.ModelProto()
    checked.CopyFrom(skeleton)
    _check_skeleton(checked, end, skeleton.graph.name)


@dataclass(eq=False)
class StagedModel:
    """A model written as external data beside its target but not committed yet.

    `files()` is what `qtool.io.commit_files` takes (the skeleton as bytes, the data file
    staged); until then `session_path`, a second skeleton beside the staged data that names it,
    is what ONNX Runtime sessions and `onnx.load` open. The temporary files go away with
    `discard()`, or when the object is garbage collected or the process exits.

    A model whose weights are all on disk already (lazy weights in the user's files) is staged
    deferred (`stage_model(..., defer=True)`): hashed now, written the first time something
    opens or commits it. A 4-bit weight-only run of a 2.15 GB decoder opens no float session and
    keeps no float copy: writing one cost it 6 of its 26 seconds, for a file it then deleted.
    """

    path: Path
    skeleton: bytes  # the .onnx file's content; its references name `path`.data
    sha256: str
    data_bytes: int  # the data file's size
    _files: tuple[Staged, Staged] | None = None  # (data, session), once written
    _pending: Callable[[], tuple[Staged, Staged]] | None = field(default=None, repr=False)
    _finalizer: weakref.finalize | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self._files is not None:
            self._finalizer = weakref.finalize(self, _discard, *self._files)

    def _written(self) -> tuple[Staged, Staged]:
        if self._files is None:
            if self._pending is None:
                raise ValueError(f"{self.path}: the staged model was discarded")
            self._files, self._pending = self._pending(), None
            self._finalizer = weakref.finalize(self, _discard, *self._files)
        return self._files

    @property
    def written(self) -> bool:
        """Whether the files exist (a deferred stage writes them on first use)."""
        return self._files is not None

    @property
    def data(self) -> Staged:
        return self._written()[0]

    @property
    def session(self) -> Staged:
        return self._written()[1]

    @property
    def session_path(self) -> Path:
        return self.session.path

    @property
    def data_path(self) -> Path:
        return self.path.parent / data_location(self.path)

    def files(self) -> dict[Path, bytes | Staged]:
        return {self.path: self.skeleton, self.data_path: self.data}

    def load(self, skip: Collection[str] = ()) -> onnx.ModelProto:
        """The model with its weights read back: a fresh proto, so whatever memory the protos that
        built it still hold is not carried along (the in-memory path re-parses its bytes).
        Initializers named in `skip` stay references to the staged data file (not read)."""
        if not skip:
            model = onnx.load(str(self.session_path))
            clear_default_locations(model)  # the bytes of the model as it was never staged
            return model
        model = self.structure()
        folder = str(self.session_path.parent)
        for tensor in model.graph.initializer:
            if tensor.data_location == TensorProto.EXTERNAL and tensor.name not in skip:
                load_external_data_for_tensor(tensor, folder)
                tensor.ClearField("data_location")
                del tensor.external_data[:]
        return model

    def lazy(self) -> onnx.ModelProto:
        """The model with lazy weights (see `lazy_file`): its large initializers read from the
        staged data file one at a time when needed, never all at once."""
        model = self.structure()
        make_lazy(model, self.session_path.parent)
        return model

    def structure(self) -> onnx.ModelProto:
        """The model without its weights: large initializers reference the staged data file,
        relative to `session_path`'s folder (what ONNX Runtime reads them from)."""
        return onnx.load(str(self.session_path), load_external_data=False)

    def discard(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._pending = None


def _discard(*staged: Staged) -> None:
    for item in staged:
        item.discard()


class _HashOnly:
    """A sink for `_write_data` that keeps nothing: the digest is all a deferred stage needs."""

    def write(self, data: bytes) -> int:
        return len(data)


def stage_model(model: onnx.ModelProto, path: Path, *, defer: bool = False) -> StagedModel:
    """Stage `model` as `path` + `path`.data (temporary files beside them, fsynced), hashing the
    files' bytes as they are written. `model` is not modified.

    `defer`: hash now and write when first needed (StagedModel); `model` must then stay as it
    is, its large weights lazy (`lazy_file`), since they are read again then. The bytes written
    are checked against the hash: a data file changed meanwhile is an error, not another model."""
    path = Path(path)
    layout = _layout(model, data_location(path))
    skeleton = _serialize_skeleton(layout.skeleton, model.graph.name)
    name = model.graph.name

    def write(expected: str | None = None) -> tuple[Staged, Staged, str]:
        digest = hashlib.sha256(skeleton)
        data = stage(path.parent / data_location(path), lambda h: _write_data(layout, h, digest))
        try:
            if expected is not None and digest.hexdigest() != expected:
                files = sorted({str(f) for f in _lazy_files(layout)})
                raise ModelError(
                    f"{', '.join(files) or path}: changed on disk while qtool ran (its weights "
                    "no longer hash as they did when the model was read)"
                )
            _set_location(layout.skeleton, data.path.name)
            session_bytes = _serialize_skeleton(layout.skeleton, name)
            session = stage(path, lambda h: h.write(session_bytes))
        except BaseException:
            data.discard()
            raise
        return data, session, digest.hexdigest()

    if not defer:
        data, session, sha256 = write()
        return StagedModel(path, skeleton, sha256, _data_end(layout), (data, session))
    digest = hashlib.sha256(skeleton)
    _write_data(layout, _HashOnly(), digest)
    sha256 = digest.hexdigest()
    return StagedModel(
        path, skeleton, sha256, _data_end(layout), _pending=lambda: write(sha256)[:2]
    )


def _lazy_files(layout: _Layout) -> list[Path]:
    return [where[0] for t in layout.tensors if (where := lazy_file(t)) is not None]


def all_weights_on_disk(model: onnx.ModelProto, held_limit: int) -> bool:
    """Whether `model`'s large weights are lazy and what it holds in memory stays under
    `held_limit` bytes: then staging it can wait (stage_model's `defer`)."""
    held = sum(tensor_nbytes(t) for t in model.graph.initializer if lazy_file(t) is None)
    return is_lazy(model) and held < held_limit


# Reading


def external_files(path: Path, model: onnx.ModelProto | None = None) -> list[Path]:
    """The data files that the model file `path` references, in first-reference order; `model` is
    its proto when already read (without external data)."""
    path = Path(path)
    if model is None:
        model = onnx.load(str(path), load_external_data=False)
    files: dict[Path, None] = {}
    for tensor in _graph_tensors(model.graph):
        if tensor.data_location == TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    files[path.parent / entry.value] = None
    return list(files)


def model_file_bytes(path: Path, model: onnx.ModelProto | None = None) -> int:
    """Bytes on disk of the model file `path` and the external data files it references."""
    path = Path(path)
    files = [path, *external_files(path, model)]
    try:
        return sum(file.stat().st_size for file in files)
    except FileNotFoundError as exc:
        raise ModelError(f"{path}: external data file {exc.filename} does not exist") from None


def model_sha256(path: Path, model: onnx.ModelProto | None = None) -> str:
    """SHA-256 of the model file followed by its external data files (streamed): for a model
    without external data, the file's own SHA-256. `model`: its proto, when already read."""
    digest = hashlib.sha256()
    hash_files(digest, [Path(path), *external_files(path, model)], path)
    return digest.hexdigest()


def hash_files(digest: hashlib._Hash, files: list[Path], model_path: Path) -> None:
    """Stream `files` into `digest` in order (the model file `model_path` references them)."""
    for file in files:
        try:
            with open(file, "rb") as handle:
                while block := handle.read(_CHUNK):
                    digest.update(block)
        except FileNotFoundError:
            raise ModelError(f"{model_path}: external data file {file} does not exist") from None
