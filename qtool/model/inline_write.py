"""Write a model that holds lazy weights as one protobuf file, streaming the weights from their
files: the bytes `model.SerializeToString()` gives once every lazy weight is read in, without
that copy of the model in memory.

Why: a quantized decoder under protobuf's 2 GB limit ships as one .onnx file, and serializing it
held the proto and its bytes at once; verification then opened its sessions from those bytes,
each copying them. Protobuf's wire format is a sequence of (tag, length, payload) fields, written
in field-number order, so the file can be assembled from the parts around the initializers'
raw_data (serialized without it) and the raw_data copied from the lazy weights' files chunk by
chunk. The lengths that prefix the graph and each initializer are known in advance from the
parts' sizes and the lazy weights' recorded lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import onnx
from google.protobuf.message import Message
from onnx import TensorProto

from qtool.errors import ModelError
from qtool.model.external_data import (
    PROTOBUF_LIMIT,
    copy_fields,
    is_lazy,
    lazy_file,
    needs_external_data,
    save_model,
)
from qtool.model.wire_format import GRAPH, INITIALIZER, RAW_DATA, encode_varint, length_key

# What a lazy weight carries that its inline form does not (read_lazy_weights clears them).
_REFERENCE_FIELDS = frozenset({"external_data", "data_location"})
_CHUNK = 16 << 20


def _part(message: Message, keep: Callable[[int], bool], skip: frozenset[str] = frozenset()):
    """`message` serialized with only the fields whose number `keep` accepts (never reads the
    others, so a skipped raw_data is not copied)."""
    part = type(message)()
    left_out = {fd.name for fd in message.DESCRIPTOR.fields if not keep(fd.number)}
    copy_fields(message, part, frozenset(left_out | skip))
    return part.SerializeToString()


class _Initializer:
    """One initializer as written: its bytes, or the parts around a lazy weight's raw_data."""

    def __init__(self, tensor: TensorProto) -> None:
        self.name = tensor.name
        self.lazy = lazy_file(tensor)
        if self.lazy is None:
            self.head, self.tail = tensor.SerializeToString(), b""
            self.length = len(self.head)
            return
        self.head = _part(tensor, lambda n: n < RAW_DATA)
        self.tail = _part(tensor, lambda n: n > RAW_DATA, _REFERENCE_FIELDS)
        size = self.lazy[2]
        self.raw_key = length_key(RAW_DATA) + encode_varint(size)
        self.length = len(self.head) + len(self.raw_key) + size + len(self.tail)

    def write(self, handle: BinaryIO) -> None:
        handle.write(length_key(INITIALIZER) + encode_varint(self.length))
        handle.write(self.head)
        if self.lazy is not None:
            handle.write(self.raw_key)
            self._copy(handle)
        handle.write(self.tail)

    def _copy(self, handle: BinaryIO) -> None:
        path, offset, length = self.lazy
        try:
            with open(path, "rb") as source:
                source.seek(offset)
                left = length
                while left:
                    chunk = source.read(min(_CHUNK, left))
                    if not chunk:
                        raise ModelError(
                            f"initializer {self.name!r}: {path} ends before offset {offset} + "
                            f"{length} bytes"
                        )
                    handle.write(chunk)
                    left -= len(chunk)
        except OSError as exc:
            raise ModelError(f"initializer {self.name!r}: cannot read {path} ({exc})") from None


def write_inline(model: onnx.ModelProto, handle: BinaryIO) -> int:
    """Write `model` to `handle` as one protobuf, each lazy weight's bytes read from its file in
    chunks; returns the bytes written. Raises ModelError at protobuf's 2 GB limit (such a model
    ships with external data: external_data.stage_model)."""
    graph = model.graph
    initializers = [_Initializer(tensor) for tensor in graph.initializer]
    graph_head = _part(graph, lambda n: n < INITIALIZER)
    graph_tail = _part(graph, lambda n: n > INITIALIZER)
    graph_length = len(graph_head) + len(graph_tail)
    graph_length += sum(
        len(length_key(INITIALIZER) + encode_varint(i.length)) + i.length for i in initializers
    )
    model_head = _part(model, lambda n: n < GRAPH)
    model_tail = _part(model, lambda n: n > GRAPH)
    graph_key = length_key(GRAPH) + encode_varint(graph_length)
    total = len(model_head) + len(graph_key) + graph_length + len(model_tail)
    if total >= PROTOBUF_LIMIT:
        raise ModelError(
            f"model {graph.name!r}: {total} bytes is over protobuf's 2 GB limit for one file"
        )
    handle.write(model_head)
    handle.write(graph_key)
    handle.write(graph_head)
    for initializer in initializers:
        initializer.write(handle)
    handle.write(graph_tail)
    handle.write(model_tail)
    return total


def write_model(model: onnx.ModelProto, path: Path) -> None:
    """Write a temporary model file for ONNX Runtime: one protobuf when it fits (its lazy
    weights read in as it is written: ONNX Runtime refuses their absolute locations), else
    `save_model` (the skeleton plus `path`.data)."""
    if needs_external_data(model):
        save_model(model, path)
    elif is_lazy(model):  # a model built from a staged float model keeps some of its weights
        with open(path, "wb") as handle:
            write_inline(model, handle)
    else:
        Path(path).write_bytes(model.SerializeToString())
