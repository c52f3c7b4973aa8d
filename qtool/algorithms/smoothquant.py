"""SmoothQuant (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models"): move the outlier channels of a MatMul/Gemm input into
its weight, where per-channel scales absorb them.

A layer X W with a few input channels far larger than the rest wastes the per-tensor activation
grid on them. For s > 0 per input channel, (X / s) (diag(s) W) = X W, so the float function is
unchanged while the input's channels flatten and the weight rows grow instead. With
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (W_j: row j of W [K, N], over every weight that
reads X), alpha trades activation against weight resolution; alpha 0 means no smoothing.

Where 1/s goes:
- into the LayerNormalization that produces X (its scale and bias divided by s), when the
  smoothed MatMuls are its only readers: free at run time;
- otherwise into an explicit Mul(X, 1/s) in front of the smoothed MatMuls, read by them alone
  (other readers of X keep X). In post-LN transformers (BERT, MiniLM) every LayerNorm output also
  feeds the residual Add, so every smoothed input there gets a Mul. The Mul sits before the
  QuantizeLinear, outside ORT's DQ -> MatMul -> Q fusion (the verify stage records that every
  quantized MatMul still fuses); it costs one float element-wise op per smoothed input.

Alpha is searched per layer input (all of its MatMuls together, one s for Q, K and V) on rows
of X sampled in the calibration pass: each candidate's output error of the quantized layer
(uint8 per-tensor activations with the range the writer will use, int8 per-channel symmetric
weights) against the float layer, and the smallest error wins. A layer where no alpha beats no
smoothing stays unsmoothed, and the report says so. The weights are simulated in plain int8,
not in the deployment CPU's saturation-safe format, so the choice is the same on every machine.

Ranges: the calibration pass runs on the unsmoothed model, and the smoothed input's min-max
range is derived exactly from its per-channel min/max (qtool/calibration/channels.py): for an
explicit Mul the smoothed values are float32(x * inv_j), monotone in x, so their extremes are
float32(min_j * inv_j) and float32(max_j * inv_j). Histograms cannot be transformed that way,
so SmoothQuant requires `calibration.method: minmax` (the method its paper uses, and the one
that suits a smoothed input, whose outliers are gone). GPTQ Hessians transform exactly:
XᵀX of X / s is diag(1/s) XᵀX diag(1/s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.algorithms.spec import SMOOTHQUANT_ALPHAS, SmoothQuantParams
from qtool.calibration.channels import ChannelStats
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.observers import TensorStats
from qtool.calibration.requests import StatisticRequests
from qtool.errors import CalibrationError, RecipeError
from qtool.metrics.signal import SignalQuality, db_from_noise_ratio
from qtool.plan.layout import Layout, slot_key
from qtool.write.params import activation_params, quantize_weight

__all__ = [
    "Member",
    "SmoothGroup",
    "Choice",
    "smoothing_groups",
    "check_method",
    "requests",
    "search_alpha",
    "smooth_model",
    "apply_smoothquant",
]

_WHERE = "quantization.algorithms.smoothquant"
_MIN_SCALE = 1e-5  # the reference implementation's clamp on s


@dataclass(frozen=True)
class Member:
    """One MatMul/Gemm reading the smoothed input: its constant weight, and how it is stored.

    `transposed`: a Gemm transB weight [N, K] (rows of W are its columns). `per_channel`: int8
    scales per output channel (else one per tensor), as the Plan says.
    """

    node: str
    weight: str
    transposed: bool
    per_channel: bool


@dataclass(frozen=True)
class SmoothGroup:
    """The MatMuls/Gemms that read one input X, smoothed with one s; `layer_norm` is the
    LayerNormalization to fold 1/s into, or None for an explicit Mul."""

    input: str
    members: tuple[Member, ...]
    layer_norm: str | None

    @property
    def nodes(self) -> list[str]:
        return [m.node for m in self.members]


@dataclass
class Choice:
    """The alpha chosen for one group, its factors, and the errors behind the choice."""

    alpha: float
    scale: np.ndarray  # s, float32 [K] (ones when alpha is 0)
    errors: dict[float, float]  # alpha -> relative output error (sum |Y - Yq|^2 / sum |Y|^2)
    node_errors: dict[float, dict[str, float]]  # alpha -> node -> relative error
    reason: str

    @property
    def applied(self) -> bool:
        return self.alpha > 0.0

    @property
    def inverse(self) -> np.ndarray:
        return (np.float32(1.0) / self.scale).astype(np.float32)


def _attribute(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def smoothing_groups(model: onnx.ModelProto, layout: Layout) -> list[SmoothGroup]:
    """Every float input X read by at least one smoothable MatMul/Gemm, in graph order.

    Smoothable: planned int8 with int8 activations and an 8-bit per-channel or per-tensor
    weight that is a 2-D float initializer read by that node alone (scaling a shared weight's
    rows would change its other readers), X its first input (Gemm: transA = 0).
    """
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                readers.setdefault(name, []).append(node)
    producer = {out: node for node in graph.node for out in node.output}
    outputs = {o.name for o in graph.output}
    members: dict[str, list[Member]] = {}
    for node in graph.node:
        if node.op_type not in ("MatMul", "Gemm") or node.name not in layout.plan:
            continue
        plan = layout.plan[node.name]
        weight_plan = plan.weight
        if plan.precision != "int8" or plan.activations != "int8" or weight_plan is None:
            continue
        if weight_plan.bits != 8 or weight_plan.granularity == "block":
            continue
        x, w = node.input[0], node.input[1]
        init = initializers.get(w)
        if init is None or init.data_type != onnx.TensorProto.FLOAT or len(init.dims) != 2:
            continue
        if x in initializers or len(readers.get(w, [])) != 1 or w in outputs:
            continue
        transposed = False
        if node.op_type == "Gemm":
            if _attribute(node, "transA", 0) != 0:
                continue
            transposed = bool(_attribute(node, "transB", 0))
        per_channel = weight_plan.granularity == "per-channel"
        members.setdefault(x, []).append(Member(node.name, w, transposed, per_channel))
    groups = []
    for x, group in members.items():
        names = {m.node for m in group}
        only_readers = all(r.name in names for r in readers.get(x, [])) and x not in outputs
        layer_norm = None
        source = producer.get(x)
        if only_readers and source is not None and _foldable_layer_norm(source, graph, readers):
            layer_norm = source.name
        groups.append(SmoothGroup(x, tuple(group), layer_norm))
    return groups


def _foldable_layer_norm(
    node: onnx.NodeProto, graph: onnx.GraphProto, readers: dict[str, list[onnx.NodeProto]]
) -> bool:
    """A LayerNormalization over the last axis whose 1-D scale and bias are its own constants."""
    if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx"):
        return False
    if _attribute(node, "axis", -1) != -1:
        return False
    initializers = {init.name: init for init in graph.initializer}
    params = [name for name in node.input[1:3] if name]
    return all(
        name in initializers
        and len(initializers[name].dims) == 1
        and initializers[name].data_type == onnx.TensorProto.FLOAT
        and len(readers.get(name, [])) == 1
        for name in params
    )


def check_method(method: str, where: str) -> None:
    """Refuse what the one-pass range derivation cannot serve (see the module docstring)."""
    if method != "minmax":
        raise RecipeError(
            f"{where}: {_WHERE}: needs calibration.method minmax, got {method!r} (the smoothed "
            "inputs' ranges are derived exactly from per-channel min/max; a histogram of X / s "
            "cannot be derived from X's)"
        )


def requests(
    model: onnx.ModelProto, layout: Layout, params: SmoothQuantParams
) -> StatisticRequests:
    """Per-channel statistics of every input SmoothQuant may smooth, for the calibration pass."""
    groups = smoothing_groups(model, layout)
    return StatisticRequests(
        channels=tuple((g.input, params.rows) for g in groups), channels_for=_WHERE
    )


def _weights_kn(model: onnx.ModelProto, group: SmoothGroup) -> list[np.ndarray]:
    """Each member's weight as [K, N] float32 (a transB weight transposed)."""
    initializers = {init.name: init for init in model.graph.initializer}
    arrays = []
    for member in group.members:
        array = numpy_helper.to_array(initializers[member.weight]).astype(np.float32)
        arrays.append(array.T if member.transposed else array)
    return arrays


