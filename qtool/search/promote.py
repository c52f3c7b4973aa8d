"""Verify and promote: the knapsack's plan measured on the evaluation set, corrected until it
meets the budget.

The knapsack adds one-at-a-time penalties; real errors are not always additive (two layers
rounding the same way add their errors coherently, a subset of the evaluation data can miss
what the whole set shows), so every plan is built and scored exactly as `qtool evaluate` gates
it (fused, the gated output, the full evaluation set). When a plan misses, the most sensitive
node that can still move is promoted one step among its candidates (int4 -> fp8 -> int8 -> bf16
-> fp16 -> float) and the plan is scored again, at most `max_iterations` plans in all. A promotion
only adds bytes, so once a plan that misses is no smaller than a uniform reference that passes
(`ceiling`), promoting further cannot beat that reference and the loop stops (reference.py then
takes the reference).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from qtool.metrics.signal import noise_ratio_from_db
from qtool.search.budget import Budget
from qtool.search.candidates import ORDER, step_up
from qtool.search.knapsack import Choice
from qtool.search.penalties import PenaltyScale
from qtool.search.result import SensitivityResult


@dataclass(frozen=True)
class Measured:
    """One plan built and scored: the metric's value and penalty, SQNR, cosine, file bytes."""

    value: float
    penalty: float
    sqnr_db: float
    cosine: float
    size: int


@dataclass
class Iteration:
    index: int  # 1-based
    action: str  # what changed from the previous plan
    precisions: dict[str, str]  # node -> precision
    predicted_penalty: float  # in the budget's unit (PenaltyScale.predicted of the sum)
    predicted_size: int
    measured: Measured
    passed: bool
    seconds: float
    knapsack_penalty: float = 0.0  # the summed penalties, in the knapsack's unit
    pass_probability: float | None = None  # max_drop: the flip model's P(the gate passes)

    def counts(self) -> dict[str, int]:
        counted = Counter(self.precisions.values())
        return {p: counted[p] for p in ORDER if counted[p]}


@dataclass
class SearchResult:
    iterations: list[Iteration] = field(default_factory=list)
    reason: str | None = None  # why no plan met the budget; None when one did
    choice: int | None = None  # position in `iterations` of the passing plan chosen
    reference: str | None = None  # the uniform reference chosen ("int8", "int4"), if one was

    @property
    def passed(self) -> bool:
        return self.reason is None

    @property
    def chosen(self) -> Iteration:
        """The passing plan chosen, else the best one measured (least penalty, then smallest)."""
        if self.choice is not None:
            return self.iterations[self.choice]
        return min(self.iterations, key=lambda it: (it.measured.penalty, it.measured.size))


def predicted_penalty(options: Mapping[str, Sequence[Choice]], plan: Mapping[str, str]) -> float:
    """The knapsack's sum (negative penalties count 0, as the solver counts them)."""
    total = 0.0
    for node, precision in plan.items():
        choice = next(c for c in options[node] if c.precision == precision)
        total += max(choice.penalty, 0.0)
    return total


def predicted_size(
    options: Mapping[str, Sequence[Choice]], plan: Mapping[str, str], float_size: float
) -> int:
    """`float_size` (the prediction with every planned node float: sizes.SizeModel.all_float)
    minus each node's float bytes plus its bytes at the chosen precision (a node with no float
    choice, left to the recipe, is in `float_size` at its precision already)."""
    size = float(float_size)
    for node, precision in plan.items():
        by_precision = {c.precision: c.cost for c in options[node]}
        size += by_precision[precision] - by_precision.get("float", by_precision[precision])
    return int(round(size))


def _noise(analysis: SensitivityResult, node: str, precision: str) -> float:
    measured = analysis.node(node).one_at_a_time.get(precision)
    if measured is None or measured.skipped is not None or math.isnan(measured.sqnr_db):
        return 0.0
    return noise_ratio_from_db(measured.sqnr_db)


