"""Multiple-choice knapsack: one precision per node, least total cost, predicted drop in budget.

Each node offers a few choices (float, int8, int4), each with a cost to minimise (bytes of the
model, or measured milliseconds) and a predicted penalty (the metric drop the sensitivity analysis
measured for that node at that precision). The sum of the penalties must stay within the budget.

Solved exactly by dynamic programming over the penalty axis. Penalties are rounded *up* to a grid
of `budget / resolution`, so every plan the solver accepts also meets the budget with the true
(unrounded) penalties; the least-cost plan on the grid is found exactly (ties broken by node and
choice order, so the answer is deterministic). Negative penalties (a node that measured better
quantized) count as 0: additivity is an assumption the verify loop checks, not a gift to spend.
An infinite penalty (a variant whose output broke) never fits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    precision: str
    cost: float
    penalty: float


def _steps(penalty: float, unit: float, capacity: int) -> int:
    """Grid steps `penalty` takes, rounded up; capacity + 1 (never fits) when it is infinite."""
    if math.isnan(penalty):
        raise ValueError("a penalty is NaN")
    if penalty <= 0:
        return 0
    if capacity == 0 or math.isinf(penalty) or penalty / unit - 1e-9 > capacity:
        return capacity + 1  # a zero budget admits only penalties <= 0, however small
    return math.ceil(penalty / unit - 1e-9)


def solve(
    options: Mapping[str, Sequence[Choice]], budget: float, resolution: int = 1000
) -> dict[str, Choice] | None:
    """The least-cost choice per node with (rounded-up) penalties summing to <= budget, or None
    when even the lowest-penalty choices exceed it."""
    if budget < 0 or not math.isfinite(budget):
        raise ValueError(f"budget must be a finite number >= 0, got {budget}")
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    names = list(options)
    for name in names:
        if not options[name]:
            raise ValueError(f"node {name!r} has no choice")
    unit = budget / resolution if budget > 0 else 1.0
    capacity = resolution if budget > 0 else 0
    inf = math.inf
    # best[c] = least cost with used steps exactly c; picks[i][c] = choice index taken at node i.
    best = [0.0] + [inf] * capacity
    picks: list[list[int]] = []
    for name in names:
        new = [inf] * (capacity + 1)
        taken = [-1] * (capacity + 1)
        for index, choice in enumerate(options[name]):
            steps = _steps(choice.penalty, unit, capacity)
            if steps > capacity:
                continue
            for used in range(capacity - steps + 1):
                if best[used] == inf:
                    continue
                total = best[used] + choice.cost
                if total < new[used + steps]:
                    new[used + steps] = total
                    taken[used + steps] = index
        best = new
        picks.append(taken)
    finite = [(cost, used) for used, cost in enumerate(best) if cost < inf]
    if not finite:
        return None
    _, used = min(finite)
    plan: dict[str, Choice] = {}
    for position in range(len(names) - 1, -1, -1):
        name = names[position]
        choice = options[name][picks[position][used]]
        plan[name] = choice
        used -= _steps(choice.penalty, unit, capacity)
    return {name: plan[name] for name in names}