def smoothing_scale(absmax_x: np.ndarray, absmax_w: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), float32; 1 where either side is all zero
    (a dead channel has nothing to migrate) and for alpha 0."""
    ax = np.asarray(absmax_x, np.float64)
    aw = np.asarray(absmax_w, np.float64)
    if alpha == 0.0:
        return np.ones(ax.shape, np.float32)
    live = (ax > 0) & (aw > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(live, np.power(ax, alpha) / np.power(aw, 1.0 - alpha), 1.0)
    return np.maximum(s, _MIN_SCALE).astype(np.float32)


def smoothed_range(stats: ChannelStats, inverse: np.ndarray) -> tuple[float, float]:
    """[min, max] of float32(X * inverse) over every calibration row: exact, since each
    channel's map is monotone (inverse > 0) and float32 rounding is monotone."""
    low = (stats.minimum.astype(np.float32) * inverse).astype(np.float32)
    high = (stats.maximum.astype(np.float32) * inverse).astype(np.float32)
    return float(low.min()), float(high.max())


def _fake_quantize_activation(x: np.ndarray, low: float, high: float, symmetric: bool):
    params = activation_params(low, high, symmetric)
    info = np.iinfo(params.dtype)
    zero = float(params.zero_point)
    scale = np.float32(params.scale)
    q = np.clip(np.round(x / scale) + zero, info.min, info.max)  # ORT rounds half to even too
    return (q - zero) * np.float64(scale)


