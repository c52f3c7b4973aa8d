"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): scale the input channels of weight-only layers so the channels that carry large
activations keep more of their weights' precision.

For s > 0 per input channel of a layer input X, X W = (X diag(1/s)) (diag(s) W): the float
function is unchanged, but the weights of channel j are quantized s_j times larger, so their
relative rounding error shrinks where s_j > 1, and the output error X ΔW, which weighs channel
j's error by X_j, moves off the channels where X is large. AWQ takes s = a^alpha, a the
per-channel activation magnitude, and searches alpha.

qtool's variant:
- a_j = sqrt(H_jj), the RMS of channel j over every calibration token, from the Hessian
  H = XᵀX / rows the calibration pass collects (the GPTQ statistic; one pass serves both);
  normalised so that max(s) min(s) = 1, as the paper's code does;
- alpha in 0, 1/grid, ..., 1 is chosen by the quantized layers' output error over *all*
  calibration tokens, computed exactly from H: for a weight W [K, N] and its quantized
  W' = diag(1/s) Q(diag(s) W), ||X W - X W'||² = tr(Δᵀ (XᵀX) Δ) with Δ = W - W'. (NNCF's AWQ
  measures it on per-sample mean activations instead, and only for groups of the 0.2 % largest
  channels.) Q is round-to-nearest on the plan's own grid (bits, blocks, symmetry); alpha 0 is
  no scaling, so a layer input where no alpha beats it is left as it is;