def next_promotion(
    plan: Mapping[str, str],
    options: Mapping[str, Sequence[Choice]],
    analysis: SensitivityResult,
    promotions: Counter,
) -> tuple[str, str] | None:
    """(node, precision it moves to): among the nodes that can still move, the one promoted
    least often so far, then the largest knapsack penalty at its current precision (continuous:
    the margin noise for a max_drop budget), then the largest output noise with it alone at that
    precision, then the analysis' ranking."""
    rank = {node.name: i for i, node in enumerate(analysis.ranking())}
    allowed = {node: [c.precision for c in choices] for node, choices in options.items()}
    movable = [n for n in plan if step_up(plan[n], allowed[n]) is not None]
    if not movable:
        return None

    def key(node: str):
        penalty = next(c.penalty for c in options[node] if c.precision == plan[node])
        return (
            promotions[node],
            -penalty,
            -_noise(analysis, node, plan[node]),
            rank[node],
        )

    node = min(movable, key=key)
    return node, step_up(plan[node], allowed[node])


def measure_iteration(
    index: int,
    action: str,
    plan: Mapping[str, str],
    options: Mapping[str, Sequence[Choice]],
    sizes: Mapping[str, Sequence[Choice]],
    scale: PenaltyScale,
    budget: Budget,
    float_value: float,
    float_size: float,
    measure: Callable[[Mapping[str, str]], Measured],
) -> Iteration:
    """Build and score `plan` (measure) beside what the knapsack's numbers predicted for it."""
    begin = time.perf_counter()
    measured = measure(plan)
    total = predicted_penalty(options, plan)
    return Iteration(
        index,
        action,
        dict(plan),
        scale.predicted(total),
        predicted_size(sizes, plan, float_size),
        measured,
        budget.holds(measured.value, float_value),
        time.perf_counter() - begin,
        total,
        scale.pass_probability(total),
    )


def verify_and_promote(
    start: Mapping[str, str],
    options: Mapping[str, Sequence[Choice]],
    analysis: SensitivityResult,
    budget: Budget,
    scale: PenaltyScale,
    float_value: float,
    float_size: float,
    measure: Callable[[Mapping[str, str]], Measured],
    max_iterations: int,
    first_action: str,
    report: Callable[[Iteration], None] = lambda it: None,
    sizes: Mapping[str, Sequence[Choice]] | None = None,
    ceiling: tuple[int, str] | None = None,
) -> SearchResult:
    """Score `start`, then promote and score again until the budget holds or no more plans may
    be tried. `measure(plan)` builds and scores a plan; `report` is called after each.
    `sizes`: the choices priced in bytes, where `options` price another objective (latency);
    `float_size`: the predicted bytes with every planned node float (SizeModel.all_float).
    `ceiling`: (bytes, name) of the smallest uniform reference that passes, if any."""
    sizes = options if sizes is None else sizes
    plan = dict(start)
    promotions: Counter = Counter()
    result = SearchResult()
    action = first_action
    for index in range(1, max_iterations + 1):
        iteration = measure_iteration(
            index, action, plan, options, sizes, scale, budget, float_value, float_size, measure
        )
        measured = iteration.measured
        result.iterations.append(iteration)
        report(iteration)
        if iteration.passed:
            result.choice = len(result.iterations) - 1
            return result
        if ceiling is not None and measured.size >= ceiling[0]:
            result.reason = (
                f"plan {index} misses the budget ({budget.describe()}) at {measured.size} bytes, "
                f"no smaller than the {ceiling[1]} reference ({ceiling[0]} bytes), which passes: "
                "promotions only add bytes"
            )
            return result
        promotion = next_promotion(plan, options, analysis, promotions)
        if promotion is None:
            result.reason = (
                f"no plan met the budget ({budget.describe()}): every node is at its most "
                f"precise candidate and the model measures {_value(budget, measured.value)}"
            )
            return result
        node, precision = promotion
        action = f"promoted {node} {plan[node]} -> {precision}"
        plan[node] = precision
        promotions[node] += 1
    best = result.chosen
    result.reason = (
        f"no plan met the budget ({budget.describe()}) within mixed_precision.max_iterations "
        f"({max_iterations}); the best measured {_value(budget, best.measured.value)} "
        f"(iteration {best.index})"
    )
    return result


def _value(budget: Budget, value: float) -> str:
    if budget.metric in ("accuracy", "agreement"):
        return f"{budget.metric} {value:.2f}%"
    if budget.metric == "perplexity":
        return f"perplexity {value:.3f}"
    if budget.metric == "cosine":
        return f"cosine {value:.5f}"
    return f"SQNR {value:.2f} dB"