def _fake_quantize_weight(w: np.ndarray, per_channel: bool) -> np.ndarray:
    params = quantize_weight(w, 1 if per_channel else None)
    scale = np.asarray(params.scale, np.float64)
    return params.values.astype(np.float64) * (scale.reshape(1, -1) if per_channel else scale)


def layer_errors(
    stats: ChannelStats,
    weights: list[np.ndarray],
    members: tuple[Member, ...],
    scale: np.ndarray,
    symmetric: bool,
    references: list[np.ndarray] | None = None,
) -> dict[str, float]:
    """Relative output error (sum |Y - Yq|^2 / sum |Y|^2) of each member, and "total" over all,
    on the sampled rows, with X / s and diag(s) W quantized as qtool writes them.

    `references`: each member's float output X W (float64) when the caller has it: it is the
    same for every s, and computing it once halves an alpha search."""
    x = stats.sample
    inverse = (np.float32(1.0) / scale).astype(np.float32)
    smoothed = (x * inverse).astype(np.float32)
    low, high = smoothed_range(stats, inverse)
    xq = _fake_quantize_activation(smoothed, low, high, symmetric)
    if references is None:
        references = float_outputs(stats, weights)
    errors: dict[str, float] = {}
    total = SignalQuality()
    for member, w, reference in zip(members, weights, references, strict=True):
        scaled = (w * scale[:, None]).astype(np.float32)
        quality = SignalQuality()
        quality.update(reference, xq @ _fake_quantize_weight(scaled, member.per_channel))
        errors[member.node] = _relative_error(quality)
        total.merge(quality)
    errors["total"] = _relative_error(total)
    return errors


def _relative_error(quality: SignalQuality) -> float:
    """Noise over signal power; the plain squared error where the float output is all zero
    (no signal to compare with, yet a smaller error still wins the alpha search)."""
    return quality.noise / quality.signal if quality.signal > 0 else quality.noise


