"""Cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization", section 4.1).

Conv A -> (Relu | Clip(0, hi) | nothing) -> (zero Pad) -> Conv B computes the same function when
A's output channel i is divided by s_i > 0 and B's input channel i multiplied by s_i, because
Relu(x / s) = Relu(x) / s and a zero Pad commutes with scaling. Choosing s_i = sqrt(r1_i / r2_i)
(r1: A's range in output channel i, r2: B's range in input channel i) gives both the same range
sqrt(r1_i r2_i), so one per-tensor grid no longer wastes its levels on a few wide channels: the
case of depthwise convolutions, whose channels differ by orders of magnitude once BatchNorm is
folded in. Chains of three or more convolutions share their middle layers, so the pairs are
equalized in turns until the scales settle.

Clip(0, hi) (ReLU6: hi = 6) is not scale-equivariant for every input: s * Clip(x / s, 0, hi) =
Clip(x, 0, s * hi), so the bound moves per channel and ONNX Clip takes one scalar bound. It is
exact on the data, though, when the scale respects what the channel does there. A float pass over
the first `samples` calibration inputs (channel_ranges.py) gives m_i, the largest value of A's
output channel i (the Clip's input). A channel with m_i > hi reaches the bound: it keeps s_i = 1.
A channel with m_i <= hi never clips; any s_i >= m_i / hi keeps it below the moved bound, so
neither model clips it and both compute the same values: the CLE scale is clamped to that, and
m_i / s_i is tracked through the turns of a chain (the constraint is on the cumulative scale).
Guarantee: the equalized float model equals the original (to float rounding) on every input
whose channel maxima at those Clips stay within the ones seen in that pass, in particular on
those calibration samples; on an input that drives a never-clipping channel above m_i the
equalized model clips it at s_i * hi (>= m_i) instead of hi: earlier where s_i < 1 (the clamped
channels: exactly at m_i), later where s_i > 1. On other data that is not rare: on
EfficientNet-Lite0 (8 calibration photographs, 8 other evaluation ones) the equalized float model
agrees with the original on only 95% of the evaluation crops (20.3 dB logits SQNR), and a
headroom (bound >= k m_i) does not close it (k = 2: 26.9 dB, k = 4: 31.4 dB; see
examples/effnet_lite/README.md). So these pairs are equalized only when the recipe says
`through_clip: true`; by default they are skipped with that reason. When they are, the report
gives, per pair, how many channels were clamped at m_i / hi and how many left at 1.

Other activations are not equivariant, Clip with a lower bound other than 0 neither, and a tensor
read by more than one node cannot be rescaled for one reader alone; such pairs are left as they
are and listed with the reason. Bias absorption (the recipe's `bias_absorption`: moving part of
A's bias through the activation into B's, from per-channel minima measured in the same pass) is
done on the kept pairs afterwards, where it is exact on the data (bias_absorption.py).

A pair is kept only when it lowers the weight quantization noise of the two layers at the
recipe's weight granularity (relative noise energy of an 8-bit grid, summed over both); with
per-channel weights A's noise cannot change, so the decision rests on B's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.algorithms.bias_absorption import absorb, padding_reason
from qtool.algorithms.channel_ranges import ChannelRanges
from qtool.algorithms.conv_pairs import ConvPair, EqualizedConv
from qtool.model.fold_pad import zero_spatial_pads

_ROUNDS = 20  # pairwise passes over a chain; settles in a few on real networks
_TOLERANCE = 1e-6  # stop when no scale moves by more than this (relative)
_MIN_RANGE = 1e-12  # channels whose weights are all zero are left unscaled
_AT_BOUND = 1e-6  # a channel whose max / bound is within this of 1 counts as clamped

# Per-channel minima and maxima of the named tensors (A's outputs) on calibration data.
RangesSource = Callable[[list[str]], ChannelRanges]


def _group(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def _readers(graph: onnx.GraphProto) -> Counter:
    readers: Counter = Counter(name for node in graph.node for name in node.input)
    readers.update(o.name for o in graph.output)  # a graph output is read from outside
    return readers


def _skip(first: str, second: str, why: str) -> dict:
    return {"first": first, "second": second, "why": why}


def _scalar(name: str, inits: dict[str, onnx.TensorProto]) -> float | None:
    """A one-element constant's value (None when `name` is not a constant)."""
    if name not in inits:
        return None
    value = numpy_helper.to_array(inits[name])
    return float(value.reshape(())) if value.size == 1 else None