- all weight-only MatMuls reading X share one s (for Q, K and V, or gate and up);
- 1/s goes where it costs nothing when it can: into a constant multiplier that produces X (an
  RMSNorm's weight), or into the columns of the MatMul weight that feeds X through a Mul (the up
  projection of a gated MLP: down(act(gate) * up)), when X (and that MatMul's output) feed
  nothing else; otherwise an explicit Mul(X, 1/s) in front of the scaled MatMuls (the attention
  output projection, whose input comes from the value projection through reshapes, GQA head
  repeats and the KV cache outputs, which must not change).

Only weight-only layers are scaled (activations float: their inputs have no ranges a changed X
would invalidate) whose weight is theirs alone (a tied table keeps its values: the embedding
reads it too). The Hessians transform exactly: XᵀX of X diag(1/s) is diag(1/s) XᵀX diag(1/s),
so GPTQ and scale estimation after AWQ round against the scaled layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.algorithms.spec import AwqParams
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.requests import StatisticRequests
from qtool.errors import CalibrationError
from qtool.model.external_data import is_lazy, lazy_file, tensor_array
from qtool.model.scratch_weights import ScratchWeights
from qtool.plan.layout import Layout, WeightSlot
from qtool.plan.plan import WeightPlan
from qtool.write.int4 import dequantize
from qtool.write.low_bit import quantize_low_bit

__all__ = ["AwqGroup", "Scaled", "apply_awq", "awq_groups", "requests", "search_scale"]


@dataclass(frozen=True)
class Member:
    """A weight-only MatMul reading the group's input: its node, weight [K, N], slot and plan."""

    node: str
    weight: str
    slot: WeightSlot
    plan: WeightPlan


@dataclass(frozen=True)
class AwqGroup:
    """A layer input X and the weight-only MatMuls that read it; `others`: X's other readers
    (then 1/s cannot go into X itself)."""

    input: str
    members: tuple[Member, ...]
    others: int


@dataclass
class Choice:
    alpha: float
    scale: np.ndarray | None  # None: left unscaled
    error_before: float
    error_after: float


@dataclass
class Scaled:
    """AWQ's result: the scaled model, its plan, Hessians and the report entry."""

    model: onnx.ModelProto
    layout: Layout
    hessians: dict[str, HessianAccumulator]
    entry: dict
    # The file a lazy model's scaled weights are read from: held as long as the model is
    scratch: ScratchWeights | None = None


def _eligible(
    node: onnx.NodeProto, layout: Layout, initializer_readers: Mapping[str, int]
) -> Member | None:
    """`node` as a member: a planned weight-only MatMul with its own constant [K, N] weight."""
    if node.op_type != "MatMul" or node.name not in layout.plan:
        return None
    plan = layout.plan[node.name]
    weight = node.input[1]
    if not plan.quantized or plan.activations != "float" or plan.weight is None:
        return None
    if plan.weight.tensor != weight or weight not in layout.weights:
        return None  # read through a Transpose (a tied table) or not the planned weight
    slot = layout.weights[weight]
    if slot.transposed or slot.reduction != "k-rows" or initializer_readers.get(weight, 0) != 1:
        return None
    return Member(node.name, weight, slot, plan.weight)


def awq_groups(model: onnx.ModelProto, layout: Layout) -> list[AwqGroup]:
    """Every layer input read by at least one weight-only MatMul AWQ can scale, in graph order."""
    graph = model.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    initializer_readers: dict[str, int] = {}
    initializers = {t.name for t in graph.initializer}
    for node in graph.node:
        for name in node.input:
            if name in initializers:
                initializer_readers[name] = initializer_readers.get(name, 0) + 1
        for name in dict.fromkeys(node.input):
            if name:
                readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    groups: list[AwqGroup] = []
    for tensor, nodes in readers.items():
        if tensor in initializers:
            continue
        members = []
        for node in nodes:
            member = _eligible(node, layout, initializer_readers)
            if member is not None and node.input[0] == tensor:
                members.append(member)
        if members:
            others = len(nodes) - len(members) + (1 if tensor in outputs else 0)
            groups.append(AwqGroup(tensor, tuple(members), others))
    return groups


def requests(model: onnx.ModelProto, layout: Layout) -> StatisticRequests:
    """The Hessians of every input AWQ may scale, for the calibration pass."""
    return StatisticRequests(hessians=tuple(g.input for g in awq_groups(model, layout)))


def _rtn_error(weight: np.ndarray, member: Member, h: np.ndarray, scale: np.ndarray) -> float:
    """tr(Δᵀ H Δ) of `weight` [K, N] rounded to nearest on its plan's grid after scaling its
    rows by `scale` (and the rounded rows scaled back)."""
    rtn = dataclasses.replace(member.plan, method="minmax")
    scaled = weight * scale[:, None]
    approx = dequantize(quantize_low_bit(scaled, member.slot, rtn)) / scale[:, None]
    diff = (weight - approx).astype(np.float32)
    return float(np.sum((h @ diff).astype(np.float64) * diff))


def search_scale(
    weights: list[np.ndarray], members: tuple[Member, ...], h: np.ndarray, grid: int
) -> Choice:
    """The per-channel scale s = rms^alpha (normalised) with the least summed output error of
    the group's quantized weights, alpha on grid + 1 points in [0, 1]; alpha 0 is s = 1."""
    h = np.asarray(h, np.float32)
    rms = np.sqrt(np.maximum(np.diag(h), 0.0)).astype(np.float64)
    live = rms > 0
    if not live.any():
        return Choice(0.0, None, 0.0, 0.0)
    rms = np.where(live, rms, rms[live].min())
    ones = np.ones(len(rms), np.float32)
    base = sum(_rtn_error(w, m, h, ones) for w, m in zip(weights, members, strict=True))
    best = Choice(0.0, None, base, base)
    for step in range(1, grid + 1):
        alpha = step / grid
        s = rms**alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        error = sum(_rtn_error(w, m, h, s) for w, m in zip(weights, members, strict=True))
        if error < best.error_after:  # strict: the smaller alpha wins ties
            best = Choice(alpha, s, base, error)
    return best


def _set(
    initializers: dict[str, onnx.TensorProto],
    name: str,
    value: np.ndarray,
    scratch: ScratchWeights | None,
) -> None:
    """Give initializer `name` its new values: a lazy weight stays lazy, its new values in the
    scratch file (the model proto would hold them to the end)."""
    tensor = initializers[name]
    if scratch is not None and lazy_file(tensor) is not None:
        scratch.put(tensor, value.astype(np.float32))
    else:
        tensor.CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))