def float_outputs(stats: ChannelStats, weights: list[np.ndarray]) -> list[np.ndarray]:
    """Each weight's float output X W on the sampled rows, in float64."""
    x64 = stats.sample.astype(np.float64)
    return [x64 @ w.astype(np.float64) for w in weights]


def search_alpha(
    stats: ChannelStats,
    weights: list[np.ndarray],
    members: tuple[Member, ...],
    alpha: str | float,
    symmetric: bool,
) -> Choice:
    """The alpha (from SMOOTHQUANT_ALPHAS when "auto") with the least output error; 0 (no
    smoothing) unless some alpha is strictly better than none."""
    absmax_w = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
    candidates = SMOOTHQUANT_ALPHAS if alpha == "auto" else (0.0, float(alpha))
    errors: dict[float, float] = {}
    node_errors: dict[float, dict[str, float]] = {}
    scales: dict[float, np.ndarray] = {}
    references = float_outputs(stats, weights)
    for a in dict.fromkeys((0.0, *candidates)):
        scales[a] = smoothing_scale(stats.absmax, absmax_w, a)
        node_errors[a] = layer_errors(stats, weights, members, scales[a], symmetric, references)
        errors[a] = node_errors[a].pop("total")
    best = min(errors, key=lambda a: (errors[a], a))  # ties: the smaller alpha
    if best == 0.0 or errors[best] >= errors[0.0]:
        tried = "any alpha tried" if alpha == "auto" else f"alpha {float(alpha):g}"
        reason = (
            f"kept unsmoothed: {tried} gave a larger quantized output error than no smoothing"
            if len(errors) > 1
            else "alpha 0: no smoothing asked"
        )
        return Choice(0.0, scales[0.0], errors, node_errors, reason)
    how = "searched" if alpha == "auto" else "given"
    return Choice(best, scales[best], errors, node_errors, f"alpha {best:g} ({how})")


def _unique(name: str, taken: set[str]) -> str:
    candidate, number = name, 1
    while candidate in taken:
        number += 1
        candidate = f"{name}_{number}"
    taken.add(candidate)
    return candidate


