"""AdaRound on the prepared ONNX model: which layers it rounds, their inputs from the float model
on calibration data, and the int8 weights the writer then stores (qtool/algorithms/adaround.py
holds the backend-free math).

Inputs: every layer reads the float model's own input to it (the paper's simplest variant),
quantized with the activation range the writer uses, so the rounding of each layer is learned
independently and the result does not depend on the order layers are processed in. One ONNX
Runtime pass over the first `samples` calibration samples feeds every layer's running sums. The
quantized model's own inputs (the paper's asymmetric variant) were tried and measured worse when
every layer learns at once: each layer then also corrects the error of the layers before it,
which those layers are correcting themselves (digits 46.3 -> 42.2 dB, ocr_cls 22.1 -> 17.8 dB);
doing it right means one pass of the quantized model per layer, in order.

The learned values stay on the grid the weight format chose for the deployment CPU (same scale,
same zero point, same range: 7-bit values stay within +-63); where that CPU saturates 16-bit pair
sums (AVX2 without VNNI) the learned roundings are lowered again, least confident first, until
every aligned pair fits as `choose_weight` guaranteed, and the report counts how many. The
rounding is learned on three of every four calibration batches; a layer whose output error is not
lower than with the format's own rounding on the held-out batches and on all calibration rows
keeps that rounding, and the report says so.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from qtool.algorithms.adaround import (
    Geometry,
    Grams,
    Rounding,
    confidence,
    fake_quantize,
    from_groups,
    layer_rows,
    learn_rounding,
    merged,
    output_mse,
    single_thread,
    toward_zero,
    weight_groups,
)
from qtool.algorithms.bias_correction import output_error
from qtool.algorithms.spec import AdaRoundParams
from qtool.calibration.collect import session_with_outputs
from qtool.errors import CalibrationError, DataError, RecipeError
from qtool.ort.cpu import CpuFeatures
from qtool.ort.sessions import ort_reason
from qtool.phases import phase
from qtool.plan.layout import Layout, WeightSlot
from qtool.progress import bars
from qtool.write.int4 import BlockwiseWeight
from qtool.write.params import ActivationParams, WeightParams
from qtool.write.weight_format import FORMAT_LIMITS, keeps_pair_limit, restore_pair_limit

INPUT_DESCRIPTION = (
    "the float model's input to each layer on the calibration samples, quantized with the "
    "range the writer uses; the objective is the layer's own output (before any activation)"
)


# Output positions (pixels, sequence positions) per calibration sample whose rows enter a layer's
# sums: 256 samples x 64 = 16k rows per layer, many times the K of the layers we round, and
# every position of digits' 8 x 8 maps; a MobileNet's 24 x 96 first map is sampled.
POSITIONS_PER_SAMPLE = 64
# Calibration batches of BATCH samples; every HOLD_OUT-th batch is held out: the rounding is
# learned on the others and kept only if it also lowers the error on these. A layer with fewer
# rows than weights per output (squeeze-excite convs: one row per sample) can fit its training
# rows almost exactly and still do worse on new inputs.
BATCH = 8
HOLD_OUT = 4


@dataclass
class LayerSums:
    """A layer's sums over the rows it learns on (`fit`) and over the held-out rows."""

    fit: Grams
    held_out: Grams

    @property
    def everything(self) -> Grams:
        return merged(self.fit, self.held_out)


@dataclass(frozen=True)
class Target:
    """A layer AdaRound rounds: its node, the float activation it reads and its weight."""

    node: str
    op_type: str
    input: str
    weight: str
    geometry: Geometry


def _ints(node: onnx.NodeProto, name: str) -> tuple[int, ...] | None:
    for attr in node.attribute:
        if attr.name == name:
            return tuple(attr.ints)
    return None