def _fold_target(
    graph: onnx.GraphProto,
    group: AwqGroup,
    layout: Layout,
    initializers: dict[str, onnx.TensorProto],
    readers: Mapping[str, int],
) -> tuple[str, str, str] | None:
    """Where 1/s can go for free: ("constant", Mul node, its constant input) or ("columns",
    MatMul node, its weight); None: an explicit Mul is needed."""
    quantized_tensors = {s.tensor for s in layout.activations.values()} | {
        s.stats_tensor for s in layout.activations.values()
    }
    outputs = {o.name for o in graph.output}
    if group.others or group.input in quantized_tensors or group.input in outputs:
        return None
    producers = {o: n for n in graph.node for o in n.output}
    mul = producers.get(group.input)
    if mul is None or mul.op_type != "Mul" or len(mul.input) != 2:
        return None
    k = int(initializers[group.members[0].weight].dims[0])
    for operand in mul.input:
        constant = initializers.get(operand)
        if constant is not None and constant.data_type == onnx.TensorProto.FLOAT:
            dims = [int(d) for d in constant.dims]
            if dims and dims[-1] == k and int(np.prod(dims)) == k and readers[operand] == 1:
                return "constant", mul.name, operand
    for operand in mul.input:
        source = producers.get(operand)
        if source is None or source.op_type != "MatMul" or readers[operand] != 1:
            continue
        weight = initializers.get(source.input[1])
        if weight is None or len(weight.dims) != 2 or int(weight.dims[1]) != k:
            continue
        if readers[source.input[1]] != 1 or operand in quantized_tensors or operand in outputs:
            continue
        return "columns", source.name, source.input[1]
    return None


def scale_model(
    model: onnx.ModelProto,
    groups: list[AwqGroup],
    choices: Mapping[str, Choice],
    layout: Layout,
    scratch: ScratchWeights | None = None,
) -> tuple[onnx.ModelProto, dict[str, str], dict[str, str]]:
    """A copy of `model` with every chosen scale applied: (model, input -> the tensor its
    members now read, input -> where 1/s went). `scratch`: where a lazy model's scaled weights
    go (they stay lazy)."""
    scaled = onnx.ModelProto()
    scaled.CopyFrom(model)
    graph = scaled.graph
    initializers = {t.name: t for t in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    reads: dict[str, str] = {}
    where: dict[str, str] = {}
    new_nodes: list[tuple[str, onnx.NodeProto]] = []
    for group in groups:
        choice = choices[group.input]
        if choice.scale is None:
            continue
        s = choice.scale
        for member in group.members:
            w = tensor_array(initializers[member.weight]).astype(np.float32)
            _set(initializers, member.weight, w * s[:, None], scratch)
        target = _fold_target(graph, group, layout, initializers, readers)
        if target is not None and target[0] == "constant":
            c = tensor_array(initializers[target[2]]).astype(np.float32)
            _set(initializers, target[2], c / s.reshape(c.shape), scratch)
            reads[group.input] = group.input
            where[group.input] = f"the constant '{target[2]}' of Mul '{target[1]}'"
        elif target is not None:
            w = tensor_array(initializers[target[2]]).astype(np.float32)
            _set(initializers, target[2], w / s[None, :], scratch)
            reads[group.input] = group.input
            where[group.input] = (
                f"the output columns of MatMul '{target[1]}' (weight '{target[2]}')"
            )
        else:
            inverse = f"{group.input}_awq_inverse_scale"
            out = f"{group.input}_awq_scaled"
            graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inverse))
            mul = helper.make_node(
                "Mul", [group.input, inverse], [out], name=f"{group.input}_awq_Mul"
            )
            new_nodes.append((group.input, mul))
            names = {m.node for m in group.members}
            for node in graph.node:
                if node.name in names:
                    node.input[0] = out
            reads[group.input] = out
            where[group.input] = f"a new Mul '{mul.name}' in front of the scaled MatMuls"
            _copy_type(graph, group.input, out)
    _insert_after_producers(graph, new_nodes)
    return scaled, reads, where


