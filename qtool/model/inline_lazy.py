"""Load a large single-file ONNX model without holding its weights: each large initializer
becomes a lazy weight (external_data.lazy_file) that points at its raw_data inside the user's
own file.

Why: `onnx.load` of an inline model holds the file's bytes and the parsed proto at once, twice
the file (a 542 MB decoder peaked at 1.1 GB before qtool had done anything), and the staged
path copied the weights out again right after. Protobuf's wire format lets the graph be read
field by field: every field but the initializers' raw_data is parsed as usual, and the
raw_data is skipped, its offset and length recorded. The weights are then read one tensor at a
time by whoever needs them (folding, staging, quantizing), as for any staged model.

Anything this reader does not expect (a group field, a second graph, an initializer that is
already external, a big tensor stored in typed fields) makes it return None, and the caller
loads the file the ordinary way: the same model, at the ordinary memory cost.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto

from qtool.errors import ModelError, first_line
from qtool.model.wire_format import (
    FIXED32,
    FIXED64,
    GRAPH,
    INITIALIZER,
    LENGTH_DELIMITED,
    RAW_DATA,
    VARINT,
)

# An initializer smaller than this is parsed whole; a larger one is walked field by field.
_WALK_BYTES = 64 << 10
_HASH_CHUNK = 16 << 20


class _Unexpected(Exception):
    """A file this reader leaves to onnx.load (see the module docstring)."""


def _read_varint(handle: BinaryIO) -> int:
    value, shift = 0, 0
    while True:
        byte = handle.read(1)
        if not byte:
            raise _Unexpected("the file ends inside a field header")
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7
        if shift > 63:
            raise _Unexpected("a varint longer than 10 bytes")


def _spans(handle: BinaryIO, end: int) -> list[tuple[int, int, int, int]]:
    """Every field up to `end` as (number, wire type, field start, payload start, field end)."""
    spans = []
    while handle.tell() < end:
        start = handle.tell()
        key = _read_varint(handle)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            _read_varint(handle)
            payload = stop = handle.tell()
        elif wire == LENGTH_DELIMITED:
            length = _read_varint(handle)
            payload = handle.tell()
            stop = payload + length
        elif wire in (FIXED64, FIXED32):
            payload = handle.tell()
            stop = payload + (8 if wire == FIXED64 else 4)
        else:
            raise _Unexpected(f"wire type {wire} (groups are not used by onnx.proto)")
        if stop > end:
            raise _Unexpected("a field runs past the end of its message")
        spans.append((number, wire, start, payload, stop))
        handle.seek(stop)
    return spans


def _read(handle: BinaryIO, start: int, stop: int) -> bytes:
    handle.seek(start)
    data = handle.read(stop - start)
    if len(data) != stop - start:
        raise _Unexpected("the file ends inside a field")
    return data


def _lazy_tensor(handle: BinaryIO, path: Path, start: int, stop: int) -> TensorProto:
    """The initializer in [start, stop): parsed whole when small, else everything but its
    raw_data, which becomes a lazy reference into `path`."""
    if stop - start < _WALK_BYTES:
        return TensorProto.FromString(_read(handle, start, stop))
    handle.seek(start)
    meta = bytearray()
    raw: tuple[int, int] | None = None
    for number, wire, field_start, payload, field_stop in _spans(handle, stop):
        if number == RAW_DATA and wire == LENGTH_DELIMITED:
            raw = (payload, field_stop - payload)  # the last one wins, as in protobuf
        else:
            meta += _read(handle, field_start, field_stop)
    tensor = TensorProto.FromString(bytes(meta))
    if raw is None or tensor.data_location == TensorProto.EXTERNAL:
        raise _Unexpected(f"initializer {tensor.name!r} is large but not stored as raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", str(path)), ("offset", raw[0]), ("length", raw[1])):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor


def _graph(handle: BinaryIO, path: Path, start: int, stop: int) -> onnx.GraphProto:
    handle.seek(start)
    rest = bytearray()
    initializers: list[TensorProto] = []
    for number, wire, field_start, payload, field_stop in _spans(handle, stop):
        if number == INITIALIZER and wire == LENGTH_DELIMITED:
            initializers.append(_lazy_tensor(handle, path, payload, field_stop))
        else:
            rest += _read(handle, field_start, field_stop)
    graph = onnx.GraphProto.FromString(bytes(rest))
    graph.initializer.extend(initializers)
    return graph


def _scan(handle: BinaryIO, path: Path, size: int) -> onnx.ModelProto:
    handle.seek(0)
    rest = bytearray()
    graphs = []
    for number, wire, field_start, payload, field_stop in _spans(handle, size):
        if number == GRAPH and wire == LENGTH_DELIMITED:
            graphs.append((payload, field_stop))
        else:
            rest += _read(handle, field_start, field_stop)
    if len(graphs) != 1:
        raise _Unexpected(f"{len(graphs)} graph fields")
    model = onnx.ModelProto.FromString(bytes(rest))
    model.graph.CopyFrom(_graph(handle, path, *graphs[0]))
    return model


def load_inline_lazy(path: Path, digest: hashlib._Hash | None = None) -> onnx.ModelProto | None:
    """`path` (a single-file ONNX model) with its large initializers lazy, or None when the file
    is not one this reader takes (the caller then loads it whole). `digest` is fed the file's
    bytes, read in chunks (the page cache holds them, not this process)."""
    path = Path(path).resolve()
    try:
        with open(path, "rb", buffering=1 << 16) as handle:
            size = path.stat().st_size
            try:
                model = _scan(handle, path, size)
            except (_Unexpected, DecodeError):  # a damaged file: onnx.load names the fault
                return None
            if digest is not None:
                handle.seek(0)
                while chunk := handle.read(_HASH_CHUNK):
                    digest.update(chunk)
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the model file ({first_line(exc)})") from None
    return model