def clip_bounds(
    node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]
) -> tuple[float | None, float | None] | None:
    """(lower, upper) of a Clip whose bounds are constants (None: that side unbounded), or None
    when a bound is computed at run time. Inputs (opset >= 11) or attributes (older)."""
    bounds: list[float | None] = [None, None]
    for k, attr in enumerate(("min", "max")):
        if len(node.input) > k + 1 and node.input[k + 1]:
            value = _scalar(node.input[k + 1], inits)
            if value is None:
                return None
            bounds[k] = value
        found = next((a for a in node.attribute if a.name == attr), None)
        if found is not None:
            bounds[k] = float(helper.get_attribute_value(found))
    return bounds[0], bounds[1]


def _through(
    node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], pair: ConvPair
) -> str | None:
    """Let `node` (between A and B) into `pair` when a positive scale passes it; else the reason."""
    if node.op_type == "Pad":
        if pair.pad or zero_spatial_pads(node, 4, inits) is None:
            return "Pad between is not a constant-zero spatial Pad"
        pair.pad = True
        return None
    if pair.activation != "none":
        return f"{node.op_type} after {pair.activation} between"
    if node.op_type == "Relu":
        pair.activation = "Relu"
        return None
    if node.op_type == "Clip":
        bounds = clip_bounds(node, inits)
        if bounds is None:
            return "Clip with bounds computed at run time"
        lower, upper = bounds
        if lower != 0.0:
            return f"Clip with lower bound {lower} is not scale-equivariant (only 0 is)"
        if upper is not None and not upper > 0.0:
            return f"Clip with upper bound {upper}"
        pair.activation, pair.bound = "Clip", upper
        return None
    return f"{node.op_type} between is not scale-equivariant"


