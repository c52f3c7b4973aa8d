"""Fold a zero Pad into the Conv it feeds: TensorFlow-style "same" padding exported as its own node.

Ports of TensorFlow models (EfficientNet-Lite, MobileNet ports, anything with `padding="SAME"` and
a stride of 2) pad with a separate `nn.ZeroPad2d` / `F.pad`, because "same" padding is asymmetric
there and PyTorch's Conv2d only pads symmetrically. The export is Pad -> Conv. Left in, the Pad
sits between an activation's QuantizeLinear and the Conv: the quantizer sees a float tensor that
is not the output of the quantized activation, ONNX Runtime cannot fold the Relu/Clip into the
previous layer's range as cleanly, and cross-layer equalization finds no Conv -> act -> Conv
chain. ONNX Conv has per-side `pads` ([x1_begin, x2_begin, ..., x1_end, x2_end]), so a Pad that
adds zeros on spatial axes only is exactly the Conv's own zero padding: the rewrite is exact.

Folded only when: the Pad is a standard-domain Pad in "constant" mode with value 0 (or none), its
pads are constant, non-negative and zero on the batch and channel axes (and `axes`, if given, is
constant), and its output is read by that one Conv as its data input and nowhere else; the Conv
has `auto_pad` NOTSET (or absent), a spatial rank matching the pads.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qtool.model.external_data import tensor_array
from qtool.model.graph_edit import STANDARD_DOMAINS, consumer_counts, delete_indexes

__all__ = ["fold_pads", "zero_spatial_pads"]


def _attr(node: onnx.NodeProto, name: str):
    found = next((a for a in node.attribute if a.name == name), None)
    return None if found is None else helper.get_attribute_value(found)


def _constant(name: str, inits: dict[str, onnx.TensorProto]) -> np.ndarray | None:
    return tensor_array(inits[name]) if name in inits else None


def zero_spatial_pads(
    pad: onnx.NodeProto, rank: int, inits: dict[str, onnx.TensorProto]
) -> list[int] | None:
    """The Pad's zero padding as a Conv `pads` list ([begins..., ends...] of the spatial axes of a
    rank-`rank` tensor), or None when it is not a constant-zero Pad of spatial axes only."""
    if pad.op_type != "Pad" or pad.domain not in STANDARD_DOMAINS:
        return None
    mode = _attr(pad, "mode")
    if mode not in (None, b"constant", "constant"):
        return None
    if len(pad.input) > 2 and pad.input[2]:
        value = _constant(pad.input[2], inits)
        if value is None or value.size != 1 or float(value.reshape(())) != 0.0:
            return None
    if len(pad.input) < 2 or not pad.input[1]:
        return None  # opset < 11: pads as an attribute (old exports); not handled
    pads = _constant(pad.input[1], inits)
    if pads is None or pads.ndim != 1:
        return None
    axes = list(range(rank))
    if len(pad.input) > 3 and pad.input[3]:
        given = _constant(pad.input[3], inits)
        if given is None:
            return None
        axes = [int(a) % rank for a in given.reshape(-1)]
    if pads.size != 2 * len(axes):
        return None
    full = np.zeros(2 * rank, dtype=np.int64)
    for k, axis in enumerate(axes):
        full[axis], full[rank + axis] = pads[k], pads[len(axes) + k]
    if np.any(full < 0) or np.any(full[[0, 1, rank, rank + 1]] != 0):
        return None
    return [int(v) for v in full[2:rank]] + [int(v) for v in full[rank + 2 :]]


def fold_pads(graph: onnx.GraphProto, types: dict[str, onnx.TypeProto]) -> bool:
    """Fold every foldable Pad (module docstring) into its Conv; True when any was folded.

    The Conv reads the Pad's input and adds the Pad's amounts to its own `pads`; the Pad is
    removed (its pads/value initializers become dead and are dropped by the caller)."""
    inits = {t.name: t for t in graph.initializer}
    consumers = consumer_counts(graph)
    graph_outputs = {o.name for o in graph.output}
    producers = {o: (i, node) for i, node in enumerate(graph.node) for o in node.output if o}
    doomed: list[int] = []
    for conv in graph.node:
        if conv.op_type != "Conv" or conv.domain not in STANDARD_DOMAINS or not conv.input:
            continue
        found = producers.get(conv.input[0])
        if found is None or found[1].op_type != "Pad":
            continue
        index, pad = found
        padded = conv.input[0]
        if padded in graph_outputs or consumers[padded] != 1:
            continue
        if _attr(conv, "auto_pad") not in (None, b"NOTSET", "NOTSET"):
            continue
        kind = types.get(pad.input[0])
        if kind is None or not kind.tensor_type.HasField("shape"):
            continue
        rank = len(kind.tensor_type.shape.dim)
        extra = zero_spatial_pads(pad, rank, inits) if rank >= 3 else None
        if extra is None:
            continue
        own = _attr(conv, "pads")
        own = list(own) if own is not None else [0] * len(extra)
        if len(own) != len(extra):
            continue
        merged = [a + b for a, b in zip(own, extra, strict=True)]
        for attribute in list(conv.attribute):
            if attribute.name in ("pads", "auto_pad"):
                conv.attribute.remove(attribute)
        conv.attribute.append(helper.make_attribute("pads", merged))
        conv.input[0] = pad.input[0]
        doomed.append(index)
    delete_indexes(graph.node, doomed)
    return bool(doomed)