def _attr(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def _geometry(node: onnx.NodeProto, dims: list[int]) -> Geometry | str:
    """The layer as rows x grouped weight, or why AdaRound leaves it alone."""
    if node.op_type == "MatMul":
        if len(dims) != 2:
            return f"MatMul weight of rank {len(dims)} (batched): not supported"
        return Geometry("kn")
    if node.op_type == "Gemm":
        if _attr(node, "transA", 0):
            return "Gemm with transA=1: not supported"
        layout = "nk" if _attr(node, "transB", 0) else "kn"
        return Geometry(layout, alpha=float(_attr(node, "alpha", 1.0)))
    if node.op_type != "Conv":
        return f"{node.op_type}: not supported"
    spatial = len(dims) - 2
    if spatial not in (1, 2):
        return f"Conv with {spatial} spatial dimensions: only 1-D and 2-D"
    auto_pad = _attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad not in ("NOTSET", "VALID"):
        return f"Conv with auto_pad {auto_pad}: not supported"
    kernel = tuple(dims[2:])
    return Geometry(
        "conv",
        groups=int(_attr(node, "group", 1)),
        kernel=kernel,
        strides=_ints(node, "strides") or (1,) * spatial,
        pads=(_ints(node, "pads") if auto_pad == "NOTSET" else None) or (0,) * (2 * spatial),
        dilations=_ints(node, "dilations") or (1,) * spatial,
    )


def adaround_targets(
    model: onnx.ModelProto,
    layout: Layout,
    weights: Mapping[str, WeightParams | BlockwiseWeight],
    where: str,
) -> tuple[list[Target], dict[str, str]]:
    """The layers AdaRound rounds, and those it leaves with the reason (for the report).

    Raises RecipeError for a node whose weights it cannot round at all (4-bit, blocked or
    weight-only): turning the algorithm on must never silently do nothing to them.
    """
    nodes = {node.name: node for node in model.graph.node}
    dims = {init.name: list(init.dims) for init in model.graph.initializer}
    planned = [n for n in layout.plan.quantized() if n.weight is not None]
    readers = Counter(n.weight.tensor for n in planned if n.weight is not None)
    targets, skipped = [], {}
    for plan in planned:
        weight = plan.weight
        assert weight is not None
        if plan.op_type == "Gather":
            skipped[plan.name] = "embedding table: no layer output to reconstruct"
            continue
        if plan.precision == "fp8":
            raise RecipeError(
                f"{where}: node '{plan.name}' has fp8 weights (amax / 448 per channel); "
                "adaround rounds int8 weights only (drop adaround, or give the node precision "
                "int8)"
            )
        if weight.bits != 8 or weight.block_size is not None:
            raise RecipeError(
                f"{where}: node '{plan.name}' has {weight.bits}-bit {weight.granularity} "
                "weights; adaround rounds int8 per-channel or per-tensor weights only (give the "
                "node precision int8 in quantization.overrides, or drop adaround)"
            )
        if plan.activations != "int8" or not isinstance(weights.get(weight.tensor), WeightParams):
            raise RecipeError(
                f"{where}: node '{plan.name}' is weight-only (activations: float); adaround "
                "rounds the weights of layers with int8 activations only"
            )
        if readers[weight.tensor] > 1:
            skipped[plan.name] = (
                f"weight '{weight.tensor}' is read by {readers[weight.tensor]} nodes: one "
                "rounding cannot fit each layer's inputs"
            )
            continue
        node = nodes[plan.name]
        geometry = _geometry(node, dims[weight.tensor])
        if isinstance(geometry, str):
            skipped[plan.name] = geometry
            continue
        targets.append(Target(plan.name, node.op_type, node.input[0], weight.tensor, geometry))
    return targets, skipped


def _rows_key(target: Target) -> tuple:
    """Layers reading the same tensor the same way share their sums (Q, K and V projections)."""
    g = target.geometry
    if g.weight_layout != "conv":
        return (target.input, "linear", g.alpha)
    return (target.input, g.groups, g.kernel, g.strides, g.pads, g.dilations)


def _quant_bounds(params: ActivationParams) -> tuple[int, int]:
    return (-128, 127) if params.zero_point.dtype == np.int8 else (0, 255)


def collect_grams(
    model: onnx.ModelProto,
    targets: list[Target],
    activations: Mapping[str, ActivationParams],
    batches: Iterable[Mapping[str, np.ndarray]],
    seed: int = 0,
) -> dict[str, LayerSums]:
    """Each target's sums over the float model's inputs to it, in one pass over `batches`
    (at most POSITIONS_PER_SAMPLE positions per sample, drawn with `seed`; every HOLD_OUT-th
    batch into the held-out sums)."""
    graph_inputs = {i.name for i in model.graph.input}
    for target in targets:
        if target.input not in activations:
            raise CalibrationError(
                f"adaround: the input '{target.input}' of node '{target.node}' is not quantized"
            )
    outputs = sorted({t.input for t in targets} - graph_inputs)
    session = session_with_outputs(model, outputs, optimize=False)
    shared: dict[tuple, LayerSums] = {}
    by_node = {
        t.node: shared.setdefault(_rows_key(t), LayerSums(Grams(), Grams())) for t in targets
    }
    first = {}
    for target in targets:  # one update per shared sum
        first.setdefault(_rows_key(target), target)
    generator = torch.Generator().manual_seed(seed)
    for index, feed in enumerate(batches):
        try:
            values = dict(zip(outputs, session.run(outputs, dict(feed)), strict=True))
        except Exception as exc:  # ORT raises private types for bad feeds
            raise DataError(f"adaround: batch {index} failed: {ort_reason(exc)}") from None
        values.update({k: v for k, v in feed.items() if k in graph_inputs})
        for key, target in first.items():
            x = torch.from_numpy(np.ascontiguousarray(values[target.input], np.float32))
            params = activations[target.input]
            low, high = _quant_bounds(params)
            quantize = functools.partial(
                fake_quantize,
                scale=float(params.scale),
                zero_point=int(params.zero_point),
                low=low,
                high=high,
            )
            rows = layer_rows(x, target.geometry, quantize, POSITIONS_PER_SAMPLE, generator)
            sums = shared[key]
            (sums.held_out if index % HOLD_OUT == HOLD_OUT - 1 else sums.fit).update(*rows)
    for target in targets:
        if by_node[target.node].fit.rows == 0:
            raise CalibrationError("adaround needs at least one calibration batch")
    return by_node


def held_out(batches: Iterable[Mapping[str, np.ndarray]]) -> Iterator[Mapping[str, np.ndarray]]:
    """The batches the rounding was not learned on (every HOLD_OUT-th)."""
    return (b for index, b in enumerate(batches) if index % HOLD_OUT == HOLD_OUT - 1)


def _broadcast_scale(params: WeightParams, shape: tuple[int, ...]) -> np.ndarray:
    scale = np.asarray(params.scale, np.float32)
    if params.axis is None:
        return np.full(shape, scale, np.float32)
    view = [1] * len(shape)
    view[params.axis] = -1
    return np.broadcast_to(scale.reshape(view), shape).astype(np.float32)


def _zero(params: WeightParams, shape: tuple[int, ...]) -> np.ndarray:
    zero = params.zero_point_array().astype(np.int32)
    if params.axis is None or zero.ndim == 0:
        return zero
    view = [1] * len(shape)
    view[params.axis] = -1
    return zero.reshape(view)


@dataclass
class LayerResult:
    """What AdaRound did to one layer (a report entry) and the values it keeps."""

    values: np.ndarray  # stored integers, the weight's shape and dtype
    entry: dict


def round_layer(
    target: Target,
    weight: np.ndarray,
    params: WeightParams,
    fmt: str,
    sums: LayerSums,
    iterations: int,
    pair_slot: WeightSlot | None,
    on_step: Callable[[int], None] | None = None,
) -> LayerResult:
    """Learn the layer's rounding on its format's grid from the fit rows; keep it only if the
    output error is lower than with the format's own values both on the held-out rows and on
    all calibration rows. `pair_slot`: the WeightSlot whose aligned pairs must stay within the
    16-bit limit, or None."""
    shape = weight.shape
    zero = _zero(params, shape)
    nearest = params.values.astype(np.int32) - zero
    g = target.geometry
    problem = Rounding(
        weight_groups(weight.astype(np.float32), g),
        weight_groups(_broadcast_scale(params, shape), g),
        weight_groups(nearest, g),
        FORMAT_LIMITS[fmt],
    )
    learned, soft = learn_rounding(problem, sums.fit, iterations, on_step)
    values = from_groups(learned, shape, g)
    moved = None
    if pair_slot is not None:
        fallback = from_groups(toward_zero(problem), shape, g)
        priority = from_groups(confidence(soft), shape, g)
        values, moved = restore_pair_limit(values, fallback, priority, pair_slot)
    scale = problem.scale.astype(np.float64)
    candidates = {"nearest": problem.nearest * scale, "adaround": weight_groups(values, g) * scale}
    everything = sums.everything
    errors = {k: output_mse(everything, problem.weight, v) for k, v in candidates.items()}
    held = sums.held_out
    held_errors = (
        {k: output_mse(held, problem.weight, v) for k, v in candidates.items()}
        if held.rows
        else {"nearest": None, "adaround": None}
    )
    better_held = held.rows == 0 or held_errors["adaround"] < held_errors["nearest"]
    kept = better_held and errors["adaround"] < errors["nearest"]
    changed = int(np.count_nonzero(values != nearest))
    reason = None
    if not kept:
        where = "the held-out calibration rows" if not better_held else "the calibration data"
        reason = f"AdaRound did not lower the layer's output error on {where}: nearest kept"
    entry = {
        "weight": target.weight,
        "format": fmt,
        "rows": everything.rows,
        "held_out_rows": held.rows,
        "output_mse_nearest": errors["nearest"],
        "output_mse_adaround": errors["adaround"],
        "held_out_mse_nearest": held_errors["nearest"],
        "held_out_mse_adaround": held_errors["adaround"],
        "kept": "adaround" if kept else "nearest",
        "weights_changed": changed if kept else 0,
        "weights_learned": int(np.count_nonzero(~np.isnan(soft))),
        "pair_limit_lowered": moved,
        "reason": reason,
    }
    stored = (values + zero).astype(params.values.dtype) if kept else params.values
    return LayerResult(stored, entry)


def _progress(enabled: bool):
    return bars(
        enabled,
        TextColumn("AdaRound {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        line="AdaRound {description}: {count}",
    )


def apply_adaround(
    model: onnx.ModelProto,
    layout: Layout,
    activations: Mapping[str, ActivationParams],
    weights: dict[str, WeightParams | BlockwiseWeight],
    cpu: CpuFeatures,
    saturation: str,
    batches: Callable[[], Iterable[Mapping[str, np.ndarray]]],
    params: AdaRoundParams,
    seed: int,
    progress: bool,
    where: str,
    write: Callable[[Mapping[str, WeightParams | BlockwiseWeight]], onnx.ModelProto],
) -> tuple[dict[str, WeightParams | BlockwiseWeight], dict]:
    """`weights` with AdaRound's int8 values where they lower each layer's output error, and
    the report entry (per node: both errors, which rounding was kept, what changed).

    `write` turns weights into the QDQ model as the pipeline does: the rounded model is kept only
    if its outputs are closer to the float model's on the held-out calibration batches than the
    model with the format's rounding (QDQ semantics); layer errors that each fall can still add
    up to a worse model, and then nothing is changed and the report says so."""
    targets, skipped = adaround_targets(model, layout, weights, where)
    iterations = params.iterations
    initializers = {init.name: init for init in model.graph.initializer}
    plans = layout.plan.weight_plans()
    with single_thread(seed), phase("AdaRound: reading each layer's inputs"):
        grams = collect_grams(model, targets, activations, batches(), seed) if targets else {}
    out = dict(weights)
    nodes = {}
    with single_thread(seed), _progress(progress) as bar:
        layers = bar.add_task(f"{len(targets)} layers", total=len(targets))
        for target in targets:
            task = bar.add_task(target.node, total=iterations)
            weight_params = weights[target.weight]
            assert isinstance(weight_params, WeightParams)
            plan = plans[target.weight]
            slot = layout.weights[target.weight]
            pair_slot = slot if keeps_pair_limit(slot, plan, cpu, saturation) else None
            result = round_layer(
                target,
                numpy_helper.to_array(initializers[target.weight]),
                weight_params,
                plan.format,
                grams[target.node],
                iterations,
                pair_slot,
                lambda steps, task=task: bar.advance(task, steps),
            )
            out[target.weight] = replace(weight_params, values=result.values)
            nodes[target.node] = result.entry
            bar.remove_task(task)
            bar.advance(layers)
    entry = {
        "applied": any(n["kept"] == "adaround" for n in nodes.values()),
        "parameters": dataclasses.asdict(params),
        "input": INPUT_DESCRIPTION,
        "output_mse_before": None,
        "output_mse_after": None,
        "reason": None,
        "nodes": nodes,
        "skipped": skipped,
    }
    if not entry["applied"]:
        entry["reason"] = "no layer's output error fell: nothing changed"
        return out, entry
    with phase("AdaRound: comparing the model's outputs"):
        before = output_error(model, write(weights), held_out(batches()))
        after = output_error(model, write(out), held_out(batches()))
    entry["output_mse_before"], entry["output_mse_after"] = before, after
    if after < before:
        return out, entry
    entry["applied"] = False
    entry["reason"] = (
        "the rounded layers together raised the model's output error on the held-out "
        "calibration batches: not applied"
    )
    for node in nodes.values():
        if node["kept"] == "adaround":
            node["kept"], node["weights_changed"] = "nearest", 0
            node["reason"] = "AdaRound not applied to the model (see the reason above)"
    return dict(weights), entry