def smooth_model(
    model: onnx.ModelProto, groups: list[SmoothGroup], choices: dict[str, Choice]
) -> tuple[onnx.ModelProto, dict[str, str], dict[str, str]]:
    """A copy of `model` with every applied group smoothed; also, per smoothed group input, the
    tensor its MatMuls now read, and the node that divides by s (a LayerNorm or a new Mul)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    index = {init.name: i for i, init in enumerate(graph.initializer)}
    taken = {n for node in graph.node for n in [*node.input, *node.output, node.name]}
    taken |= set(index) | {i.name for i in graph.input}
    nodes = {node.name: node for node in graph.node}
    types = {vi.name: vi for vi in [*graph.value_info, *graph.input, *graph.output]}
    reads: dict[str, str] = {}
    divided_by: dict[str, str] = {}
    inserts: dict[str, onnx.NodeProto] = {}  # first member's name -> Mul to insert before it

    def replace(name: str, array: np.ndarray) -> None:
        graph.initializer[index[name]].CopyFrom(numpy_helper.from_array(array, name))

    for group in groups:
        choice = choices.get(group.input)
        if choice is None or not choice.applied:
            continue
        scale, inverse = choice.scale, choice.inverse
        for member in group.members:
            w = numpy_helper.to_array(graph.initializer[index[member.weight]])
            factor = scale[None, :] if member.transposed else scale[:, None]
            replace(member.weight, (w * factor).astype(np.float32))
        if group.layer_norm is not None:
            norm = nodes[group.layer_norm]
            for name in [n for n in norm.input[1:3] if n]:
                value = numpy_helper.to_array(graph.initializer[index[name]])
                replace(name, (value * inverse).astype(np.float32))
            reads[group.input] = group.input
            divided_by[group.input] = group.layer_norm
            continue
        smoothed = _unique(f"{group.input}/smoothquant", taken)
        constant = _unique(f"{group.input}/smoothquant_inverse_scale", taken)
        mul = helper.make_node(
            "Mul",
            [group.input, constant],
            [smoothed],
            name=_unique(f"SmoothQuant{group.input}/Mul", taken),
        )
        graph.initializer.append(numpy_helper.from_array(inverse, constant))
        index[constant] = len(graph.initializer) - 1
        if group.input in types:
            value = onnx.ValueInfoProto()
            value.CopyFrom(types[group.input])
            value.name = smoothed
            graph.value_info.append(value)
        for member in group.members:
            node = nodes[member.node]
            node.input[0] = smoothed
        inserts[group.members[0].node] = mul
        reads[group.input] = smoothed
        divided_by[group.input] = mul.name
    if inserts:
        ordered = []
        for node in graph.node:
            if node.name in inserts:
                ordered.append(inserts[node.name])
            ordered.append(node)
        del graph.node[:]
        graph.node.extend(ordered)
    return out, reads, divided_by


def _derived_stats(
    group: SmoothGroup,
    tensor: str,
    channel: ChannelStats,
    choice: Choice,
    layout: Layout,
    stats: dict[str, TensorStats],
) -> TensorStats:
    """The smoothed input's min-max statistics, derived from the per-channel min/max.

    Carries exact min/max and no histogram (an empty one): only min-max ranges are taken from
    it, which check_method guarantees."""
    slot = layout.activations.get(group.input) or layout.activations.get(
        slot_key(group.input, "fp8")
    )
    if slot is None or slot.stats_tensor not in stats:
        raise CalibrationError(
            f"SmoothQuant: no calibration statistics for '{group.input}' (re-run `qtool "
            "calibrate` with this recipe)"
        )
    low, high = smoothed_range(channel, choice.inverse)
    samples = stats[slot.stats_tensor].samples
    return TensorStats(tensor, low, high, 0.0, np.zeros(0, np.int64), samples)


def _transform_hessians(
    hessians: dict[str, HessianAccumulator],
    reads: dict[str, str],
    choices: dict[str, Choice],
    new_layout: Layout,
) -> dict[str, HessianAccumulator]:
    """GPTQ's XᵀX for the smoothed inputs: diag(1/s) XᵀX diag(1/s), exact."""
    out = dict(hessians)
    needed = set(new_layout.hessian_tensors())
    for original, tensor in reads.items():
        if tensor not in needed or original not in hessians:
            continue
        inverse = choices[original].inverse.astype(np.float64)
        acc = hessians[original]
        xtx = acc.xtx * inverse[:, None] * inverse[None, :]
        out[tensor] = HessianAccumulator.from_sum(xtx, acc.rows, tensor)
    return out


def _sqnr_db(error: float) -> float | None:
    """The report's SQNR of a relative error; None for an exact layer (no finite dB)."""
    return None if error <= 0 else round(db_from_noise_ratio(error), 3)


def _outlier_ratio(absmax: np.ndarray) -> float:
    """max over median of the per-channel max |x|: how far the outlier channels stand out."""
    median = float(np.median(absmax))
    return round(float(absmax.max()) / median, 3) if median > 0 else float("inf")


def _group_entry(
    group: SmoothGroup,
    channel: ChannelStats,
    choice: Choice,
    reads: dict[str, str],
    divided_by: dict[str, str],
) -> dict:
    before, after = choice.errors[0.0], choice.errors[choice.alpha]
    entry = {
        "input": group.input,
        "nodes": group.nodes,
        "applied": choice.applied,
        "alpha": choice.alpha,
        "reason": choice.reason,
        "smoothed_input": reads.get(group.input),
        "divided_by": None,
        "output_error_before": before,
        "output_error_after": after,
        "output_sqnr_db_before": _sqnr_db(before),
        "output_sqnr_db_after": _sqnr_db(after),
        "node_sqnr_db": {
            node: {
                "before": _sqnr_db(choice.node_errors[0.0][node]),
                "after": _sqnr_db(choice.node_errors[choice.alpha][node]),
            }
            for node in group.nodes
        },
        "sqnr_db_by_alpha": {f"{a:g}": _sqnr_db(e) for a, e in choice.errors.items()},
        "input_outlier_ratio_before": _outlier_ratio(channel.absmax),
        "input_outlier_ratio_after": _outlier_ratio(channel.absmax / choice.scale),
        "rows_searched": int(channel.sample.shape[0]),
    }
    if choice.applied:
        how = "LayerNormalization scale and bias" if group.layer_norm else "inserted Mul"
        entry["divided_by"] = {"node": divided_by[group.input], "how": how}
    return entry