def _copy_type(graph: onnx.GraphProto, source: str, name: str) -> None:
    """Give the new tensor `name` the type and shape of `source` (the plan needs its type)."""
    known = [*graph.input, *graph.value_info, *graph.output]
    value = next((v for v in known if v.name == source), None)
    if value is None:
        raise CalibrationError(f"AWQ: tensor '{source}' has no type information to copy")
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    copy.name = name
    graph.value_info.append(copy)


def _insert_after_producers(graph: onnx.GraphProto, new: list[tuple[str, onnx.NodeProto]]) -> None:
    """Place each new node right after the node producing its input (graph inputs: first)."""
    if not new:
        return
    after: dict[str, list[onnx.NodeProto]] = {}
    for tensor, node in new:
        after.setdefault(tensor, []).append(node)
    nodes: list[onnx.NodeProto] = []
    for tensor in [t for t in after if all(t not in n.output for n in graph.node)]:
        nodes.extend(after.pop(tensor))
    for node in graph.node:
        nodes.append(node)
        for out in node.output:
            nodes.extend(after.pop(out, []))
    del graph.node[:]
    graph.node.extend(nodes)


def _scaled_hessians(
    hessians: Mapping[str, HessianAccumulator],
    groups: list[AwqGroup],
    choices: Mapping[str, Choice],
    reads: Mapping[str, str],
) -> dict[str, HessianAccumulator]:
    """XᵀX of each scaled input X diag(1/s): diag(1/s) XᵀX diag(1/s), under the name the scaled
    MatMuls now read."""
    out = dict(hessians)
    for group in groups:
        choice = choices[group.input]
        if choice.scale is None:
            continue
        inverse = 1.0 / choice.scale.astype(np.float64)
        # derived from the unscaled sum on each read, not a second copy held through the build
        out[reads[group.input]] = hessians[group.input].scaled(inverse, reads[group.input])
    return out


def apply_awq(
    model: onnx.ModelProto,
    layout: Layout,
    params: AwqParams,
    hessians: Mapping[str, HessianAccumulator],
    replan: Callable[[onnx.ModelProto], Layout],
) -> Scaled:
    """Search each group's scale, scale the model, and re-plan it with `replan` (the pipeline's
    plan stage)."""
    groups = awq_groups(model, layout)
    missing = [g.input for g in groups if g.input not in hessians]
    if missing:
        raise CalibrationError(
            f"AWQ: no calibration Hessian for layer input '{missing[0]}' ({len(missing)} "
            "missing; re-run `qtool calibrate` with this recipe)"
        )
    initializers = {t.name: t for t in model.graph.initializer}
    choices: dict[str, Choice] = {}
    for group in groups:
        weights = [tensor_array(initializers[m.weight]).astype(np.float32) for m in group.members]
        choices[group.input] = search_scale(
            weights, group.members, hessians[group.input].hessian(), params.grid
        )
    scratch = ScratchWeights() if is_lazy(model) else None
    scaled, reads, where = scale_model(model, groups, choices, layout, scratch)
    new_layout = replan(scaled)
    entry = {
        "grid": params.grid,
        "statistic": "per-channel RMS of each layer input (sqrt of the calibration Hessian's "
        "diagonal)",
        "error": "output error of the round-to-nearest quantized layers over every calibration "
        "token, tr(dW^T X^T X dW), summed over the MatMuls sharing the input",
        "inputs": len(groups),
        "scaled": sum(1 for c in choices.values() if c.scale is not None),
        "layers": [
            {
                "input": g.input,
                "matmuls": [m.node for m in g.members],
                "alpha": choices[g.input].alpha,
                "applied": choices[g.input].scale is not None,
                "error_before": choices[g.input].error_before,
                "error_after": choices[g.input].error_after,
                "inverse_scale_in": where.get(g.input),
            }
            for g in groups
        ],
    }
    hessians = _scaled_hessians(hessians, groups, choices, reads)
    return Scaled(scaled, new_layout, hessians, entry, scratch)
