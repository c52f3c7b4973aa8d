"""SmoothQuant's scoring pass: each smoothing group's quantized twin, run beside the float model
on the tuning rows, measured at its block's output and at its own MatMuls' outputs.

For one alpha, the probe model is the float model plus, for every group, a copy of the group's
block (qtool/algorithms/smoothquant_blocks.py; without a block, only the group's MatMuls) whose
MatMuls read X / s through the QuantizeLinear -> DequantizeLinear pair of the range the writer
will use (derived from the calibration pass's per-channel min/max, so rows outside it clip, as
they will when deployed) and the weights diag(s) W fake-quantized as int8 per channel (plain
int8, not the deployment CPU's format, so the choice is the same on every machine). Every other
node of the copy is float and reads the float model's tensors from outside the block, so the
error measured is the group's own, not the sum of the groups before it. One ONNX Runtime pass of
the probe over the tuning rows scores every group at that alpha; QDQ semantics
(ORT_DISABLE_ALL), as the rest of qtool's checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.algorithms.smoothquant_blocks import Block
from qtool.calibration.collect import session_with_outputs
from qtool.errors import DataError
from qtool.metrics.signal import SignalQuality
from qtool.ort.sessions import ort_reason
from qtool.write.params import ActivationParams

__all__ = ["Twin", "GroupScore", "probe_model", "score_groups", "shapes_on"]


@dataclass(frozen=True)
class Twin:
    """One group at one alpha: its input X, its MatMul/Gemm nodes and the fake-quantized weight
    each reads (the initializer's own layout), 1 / s, and the quantization of X / s."""

    input: str
    nodes: tuple[str, ...]
    weights: Mapping[str, np.ndarray]  # node -> weight
    inverse: np.ndarray
    activation: ActivationParams


@dataclass
class GroupScore:
    """A group's errors at one alpha on the tuning rows: noise over signal power at its block's
    output (None without a block) and at each of its MatMuls' outputs, and over all of those."""

    block: float | None
    layers: dict[str, float] = field(default_factory=dict)
    layer_total: float = 0.0


def _relative(quality: SignalQuality) -> float:
    """Noise over signal power; the plain squared error where the float output is all zero."""
    return quality.noise / quality.signal if quality.signal > 0 else quality.noise


def probe_model(
    model: onnx.ModelProto, twins: list[Twin], blocks: Mapping[str, Block]
) -> tuple[onnx.ModelProto, list[tuple[str, str | None, str, str]]]:
    """The float model with every twin added, and what to compare: (group input, node or None
    for the block output, float tensor, twin tensor)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    graph = probe.graph
    nodes = {node.name: node for node in model.graph.node}
    typed = {vi.name: vi for vi in [*graph.value_info, *graph.input, *graph.output]}
    measures: list[tuple[str, str | None, str, str]] = []
    for index, twin in enumerate(twins):
        suffix = f"/smoothquant_probe_{index}"
        block = blocks.get(twin.input)
        names = block.nodes if block is not None else twin.nodes
        rename: dict[str, str] = {}
        x = twin.input
        dequantized = f"{x}{suffix}/dequantized"
        params = twin.activation
        graph.initializer.extend(
            [
                numpy_helper.from_array(twin.inverse.astype(np.float32), f"{x}{suffix}/inverse"),
                numpy_helper.from_array(np.asarray(params.scale, np.float32), f"{x}{suffix}/scale"),
                numpy_helper.from_array(np.asarray(params.zero_point), f"{x}{suffix}/zero_point"),
            ]
        )
        graph.node.extend(
            [
                helper.make_node(
                    "Mul",
                    [x, f"{x}{suffix}/inverse"],
                    [f"{x}{suffix}/smoothed"],
                    f"{x}{suffix}/Mul",
                ),
                helper.make_node(
                    "QuantizeLinear",
                    [f"{x}{suffix}/smoothed", f"{x}{suffix}/scale", f"{x}{suffix}/zero_point"],
                    [f"{x}{suffix}/quantized"],
                    f"{x}{suffix}/QuantizeLinear",
                ),
                helper.make_node(
                    "DequantizeLinear",
                    [f"{x}{suffix}/quantized", f"{x}{suffix}/scale", f"{x}{suffix}/zero_point"],
                    [dequantized],
                    f"{x}{suffix}/DequantizeLinear",
                ),
            ]
        )
        for name in names:
            original = nodes[name]
            copy = onnx.NodeProto()
            copy.CopyFrom(original)
            copy.name = original.name + suffix
            for position, tensor in enumerate(copy.input):
                if name in twin.weights and position == 0:
                    copy.input[0] = dequantized
                elif name in twin.weights and position == 1:
                    weight = f"{copy.input[1]}{suffix}/fake_quantized"
                    graph.initializer.append(numpy_helper.from_array(twin.weights[name], weight))
                    copy.input[1] = weight
                elif tensor in rename:
                    copy.input[position] = rename[tensor]
            for position, tensor in enumerate(copy.output):
                if tensor:
                    rename[tensor] = copy.output[position] = tensor + suffix
                    if tensor in typed:
                        value = onnx.ValueInfoProto()
                        value.CopyFrom(typed[tensor])
                        value.name = rename[tensor]
                        graph.value_info.append(value)
            graph.node.append(copy)
        for name in twin.nodes:
            out = nodes[name].output[0]
            measures.append((x, name, out, rename[out]))
        if block is not None:
            measures.append((x, None, block.output, rename[block.output]))
    return probe, measures


def score_groups(
    model: onnx.ModelProto,
    twins: list[Twin],
    blocks: Mapping[str, Block],
    batches: Callable[[], Iterable[Mapping[str, np.ndarray]]],
) -> dict[str, GroupScore]:
    """Every twin's errors on the tuning rows `batches()`, from one pass of its probe model."""
    if not twins:  # nothing to score (a run of ORT asked for no outputs would return them all)
        return {}
    probe, measures = probe_model(model, twins, blocks)
    tensors = list(dict.fromkeys(t for m in measures for t in m[2:]))
    session = session_with_outputs(probe, tensors, optimize=False)
    del probe
    qualities = [SignalQuality() for _ in measures]
    for index, feed in enumerate(batches()):
        try:
            values = dict(zip(tensors, session.run(tensors, dict(feed)), strict=True))
        except Exception as exc:  # ORT raises private types for bad feeds
            reason = ort_reason(exc)
            raise DataError(f"smoothquant: tuning batch {index} failed: {reason}") from None
        for quality, (_, _, reference, test) in zip(qualities, measures, strict=True):
            quality.update(values[reference], values[test])
    if not qualities or qualities[0].rows == 0:
        raise DataError("smoothquant: no tuning rows to score the smoothing factors on")
    scores = {twin.input: GroupScore(None) for twin in twins}
    totals = {twin.input: SignalQuality() for twin in twins}
    for quality, (group, node, _, _) in zip(qualities, measures, strict=True):
        if node is None:
            scores[group].block = _relative(quality)
        else:
            scores[group].layers[node] = _relative(quality)
            totals[group].merge(quality)
    for group, total in totals.items():
        scores[group].layer_total = _relative(total)
    return scores


def shapes_on(
    model: onnx.ModelProto,
    tensors: list[str],
    batches: Callable[[], Iterable[Mapping[str, np.ndarray]]],
) -> dict[str, tuple[int, ...]]:
    """The shapes of `tensors` in one run of `model` on the first of `batches()`."""
    feed = next(iter(batches()), None)
    if feed is None:
        raise DataError("smoothquant: no tuning rows to score the smoothing factors on")
    session = session_with_outputs(model, tensors, optimize=False)
    try:
        values = session.run(tensors, dict(feed))
    except Exception as exc:  # ORT raises private types for bad feeds
        raise DataError(f"smoothquant: tuning batch 0 failed: {ort_reason(exc)}") from None
    return {name: tuple(np.shape(value)) for name, value in zip(tensors, values, strict=True)}
