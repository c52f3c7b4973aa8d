"""The pieces of protobuf's wire format that qtool's streaming reader and writer of ONNX files
share (inline_lazy reads a model around its initializers' raw_data, inline_write writes one so):
the field numbers they split on, the wire types, and varint keys."""

from __future__ import annotations

import onnx

# Field numbers, from onnx's own descriptors.
GRAPH = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
INITIALIZER = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number
RAW_DATA = onnx.TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number

# Wire types (groups, 3 and 4, are not used by onnx.proto).
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


def encode_varint(value: int) -> bytes:
    """`value` (non-negative) as a base-128 varint."""
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def length_key(number: int) -> bytes:
    """The key of a length-delimited field (a message, bytes, a string)."""
    return encode_varint((number << 3) | LENGTH_DELIMITED)
