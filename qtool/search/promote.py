"""Verify and promote: the knapsack's plan measured on the evaluation set, corrected until it
meets the budget.

The knapsack adds one-at-a-time penalties; real errors are not always additive (two layers
rounding the same way add their errors coherently, a subset of the evaluation data can miss
what the whole set shows), so every plan is built and scored exactly as `qtool evaluate` gates
it (fused, the gated output, the full evaluation set). When a plan misses, the most sensitive
node that can still move is promoted one step (int4 -> int8 -> float) and the plan is scored
again, at most `max_iterations` plans in all.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from qtool.metrics.signal import noise_ratio_from_db
from qtool.search.budget import Budget
from qtool.search.candidates import step_up
from qtool.search.knapsack import Choice
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
    predicted_penalty: float
    predicted_size: int
    measured: Measured
    passed: bool
    seconds: float

    def counts(self) -> dict[str, int]:
        counted = Counter(self.precisions.values())
        return {p: counted[p] for p in ("int4", "int8", "float") if counted[p]}


@dataclass
class SearchResult:
    iterations: list[Iteration] = field(default_factory=list)
    reason: str | None = None  # why no plan met the budget; None when one did

    @property
    def passed(self) -> bool:
        return self.reason is None

    @property
    def chosen(self) -> Iteration:
        """The passing plan, else the best one measured (least penalty, then smallest)."""
        if self.passed:
            return self.iterations[-1]
        return min(self.iterations, key=lambda it: (it.measured.penalty, it.measured.size))


def predicted_penalty(options: Mapping[str, Sequence[Choice]], plan: Mapping[str, str]) -> float:
    """The knapsack's sum (negative penalties count 0, as the solver counts them)."""
    total = 0.0
    for node, precision in plan.items():
        choice = next(c for c in options[node] if c.precision == precision)
        total += max(choice.penalty, 0.0)
    return total


def predicted_size(
    options: Mapping[str, Sequence[Choice]], plan: Mapping[str, str], float_size: int
) -> int:
    """The float file minus each node's float bytes plus its bytes at the chosen precision."""
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
    allowed: Mapping[str, Sequence[str]],
    analysis: SensitivityResult,
    promotions: Counter,
) -> tuple[str, str] | None:
    """(node, precision it moves to): among the nodes that can still move, the one promoted
    least often so far, then the largest penalty at its current precision, then the largest
    output noise with it alone at that precision, then the analysis' ranking."""
    rank = {node.name: i for i, node in enumerate(analysis.ranking())}
    movable = [n for n in plan if step_up(plan[n], allowed[n]) is not None]
    if not movable:
        return None

    def key(node: str):
        penalty = analysis.penalty(node, plan[node])
        return (
            promotions[node],
            -(penalty if penalty is not None else 0.0),
            -_noise(analysis, node, plan[node]),
            rank[node],
        )

    node = min(movable, key=key)
    return node, step_up(plan[node], allowed[node])


def verify_and_promote(
    start: Mapping[str, str],
    options: Mapping[str, Sequence[Choice]],
    analysis: SensitivityResult,
    budget: Budget,
    float_value: float,
    float_size: int,
    measure: Callable[[Mapping[str, str]], Measured],
    max_iterations: int,
    first_action: str,
    report: Callable[[Iteration], None] = lambda it: None,
    sizes: Mapping[str, Sequence[Choice]] | None = None,
) -> SearchResult:
    """Score `start`, then promote and score again until the budget holds or no more plans may
    be tried. `measure(plan)` builds and scores a plan; `report` is called after each.
    `sizes`: the choices priced in bytes, where `options` price another objective (latency)."""
    sizes = options if sizes is None else sizes
    allowed = {node: [c.precision for c in choices] for node, choices in options.items()}
    plan = dict(start)
    promotions: Counter = Counter()
    result = SearchResult()
    action = first_action
    for index in range(1, max_iterations + 1):
        begin = time.perf_counter()
        measured = measure(plan)
        passed = budget.holds(measured.value, float_value)
        iteration = Iteration(
            index,
            action,
            dict(plan),
            predicted_penalty(options, plan),
            predicted_size(sizes, plan, float_size),
            measured,
            passed,
            time.perf_counter() - begin,
        )
        result.iterations.append(iteration)
        report(iteration)
        if passed:
            return result
        promotion = next_promotion(plan, allowed, analysis, promotions)
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