@dataclass
class Smoothed:
    """The smoothed float model, its plan, the statistics and Hessians of its smoothed inputs,
    and the report entry; the stats files stay keyed to the unsmoothed model they came from."""

    model: onnx.ModelProto
    layout: Layout
    stats: dict[str, TensorStats]
    hessians: dict[str, HessianAccumulator]
    entry: dict = field(default_factory=dict)


def apply_smoothquant(
    model: onnx.ModelProto,
    layout: Layout,
    params: SmoothQuantParams,
    channels: Mapping[str, ChannelStats],
    stats: Mapping[str, TensorStats],
    hessians: Mapping[str, HessianAccumulator],
    symmetric: bool,
    replan: Callable[[onnx.ModelProto], Layout],
    channels_source: str,
) -> Smoothed:
    """Search alpha per smoothed input, smooth the model, and re-plan it with `replan` (the
    pipeline's plan stage, so the smoothed model is planned as any other).

    `channels`: the per-channel statistics of the calibration pass (`channels_source` names
    where they came from, for errors)."""
    groups = smoothing_groups(model, layout)
    missing = [g.input for g in groups if g.input not in channels]
    if missing:
        raise CalibrationError(
            f"{channels_source}: no per-channel statistics for '{missing[0]}' "
            f"({len(missing)} missing; re-run `qtool calibrate` with this recipe)"
        )
    choices = {}
    for group in groups:
        weights = _weights_kn(model, group)
        choices[group.input] = search_alpha(
            channels[group.input], weights, group.members, params.alpha, symmetric
        )
    smoothed, reads, divided_by = smooth_model(model, groups, choices)
    new_layout = replan(smoothed)
    stats = dict(stats)
    derived = {}
    for group in groups:
        if choices[group.input].applied:
            tensor = reads[group.input]
            derived[tensor] = _derived_stats(
                group, tensor, channels[group.input], choices[group.input], layout, stats
            )
    stats.update(derived)
    for name, node in divided_by.items():
        if node in new_layout.plan and not new_layout.plan[node].quantized:
            new_layout.plan[node].reason = (
                f"SmoothQuant: divides '{name}' by its smoothing factors (the MatMuls reading "
                "it carry them in their weights)"
            )
    new_hessians = _transform_hessians(dict(hessians), reads, choices, new_layout)
    entry = {
        "alpha": params.alpha,
        "alphas_searched": list(SMOOTHQUANT_ALPHAS) if params.alpha == "auto" else None,
        "rows": params.rows,
        "error": "relative output error sum|Y - Yq|^2 / sum|Y|^2 of the quantized layer on the "
        "sampled calibration rows (uint8 per-tensor inputs, int8 per-channel weights)",
        "ranges": "min-max of each smoothed input, derived exactly from the per-channel min/max "
        "of the calibration pass",
        "inputs": len(groups),
        "smoothed": sum(1 for c in choices.values() if c.applied),
        "kept_unsmoothed": sum(1 for c in choices.values() if not c.applied),
        "layers": [
            _group_entry(g, channels[g.input], choices[g.input], reads, divided_by) for g in groups
        ],
    }
    return Smoothed(smoothed, new_layout, stats, new_hessians, entry)
