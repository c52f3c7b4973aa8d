"""INT8 fallback for 4-bit weights: the layers where 4 bits cost the most output error (relative
to the output) per byte saved keep 8-bit weights, for a share of the 4-bit weights the recipe
sets.

Why: on a decoder LLM, a few layers carry most of INT4's damage (the MLP down projections,
whose inputs hold a handful of huge channels, and some early attention projections), and
putting only those back to int8 buys most of the perplexity back for a small part of INT8's
size. NNCF's weight compression offers the same trade (`ratio`, backup mode INT8) ranked by a
Hessian-trace criterion; measuring every layer's end-to-end effect (`qtool quantize --auto`)
costs one model evaluation per layer, which an LLM of 200 MatMuls cannot afford.

The criterion, per weight-only MatMul planned at 4 bits: the output error its weight's rounding
causes over every calibration token, relative to the layer's output energy, computed exactly
from the layer input's Hessian XᵀX (the statistic GPTQ, AWQ and scale estimation read from the
same pass): for W [K, N] and its rounded W', ||X W - X W'||² = tr(Δᵀ XᵀX Δ), Δ = W - W', over
||X W||² = tr(Wᵀ XᵀX W). Each layer's gain from promotion is that noise-to-signal ratio at
round-to-nearest 4 bits minus the ratio at 8 bits (per output channel, symmetric: the form of
the `int8-llm` preset; on a layer whose weight column holds an outlier row, as some down
projections' do, that can be worse than 4-bit blocks, and such a layer never falls back), and
its cost is its parameter count (the bytes int8 adds over int4 grow with it); layers are
promoted in decreasing gain per parameter until the promoted parameters would exceed
(1 - ratio) of the 4-bit weights, skipping a layer that does not fit and trying the next, so
the share kept at 4 bits is at least `ratio`.

Relative, not absolute: layers' output errors are not comparable as sums of squares (a query
projection's output is normalized again by Gemma's QK-norm; a residual-stream writer's is added
to a stream of another scale), while a noise-to-signal ratio is what the next layer sees. On the
tuning windows (docstrings the calibration did not read; held-out text never chose this),
relative against absolute: Gemma 3 270M perplexity +2.80% over FP32 against +3.46% (INT4 alone
+4.56%), KL 0.030 against 0.035; SmolLM2-135M +3.59% against +3.23% (INT4 alone +4.71%), KL
0.035 against 0.037: relative won both models' KL and their summed perplexity.

Round-to-nearest rather than the recipe's GPTQ or scale estimation: the ranking must come before
those run (they run on the plan this chooses), and what makes a layer hard for one rounding makes
it hard for the others.

Runs after AWQ (its scaled weights and Hessians are what the 4-bit rounding will see) and
before scale estimation and GPTQ, and re-plans the model with one exact-name override that
pins the chosen nodes to 8-bit per-channel symmetric weights, activations float (ONNX Runtime
runs them as 8-bit MatMulNBits): the Plan says
which layers fell back, and report.json lists each with its errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from qtool.algorithms.awq import Member, awq_groups
from qtool.algorithms.spec import Int8FallbackParams
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.requests import StatisticRequests
from qtool.errors import CalibrationError
from qtool.model.external_data import tensor_array
from qtool.plan.layout import Layout
from qtool.plan.settings import Override, WeightSettings, exact_pattern
from qtool.write.int4 import dequantize, quantize_per_channel
from qtool.write.low_bit import quantize_low_bit

__all__ = ["Ranked", "fallback_override", "rank_layers", "requests", "choose", "apply_fallback"]


# What a fallen-back layer's weight becomes: the weight-only int8 of the `int8-llm` preset. On
# SmolLM2-135M's tuning windows (docstrings the calibration did not read), 8 bits in the 4-bit
# blocks instead gave perplexity +3.9% over FP32 against +3.2% per channel (INT4 alone +4.7%),
# KL 0.035 against 0.037, at 1.125 bytes a weight against 1 (both ranked by the absolute output
# error, the criterion of the time).
FALLBACK_WEIGHTS = WeightSettings(
    bits=8, granularity="per-channel", method="minmax", symmetric=True
)


@dataclass(frozen=True)
class Ranked:
    """One 4-bit layer's case for int8: its output errors over the calibration tokens at
    4 bits (round to nearest on its plan's grid) and at 8 bits, and its parameter count."""

    node: str
    input: str
    params: int
    error_int4: float
    error_int8: float
    signal: float  # the layer's output energy over the same tokens, tr(Wᵀ XᵀX W)

    @property
    def gain_per_param(self) -> float:
        """Noise-to-signal ratio saved by 8 bits, per parameter promoted."""
        if self.signal <= 0.0:
            return 0.0  # a layer whose output is zero on the calibration data: nothing to save
        return (self.error_int4 - self.error_int8) / self.signal / self.params


def _four_bit_members(model: onnx.ModelProto, layout: Layout) -> list[tuple[str, Member]]:
    """(layer input, member) of every weight-only MatMul planned at 4 bits with a weight of its
    own, in graph order (AWQ's eligibility: a tied table has readers at other precisions)."""
    return [
        (group.input, member)
        for group in awq_groups(model, layout)
        for member in group.members
        if member.plan.bits == 4
    ]


def requests(model: onnx.ModelProto, layout: Layout) -> StatisticRequests:
    """The Hessians of every input of a 4-bit weight-only MatMul, for the calibration pass."""
    inputs = dict.fromkeys(tensor for tensor, _ in _four_bit_members(model, layout))
    return StatisticRequests(hessians=tuple(inputs))


def _energy(h: np.ndarray, matrix: np.ndarray) -> float:
    """tr(Mᵀ H M): the summed squares of X M over the tokens H = XᵀX holds (M = Δ: the output
    error; M = W: the output itself)."""
    matrix = matrix.astype(np.float32)
    return float(np.sum((h @ matrix).astype(np.float64) * matrix))


def rank_layers(
    model: onnx.ModelProto, layout: Layout, hessians: Mapping[str, HessianAccumulator]
) -> list[Ranked]:
    """Every 4-bit weight-only MatMul with its errors, most gain per parameter first (graph
    order breaks ties, so the ranking is deterministic)."""
    members = _four_bit_members(model, layout)
    missing = sorted({tensor for tensor, _ in members if tensor not in hessians})
    if missing:
        raise CalibrationError(
            f"int8_fallback: no calibration Hessian for layer input '{missing[0]}' "
            f"({len(missing)} missing; re-run `qtool calibrate` with this recipe)"
        )
    initializers = {t.name: t for t in model.graph.initializer}
    ranked = []
    for tensor, member in members:
        h = np.asarray(hessians[tensor].xtx, np.float32)
        weight = tensor_array(initializers[member.weight]).astype(np.float32)
        rtn = dataclasses.replace(member.plan, method="minmax")
        int4 = dequantize(quantize_low_bit(weight, member.slot, rtn))
        int8 = dequantize(quantize_per_channel(weight, bits=8, symmetric=True, axis=1))
        ranked.append(
            Ranked(
                member.node,
                tensor,
                int(weight.size),
                _energy(h, weight - int4),
                _energy(h, weight - int8),
                _energy(h, weight),
            )
        )
    order = {r.node: i for i, r in enumerate(ranked)}
    return sorted(ranked, key=lambda r: (-r.gain_per_param, order[r.node]))


def choose(ranked: Sequence[Ranked], ratio: float) -> list[Ranked]:
    """The layers that fall back: in ranking order, each whose parameters still fit within
    (1 - ratio) of all the ranked layers' parameters."""
    allowance = (1.0 - ratio) * sum(r.params for r in ranked)
    chosen, used = [], 0
    for layer in ranked:
        if layer.error_int4 <= layer.error_int8:
            continue  # nothing to gain (a constant weight 4 bits already hold exactly)
        if used + layer.params <= allowance:
            chosen.append(layer)
            used += layer.params
    return chosen


def fallback_override(nodes: Sequence[str]) -> Override:
    """The override that pins `nodes` to 8-bit weight-only, as a recipe entry would."""
    return Override(
        where="quantization.algorithms.int8_fallback",
        nodes=tuple(exact_pattern(n) for n in nodes),
        precision="int8",
        weights=FALLBACK_WEIGHTS,
        activations="float",
    )


@dataclass
class FellBack:
    """The fallback's result: the re-planned layout and the report entry."""

    layout: Layout
    entry: dict


def apply_fallback(
    model: onnx.ModelProto,
    layout: Layout,
    params: Int8FallbackParams,
    hessians: Mapping[str, HessianAccumulator],
    replan: Callable[[Sequence[Override]], Layout],
) -> FellBack:
    """Rank the 4-bit layers, choose those that fall back, and re-plan with their override
    (`replan`: the pipeline's plan stage with extra overrides after the recipe's)."""
    ranked = rank_layers(model, layout, hessians)
    chosen = choose(ranked, params.ratio)
    new_layout = replan([fallback_override([r.node for r in chosen])]) if chosen else layout
    for layer in chosen:
        planned = new_layout.plan[layer.node]
        if planned.weight is None or planned.weight.bits != 8:
            raise CalibrationError(
                f"int8_fallback: node {layer.node!r} did not take 8-bit weights when re-planned "
                f"({planned.reason})"
            )
    total = sum(r.params for r in ranked)
    promoted = sum(r.params for r in chosen)
    names = {r.node for r in chosen}
    entry = {
        "ratio": params.ratio,
        "criterion": "output noise-to-signal ratio over every calibration token, "
        "tr(dW^T X^T X dW) / tr(W^T X^T X W), of round-to-nearest 4-bit minus per-channel 8-bit "
        "weights, per parameter",
        "layers_4bit": len(ranked) - len(chosen),
        "layers_int8": len(chosen),
        "params_4bit_share": 1.0 if total == 0 else (total - promoted) / total,
        "int8": [r.node for r in chosen],
        "ranking": [
            {
                "node": r.node,
                "params": r.params,
                "error_int4": r.error_int4,
                "error_int8": r.error_int8,
                "signal": r.signal,
                "gain_per_param": r.gain_per_param,
                "int8": r.node in names,
            }
            for r in ranked
        ],
    }
    return FellBack(new_layout, entry)
