"""The mixed-precision solver against brute force on small instances."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from qtool.search.knapsack import Choice, solve


def _brute(options, budget):
    best = None
    names = list(options)
    for combo in itertools.product(*(options[n] for n in names)):
        penalty = sum(max(c.penalty, 0.0) for c in combo)
        if penalty > budget + 1e-12:
            continue
        cost = sum(c.cost for c in combo)
        if best is None or cost < best[0] - 1e-12:
            best = (cost, combo)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_grid_aligned_penalties(seed):
    rng = np.random.default_rng(seed)
    budget = 1.0
    options = {}
    for i in range(rng.integers(2, 7)):
        # float (no penalty, full cost), int8, int4; penalties on the solver's grid
        p8, p4 = sorted(rng.integers(0, 400, size=2) / 1000)
        options[f"n{i}"] = [
            Choice("float", 4.0, 0.0),
            Choice("int8", 1.0, float(p8)),
            Choice("int4", 0.5, float(p4)),
        ]
    plan = solve(options, budget, resolution=1000)
    expected = _brute(options, budget)
    assert plan is not None and expected is not None
    assert math.isclose(sum(c.cost for c in plan.values()), expected[0])
    assert sum(c.penalty for c in plan.values()) <= budget + 1e-9


def test_accepted_plans_meet_the_budget_with_unrounded_penalties():
    rng = np.random.default_rng(7)
    options = {
        f"n{i}": [Choice("float", 4, 0.0), Choice("int8", 1, float(rng.uniform(0, 0.3)))]
        for i in range(30)
    }
    plan = solve(options, 1.0, resolution=50)
    assert sum(c.penalty for c in plan.values()) <= 1.0


def test_infeasible_budget_returns_none_and_zero_budget_keeps_only_free_choices():
    options = {"a": [Choice("int8", 1, 0.5)], "b": [Choice("float", 4, 0.0)]}
    assert solve(options, 0.4) is None
    plan = solve({"a": [Choice("float", 4, 0.0), Choice("int8", 1, 0.2)]}, 0.0)
    assert plan == {"a": Choice("float", 4, 0.0)}


def test_negative_penalties_are_not_spent_and_order_is_deterministic():
    options = {
        "a": [Choice("float", 4, 0.0), Choice("int8", 1, -0.5)],
        "b": [Choice("float", 4, 0.0), Choice("int8", 1, 0.6)],
    }
    plan = solve(options, 0.5)
    assert plan["a"].precision == "int8" and plan["b"].precision == "float"
    assert solve(options, 0.5) == plan
    with pytest.raises(ValueError):
        solve(options, -1.0)


def test_an_infinite_penalty_never_fits_and_a_zero_budget_admits_no_positive_penalty():
    options = {
        "broken": [Choice("float", 4, 0.0), Choice("int8", 1, math.inf)],
        "tiny": [Choice("float", 4, 0.0), Choice("int8", 1, 1e-12)],
    }
    plan = solve(options, 1.0)
    assert plan["broken"].precision == "float" and plan["tiny"].precision == "int8"
    zero = solve(options, 0.0)
    assert zero["broken"].precision == "float" and zero["tiny"].precision == "float"
    with pytest.raises(ValueError, match="NaN"):
        solve({"a": [Choice("int8", 1, math.nan)]}, 1.0)