def _find_pairs(
    graph: onnx.GraphProto, convs: dict[str, EqualizedConv], only: set[str] | None
) -> tuple[list[ConvPair], list[dict]]:
    """Conv -> (Relu | Clip(0, hi) | nothing) -> (zero Pad) -> Conv pairs that can be rescaled
    exactly (Clip: on the data, see the module docstring), and the near misses with reasons."""
    readers = _readers(graph)
    inits = {init.name: init for init in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    pairs, skipped = [], []
    for name, conv in convs.items():
        if only is not None and name not in only:
            continue
        pair = ConvPair(conv.node, conv.node)
        tensor, nxt, why = conv.node.output[0], None, None
        for _ in range(3):  # at most an activation and a Pad between the two convolutions
            after = consumers.get(tensor, [])
            if len(after) != 1 or readers[tensor] != 1:
                break
            if after[0].op_type == "Conv":
                nxt = after[0]
                break
            middle = after[0]
            if len(middle.output) != 1:
                break
            why = _through(middle, inits, pair)
            if why is not None:
                following = consumers.get(middle.output[0], [])
                if len(following) == 1 and following[0].op_type == "Conv":
                    skipped.append(_skip(name, following[0].name, why))
                break
            tensor = middle.output[0]
        if nxt is None or why is not None:
            continue
        if nxt.input[0] != tensor:
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
        pair.second = nxt
        pairs.append(pair)
    return pairs, skipped


def _output_ranges(conv: EqualizedConv) -> np.ndarray:
    """Max |w| per output channel of a convolution."""
    return np.abs(conv.weight).reshape(conv.weight.shape[0], -1).max(axis=1)


def _input_ranges(conv: EqualizedConv) -> np.ndarray:
    """Max |w| per input channel (depthwise: its one filter per channel)."""
    if conv.depthwise:
        return _output_ranges(conv)
    return np.abs(conv.weight).transpose(1, 0, 2, 3).reshape(conv.weight.shape[1], -1).max(axis=1)


def _scale_output(conv: EqualizedConv, scale: np.ndarray) -> None:
    """Divide output channel i by scale_i (weight and bias)."""
    conv.weight /= scale.reshape(-1, *([1] * (conv.weight.ndim - 1)))
    if conv.bias is not None:
        conv.bias /= scale


def _scale_input(conv: EqualizedConv, scale: np.ndarray) -> None:
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


def _convs(model: onnx.ModelProto) -> dict[str, EqualizedConv]:
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
        convs[node.name] = EqualizedConv(node, weight, bias, _group(node))
    return convs


def equalize(
    model: onnx.ModelProto,
    per_channel: bool,
    only: set[str] | None = None,
    ranges: RangesSource | None = None,
    bias_absorption: bool = False,
    through_clip: bool = False,
) -> dict:
    """Equalize every eligible pair of `model` in place and return the report entry.

    `only`: the nodes that will be quantized (None: every Conv); a pair is equalized only when
    both of its layers are. `per_channel`: the weight granularity the pair is judged at.
    `ranges(tensors)`: per-channel minima and maxima of those tensors on calibration data, for
    the pairs through Clip(0, hi) and for bias absorption; without it those pairs are skipped
    and nothing is absorbed (no exact rewrite is known without data). `bias_absorption`: after
    equalizing, move what the activation allows from A's bias into B's (bias_absorption.py).
    `through_clip`: equalize the pairs through Clip(0, hi) too; they are exact only on inputs
    whose channel maxima stay within the measured ones (module docstring), so by default they
    are skipped with that reason."""
    convs = _convs(model)
    pairs, skipped = _find_pairs(model.graph, convs, only)
    if not through_clip:
        for pair in (p for p in pairs if p.bound is not None):
            why = (
                f"Clip(0, {pair.bound:g}) between: exact only on data like the calibration "
                "samples (through_clip: true to equalize it anyway)"
            )
            skipped.append(_skip(*pair.key, why))
        pairs = [p for p in pairs if p.bound is None]
    bounded = [p for p in pairs if p.bound is not None]
    wanted = {p.first.output[0] for p in bounded}
    if bias_absorption:
        wanted.update(p.first.output[0] for p in pairs if padding_reason(p) is None)
    measured = ChannelRanges()
    if bounded and ranges is None:
        for pair in bounded:
            why = f"Clip(0, {pair.bound:g}) between: needs calibration data to bound the scales"
            skipped.append(_skip(*pair.key, why))
        pairs = [p for p in pairs if p.bound is None]
    elif wanted and ranges is not None:
        measured = ranges(sorted(wanted))
    limits = {
        p.key: np.asarray(measured.maxima[p.first.output[0]], np.float64)
        for p in pairs
        if p.bound is not None
    }
    originals = {
        name: (c.weight.copy(), None if c.bias is None else c.bias.copy())
        for name, c in convs.items()
    }
    before = {
        p.key: (
            _output_ranges(convs[p.first.name]).copy(),
            _input_ranges(convs[p.second.name]).copy(),
            relative_noise(convs[p.first.name].weight, per_channel)
            + relative_noise(convs[p.second.name].weight, per_channel),
        )
        for p in pairs
    }
    scales = _rebalance(convs, pairs, limits)
    kept, applied = set(), []
    for pair in pairs:
        key = pair.key
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
        if pair.pad:
            entry["zero_pad_between"] = True
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
        chosen = {(e["first"], e["second"]) for e in applied}
        scales = _rebalance(convs, [p for p in pairs if p.key in chosen], limits)
    for entry in applied:
        pair = next(p for p in pairs if p.key == (entry["first"], entry["second"]))
        if pair.bound is not None:
            entry.update(_bound_report(pair, limits[pair.key], scales[pair.key], measured.samples))
        if bias_absorption:
            entry["bias_absorption"] = _absorb(pair, convs, measured, scales[pair.key])
    _write_back(model, convs, kept)
    entry = {
        "per_channel_weights": per_channel,
        "bias_absorption": bias_absorption,
        "through_clip": through_clip,
        "pairs": applied,
        "skipped": skipped,
    }
    through = sum(1 for e in applied if "clip_bound" in e)
    if through:
        entry["warning"] = THROUGH_CLIP_WARNING.format(pairs=through)
    return entry


# What a user who turned through_clip on must know when reading evaluate's numbers.
THROUGH_CLIP_WARNING = (
    "cross-layer equalization rescaled {pairs} pair(s) through Clip: the float model written "
    "(model.fp32.onnx, which qtool evaluate compares against) equals yours only on data like "
    "the calibration samples; evaluate against your original float model too"
)


def _absorb(
    pair: ConvPair, convs: dict[str, EqualizedConv], measured: ChannelRanges, scale: np.ndarray
) -> dict:
    """One kept pair's bias absorption, or why there was none (report.json)."""
    tensor = pair.first.output[0]
    if tensor not in measured.minima:
        why = padding_reason(pair) or "needs calibration data (per-channel minima)"
        return {"skipped": why}
    entry = absorb(
        pair,
        convs[pair.first.name],
        convs[pair.second.name],
        np.asarray(measured.minima[tensor], np.float64),
        np.asarray(measured.maxima[tensor], np.float64),
        scale,
    )
    if "skipped" not in entry:
        entry["samples"] = measured.samples
    return entry


def _bound_report(pair: ConvPair, maxima: np.ndarray, scale: np.ndarray, samples: int) -> dict:
    """What the Clip's data constraint did to one pair's channels (report.json)."""
    assert pair.bound is not None
    reaching = maxima > pair.bound
    at_bound = ~reaching & (maxima / scale >= pair.bound * (1.0 - _AT_BOUND)) & (scale != 1.0)
    return {
        "clip_bound": pair.bound,
        "channels": int(maxima.size),
        "channels_left_unscaled": int(reaching.sum()),  # reach the bound on calibration data
        "channels_clamped": int(at_bound.sum()),  # scale raised to max / bound
        "maxima_samples": samples,
    }


def _rebalance(
    convs: dict[str, EqualizedConv],
    pairs: list[ConvPair],
    limits: dict[tuple[str, str], np.ndarray],
) -> dict[tuple[str, str], np.ndarray]:
    """Equalize the pairs in turns until no scale moves (a middle layer belongs to two pairs);
    returns, per pair, the cumulative scale of each of A's output channels.

    A Clip pair's channel that reaches the bound on the data (max > bound) keeps scale 1; any
    other keeps max / cumulative scale <= bound (module docstring)."""
    total = {p.key: np.ones(convs[p.first.name].weight.shape[0]) for p in pairs}
    for _ in range(_ROUNDS):
        moved = 0.0
        for pair in pairs:
            first, second = convs[pair.first.name], convs[pair.second.name]
            r1, r2 = _output_ranges(first), _input_ranges(second)
            live = (r1 > _MIN_RANGE) & (r2 > _MIN_RANGE)
            scale = np.ones_like(r1)
            scale[live] = np.sqrt(r1[live] / r2[live])
            cumulative = total[pair.key]
            if pair.key in limits:
                assert pair.bound is not None
                maxima = limits[pair.key]
                reaching = maxima > pair.bound
                # the cumulative scale after this step must stay >= max / bound
                floor = np.maximum(maxima, 0.0) / pair.bound / cumulative
                scale = np.where(reaching, 1.0, np.maximum(scale, floor))
            total[pair.key] = cumulative * scale
            _scale_output(first, scale)
            _scale_input(second, scale)
            moved = max(moved, float(np.max(np.abs(scale - 1.0))) if scale.size else 0.0)
        if moved < _TOLERANCE:
            break
    return total


def _spread(r1: np.ndarray, r2: np.ndarray) -> float:
    """Widest over narrowest channel range, the worse of the two layers (1 = all equal)."""

    def one(r: np.ndarray) -> float:
        live = r[r > _MIN_RANGE]
        return float(live.max() / live.min()) if live.size else 1.0

    return max(one(r1), one(r2))


def _write_back(model: onnx.ModelProto, convs: dict[str, EqualizedConv], names: set[str]) -> None:
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
