"""Cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization", section 4.1).

Conv A -> (Relu | nothing) -> Conv B computes the same function when A's output channel i is
divided by s_i > 0 and B's input channel i multiplied by s_i, because Relu(x / s) = Relu(x) / s.
Choosing s_i = sqrt(r1_i / r2_i) (r1: A's range in output channel i, r2: B's range in input
channel i) gives both the same range sqrt(r1_i r2_i), so one per-tensor grid no longer wastes
its levels on a few wide channels: the case of depthwise convolutions, whose channels differ by
orders of magnitude once BatchNorm is folded in. Chains of three or more convolutions share
their middle layers, so the pairs are equalized in turns until the scales settle.

Only exact rewrites are made: Clip(0, 6) (ReLU6) is not scale-equivariant (its bound would
have to move per channel), other activations are not either, and a tensor read by more than one
node cannot be rescaled for one reader alone; such pairs are left as they are and listed with the
reason. Bias absorption (moving part of A's bias through the Relu) needs the pre-activation
distribution, which BatchNorm folding has already discarded here; it is not done.

A pair is kept only when it lowers the weight quantization noise of the two layers at the
recipe's weight granularity (relative noise energy of an 8-bit grid, summed over both); with
per-channel weights A's noise cannot change, so the decision rests on B's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

# Activations between the two convolutions through which a positive per-channel scale passes.
_EQUIVARIANT = {"Relu"}
_ROUNDS = 20  # pairwise passes over a chain; settles in a few on real networks
_TOLERANCE = 1e-6  # stop when no scale moves by more than this (relative)
_MIN_RANGE = 1e-12  # channels whose weights are all zero are left unscaled


@dataclass
class _Pair:
    first: onnx.NodeProto
    second: onnx.NodeProto
    activation: str  # "Relu" or "none"


@dataclass
class _Conv:
    node: onnx.NodeProto
    weight: np.ndarray  # float64 copy, written back at the end
    bias: np.ndarray | None
    group: int

    @property
    def depthwise(self) -> bool:
        return self.group > 1 and self.weight.shape[1] == 1 and self.group == self.weight.shape[0]


def _group(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def _readers(graph: onnx.GraphProto) -> Counter:
    readers: Counter = Counter(name for node in graph.node for name in node.input)
    readers.update(o.name for o in graph.output)  # a graph output is read from outside
    return readers


def _skip(first: str, second: str, why: str) -> dict:
    return {"first": first, "second": second, "why": why}


def _find_pairs(
    graph: onnx.GraphProto, convs: dict[str, _Conv], only: set[str] | None
) -> tuple[list[_Pair], list[dict]]:
    """Conv -> (Relu | nothing) -> Conv pairs that can be rescaled exactly, and the near misses."""
    readers = _readers(graph)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    pairs, skipped = [], []
    for name, conv in convs.items():
        if only is not None and name not in only:
            continue
        tensor = conv.node.output[0]
        after = consumers.get(tensor, [])
        if len(after) != 1 or readers[tensor] != 1:
            continue
        activation, nxt = "none", after[0]
        if nxt.op_type != "Conv":
            middle = nxt
            if len(middle.output) != 1 or readers[middle.output[0]] != 1:
                continue
            following = consumers.get(middle.output[0], [])
            if len(following) != 1 or following[0].op_type != "Conv":
                continue
            if middle.op_type not in _EQUIVARIANT:
                why = (
                    "Clip between: ReLU6's bound would have to move per channel"
                    if middle.op_type == "Clip"
                    else f"{middle.op_type} between is not scale-equivariant"
                )
                skipped.append(_skip(name, following[0].name, why))
                continue
            activation, nxt = middle.op_type, following[0]
        if nxt.input[0] != (tensor if activation == "none" else middle.output[0]):
            continue  # the tensor is B's weight or bias, not its data input
        second = convs.get(nxt.name)
        if second is None:
            skipped.append(_skip(name, nxt.name, "its weight is not a constant"))
            continue
        if only is not None and nxt.name not in only:
            skipped.append(_skip(name, nxt.name, "the second layer is not quantized"))
            continue
        if second.group != 1 and not second.depthwise:
            skipped.append(_skip(name, nxt.name, "grouped convolution (not depthwise)"))
            continue
        if conv.group != 1 and not conv.depthwise:
            skipped.append(_skip(name, nxt.name, "grouped convolution (not depthwise)"))
            continue
        pairs.append(_Pair(conv.node, nxt, activation))
    return pairs, skipped


def _output_ranges(conv: _Conv) -> np.ndarray:
    """Max |w| per output channel of a convolution."""
    return np.abs(conv.weight).reshape(conv.weight.shape[0], -1).max(axis=1)


def _input_ranges(conv: _Conv) -> np.ndarray:
    """Max |w| per input channel (depthwise: its one filter per channel)."""
    if conv.depthwise:
        return _output_ranges(conv)
    return np.abs(conv.weight).transpose(1, 0, 2, 3).reshape(conv.weight.shape[1], -1).max(axis=1)


def _scale_output(conv: _Conv, scale: np.ndarray) -> None:
    """Divide output channel i by scale_i (weight and bias)."""
    conv.weight /= scale.reshape(-1, *([1] * (conv.weight.ndim - 1)))
    if conv.bias is not None:
        conv.bias /= scale


def _scale_input(conv: _Conv, scale: np.ndarray) -> None:
    """Multiply input channel i by scale_i; depthwise: channel i's filter is its output i, so
    its bias is left alone (the output is unchanged, only the input it reads is divided)."""
    if conv.depthwise:
        conv.weight *= scale.reshape(-1, *([1] * (conv.weight.ndim - 1)))
    else:
        conv.weight *= scale.reshape(1, -1, *([1] * (conv.weight.ndim - 2)))


def relative_noise(weight: np.ndarray, per_channel: bool, bits: int = 8) -> float:
    """Noise energy of rounding `weight` to a symmetric `bits` grid over its signal energy.

    Uniform rounding noise has variance step^2 / 12 per element; the grid's step is set by the
    largest |w| in the tensor (per-tensor) or in each output channel (per-channel)."""
    flat = np.abs(weight.reshape(weight.shape[0], -1))
    levels = 2 ** (bits - 1) - 1
    if per_channel:
        steps = flat.max(axis=1) / levels
        noise = float(np.sum(steps**2 * flat.shape[1])) / 12.0
    else:
        noise = (float(flat.max()) / levels) ** 2 * flat.size / 12.0
    signal = float(np.sum(weight.astype(np.float64) ** 2))
    return noise / signal if signal > 0 else 0.0


def _convs(model: onnx.ModelProto) -> dict[str, _Conv]:
    """4-D Conv nodes whose weight (and bias) are initializers read by that node alone."""
    initializers = {init.name: init for init in model.graph.initializer}
    readers = _readers(model.graph)
    convs = {}
    for node in model.graph.node:
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in initializers:
            continue
        names = [name for name in node.input[1:3] if name]
        if any(name not in initializers or readers[name] != 1 for name in names):
            continue
        weight = numpy_helper.to_array(initializers[node.input[1]]).astype(np.float64)
        if weight.ndim != 4:
            continue
        bias = None
        if len(node.input) > 2 and node.input[2]:
            bias = numpy_helper.to_array(initializers[node.input[2]]).astype(np.float64)
        convs[node.name] = _Conv(node, weight, bias, _group(node))
    return convs


def equalize(model: onnx.ModelProto, per_channel: bool, only: set[str] | None = None) -> dict:
    """Equalize every eligible pair of `model` in place and return the report entry.

    `only`: the nodes that will be quantized (None: every Conv); a pair is equalized only when
    both of its layers are. `per_channel`: the weight granularity the pair is judged at."""
    convs = _convs(model)
    pairs, skipped = _find_pairs(model.graph, convs, only)
    originals = {
        name: (c.weight.copy(), None if c.bias is None else c.bias.copy())
        for name, c in convs.items()
    }
    before = {
        (p.first.name, p.second.name): (
            _output_ranges(convs[p.first.name]).copy(),
            _input_ranges(convs[p.second.name]).copy(),
            relative_noise(convs[p.first.name].weight, per_channel)
            + relative_noise(convs[p.second.name].weight, per_channel),
        )
        for p in pairs
    }
    _rebalance(convs, pairs)
    kept, applied = set(), []
    for pair in pairs:
        key = (pair.first.name, pair.second.name)
        r1_before, r2_before, noise_before = before[key]
        first, second = convs[pair.first.name], convs[pair.second.name]
        noise_after = relative_noise(first.weight, per_channel) + relative_noise(
            second.weight, per_channel
        )
        entry = {
            "first": key[0],
            "second": key[1],
            "activation": pair.activation,
            "depthwise": [first.depthwise, second.depthwise],
            "range_spread_before": _spread(r1_before, r2_before),
            "range_spread_after": _spread(_output_ranges(first), _input_ranges(second)),
            "weight_noise_before": noise_before,
            "weight_noise_after": noise_after,
        }
        if noise_after < noise_before:
            kept.update(key)
            applied.append(entry)
        else:
            skipped.append(_skip(key[0], key[1], "no lower weight quantization noise"))
            skipped[-1].update(weight_noise_before=noise_before, weight_noise_after=noise_after)
    if len(applied) < len(pairs):  # undo all and redo only the kept pairs: chains interact
        for name, (weight, bias) in originals.items():
            convs[name].weight, convs[name].bias = (
                weight.copy(),
                None if bias is None else bias.copy(),
            )
        if applied:
            wanted = {(e["first"], e["second"]) for e in applied}
            keep_pairs = [p for p in pairs if (p.first.name, p.second.name) in wanted]
            _rebalance(convs, keep_pairs)
    _write_back(model, convs, kept)
    return {"per_channel_weights": per_channel, "pairs": applied, "skipped": skipped}


def _rebalance(convs: dict[str, _Conv], pairs: list[_Pair]) -> None:
    """Equalize the pairs in turns until no scale moves (a middle layer belongs to two pairs)."""
    for _ in range(_ROUNDS):
        moved = 0.0
        for pair in pairs:
            first, second = convs[pair.first.name], convs[pair.second.name]
            r1, r2 = _output_ranges(first), _input_ranges(second)
            live = (r1 > _MIN_RANGE) & (r2 > _MIN_RANGE)
            scale = np.ones_like(r1)
            scale[live] = np.sqrt(r1[live] / r2[live])
            _scale_output(first, scale)
            _scale_input(second, scale)
            moved = max(moved, float(np.max(np.abs(scale - 1.0))) if scale.size else 0.0)
        if moved < _TOLERANCE:
            break


def _spread(r1: np.ndarray, r2: np.ndarray) -> float:
    """Widest over narrowest channel range, the worse of the two layers (1 = all equal)."""

    def one(r: np.ndarray) -> float:
        live = r[r > _MIN_RANGE]
        return float(live.max() / live.min()) if live.size else 1.0

    return max(one(r1), one(r2))


def _write_back(model: onnx.ModelProto, convs: dict[str, _Conv], names: set[str]) -> None:
    """Replace the initializers of the rescaled convolutions (float32, as they were)."""
    wanted = {}
    for name in names:
        conv = convs[name]
        wanted[conv.node.input[1]] = conv.weight
        if conv.bias is not None:
            wanted[conv.node.input[2]] = conv.bias
    for index, init in enumerate(model.graph.initializer):
        if init.name in wanted:
            replacement = numpy_helper.from_array(wanted[init.name].astype(np.float32), init.name)
            model.graph.initializer[index].CopyFrom(replacement)
