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
import math
import tempfile
import weakref
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor

from qtool.errors import ModelError
from qtool.io import Staged, stage

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "PROTOBUF_LIMIT",
    "StagedModel",
    "check_model",
    "data_nbytes",
    "external_files",
    "model_sha256",
    "needs_external_data",
    "save_model",
    "stage_model",
    "write_model",
]

# protobuf refuses to serialize or parse a message of this size or more.
PROTOBUF_LIMIT = 2**31 - 1
# Tensor data at or above this goes to a data file: the limit less room for the graph itself
# (nodes, names, shapes: megabytes even for the largest exporter graphs). Tests lower it.
EXTERNAL_DATA_THRESHOLD = PROTOBUF_LIMIT - (128 << 20)
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
    raw_data copies it: 60 ms per 64 MB); 0 when it lives in an external file already."""
    if tensor.data_location == TensorProto.EXTERNAL:
        return 0
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


# Writing


def _is_repeated(fd) -> bool:
    repeated = getattr(fd, "is_repeated", None)
    return bool(repeated) if repeated is not None else fd.label == fd.LABEL_REPEATED


def _copy_fields(src, dst, skip: frozenset[str]) -> None:
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


_DATA_FIELDS = frozenset(
    {"raw_data", "external_data", "data_location", *(name for name, _ in _TYPED_FIELDS)}
)


def _goes_external(tensor: TensorProto) -> bool:
    return (
        tensor.data_type not in (TensorProto.STRING, TensorProto.UNDEFINED)
        and tensor.data_location != TensorProto.EXTERNAL
        and tensor_nbytes(tensor) >= MIN_EXTERNAL_BYTES
    )


@dataclass
class _Layout:
    """The skeleton of a model and the source tensors whose data the data file holds, in order."""

    skeleton: onnx.ModelProto
    tensors: list[TensorProto]
    offsets: list[int]
    lengths: list[int]


def _layout(model: onnx.ModelProto, location: str) -> _Layout:
    """Build the skeleton: every field of `model`, each large main-graph initializer replaced by
    a reference to `location` at an aligned offset (computed from its type and shape)."""
    skeleton = onnx.ModelProto()
    _copy_fields(model, skeleton, frozenset({"graph"}))
    _copy_fields(model.graph, skeleton.graph, frozenset({"initializer"}))
    tensors: list[TensorProto] = []
    offsets: list[int] = []
    lengths: list[int] = []
    end = 0
    for init in model.graph.initializer:
        out = skeleton.graph.initializer.add()
        if not _goes_external(init):
            out.CopyFrom(init)
            continue
        _copy_fields(init, out, _DATA_FIELDS)
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


def write_model(model: onnx.ModelProto, path: Path) -> None:
    """Write a temporary model file for ONNX Runtime: one protobuf when it fits, else `save_model`
    (the skeleton plus `path`.data)."""
    if needs_external_data(model):
        save_model(model, path)
    else:
        Path(path).write_bytes(model.SerializeToString())


def check_model(model: onnx.ModelProto, serialized: bytes | None = None) -> None:
    """onnx.checker on a model of any size. One with CHECK_IN_MEMORY_BYTES of tensor data or
    more is checked as its skeleton file beside a sparse data file of the right size (the checker
    reads references, not the weights): no serialization of the whole model, nothing written.
    `serialized`: `model`'s bytes when the caller has them (the checker would serialize again)."""
    if data_nbytes(model) < min(CHECK_IN_MEMORY_BYTES, EXTERNAL_DATA_THRESHOLD):
        onnx.checker.check_model(serialized if serialized is not None else model)
        return
    with tempfile.TemporaryDirectory(prefix="qtool-check-") as folder:
        path = Path(folder) / "model.onnx"
        layout = _layout(model, data_location(path))
        path.write_bytes(_serialize_skeleton(layout.skeleton, model.graph.name))
        end = layout.offsets[-1] + layout.lengths[-1] if layout.tensors else 0
        with open(path.parent / data_location(path), "wb") as handle:
            handle.truncate(end)
        onnx.checker.check_model(str(path))


@dataclass
class StagedModel:
    """A model written as external data beside its target but not committed yet.

    `files()` is what `qtool.io.commit_files` takes (the skeleton as bytes, the data file
    staged); until then `session_path`, a second skeleton beside the staged data that names it,
    is what ONNX Runtime sessions and `onnx.load` open. The temporary files go away with
    `discard()`, or when the object is garbage collected or the process exits.
    """

    path: Path
    skeleton: bytes  # the .onnx file's content; its references name `path`.data
    data: Staged
    session: Staged
    sha256: str
    _finalizer: weakref.finalize = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _discard, self.data, self.session)

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
            return onnx.load(str(self.session_path))
        model = self.structure()
        folder = str(self.session_path.parent)
        for tensor in model.graph.initializer:
            if tensor.data_location == TensorProto.EXTERNAL and tensor.name not in skip:
                load_external_data_for_tensor(tensor, folder)
                tensor.data_location = TensorProto.DEFAULT
                del tensor.external_data[:]
        return model

    def structure(self) -> onnx.ModelProto:
        """The model without its weights: large initializers reference the staged data file,
        relative to `session_path`'s folder (what ONNX Runtime reads them from)."""
        return onnx.load(str(self.session_path), load_external_data=False)

    def discard(self) -> None:
        self._finalizer()


def _discard(*staged: Staged) -> None:
    for item in staged:
        item.discard()


def stage_model(model: onnx.ModelProto, path: Path) -> StagedModel:
    """Stage `model` as `path` + `path`.data (temporary files beside them, fsynced), hashing the
    files' bytes as they are written. `model` is not modified."""
    path = Path(path)
    layout = _layout(model, data_location(path))
    skeleton = _serialize_skeleton(layout.skeleton, model.graph.name)
    digest = hashlib.sha256(skeleton)
    data = stage(path.parent / data_location(path), lambda h: _write_data(layout, h, digest))
    try:
        _set_location(layout.skeleton, data.path.name)
        session_bytes = _serialize_skeleton(layout.skeleton, model.graph.name)
        session = stage(path, lambda h: h.write(session_bytes))
    except BaseException:
        data.discard()
        raise
    return StagedModel(path, skeleton, data, session, digest.hexdigest())


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
