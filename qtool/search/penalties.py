"""The knapsack's penalties: what each node's measurements add up to, and what a sum means in
the budget's own unit.

- `min_cosine` and `min_sqnr` budgets: the analysis' penalties as measured (1 - cosine, the
  noise-to-signal ratio). They are continuous and add up across nodes already, so the knapsack
  adds them and compares the sum with the budget's limit.
- `max_drop` budgets on perplexity (percent gained over float): continuous too, added the same
  way (a node that measured better quantized counts as 0 in the knapsack). They went through the
  flip model below until 2026-12-07, where a perplexity score has no margin noise (NaN), so every
  quantized choice counted as infinite and the knapsack kept every node float.
- `max_drop` budgets (points of accuracy or top-1 agreement): a step metric, whose one-at-a-time
  drop on the analysis subset is usually exactly 0 (no prediction changed), which the knapsack
  used to read as free. Each choice's penalty is instead a margin noise (flips.py): the larger of
  the noise the node measured and the noise that would explain the drop it was seen to cause
  (so an observed change of predictions is never discounted). The knapsack adds the noises and
  compares the sum with the noise at which the gate, on the evaluation set's float margins, is
  more likely to pass than not (flips.FlipModel.capacity); the predicted drop of a plan, in
  points, is the flip model's expected drop for its summed noise, beside the probability that
  the gate passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qtool.search.budget import Budget
from qtool.search.flips import FlipModel
from qtool.search.result import SensitivityResult

# The metrics that move in steps (a prediction changes or not): their max_drop budgets are priced
# by the flip model; every other penalty is continuous and adds up as measured.
STEP_METRICS = ("accuracy", "agreement")


@dataclass(frozen=True)
class PenaltyScale:
    """How the knapsack adds penalties (`unit`), its capacity in that unit (inf: the budget
    admits every plan the model can predict), and with a max_drop budget the flip model that
    converts between margin noise and points."""

    unit: str
    capacity: float
    flips: FlipModel | None = None
    limit: float = 0.0  # the budget's limit (max_drop points), for pass_probability

    def penalty(self, analysis: SensitivityResult, node: str, precision: str) -> float | None:
        """The knapsack penalty of `node` at `precision` (0 for float; None when unmeasured).
        A NaN measurement (a variant whose output held NaN) counts as infinite: that choice
        cannot fit any budget."""
        step = analysis.penalty(node, precision)
        if step is None:
            return None
        if math.isnan(step):
            return math.inf
        if self.flips is None:
            return step
        noise = analysis.margin_noise(node, precision)
        if noise is None:
            return None
        if math.isnan(noise):
            return math.inf
        return max(noise, self.flips.noise_for(step))

    def predicted(self, total: float) -> float:
        """The budget-unit penalty (points, 1 - cosine, noise ratio) a summed penalty predicts."""
        if self.flips is None:
            return total
        return self.flips.expected_drop(total)

    def pass_probability(self, total: float) -> float | None:
        """With a max_drop budget, the flip model's probability that the gate passes at the
        summed noise `total`; None for additive budgets (no model of the gate)."""
        if self.flips is None:
            return None
        return self.flips.pass_probability(total, self.limit)

    def to_dict(self) -> dict:
        entry: dict = {
            "unit": self.unit,
            "capacity": self.capacity if math.isfinite(self.capacity) else "inf",
        }
        if self.flips is not None:
            entry["flip_model"] = self.flips.describe()
            entry["admitted_changes"] = self.flips.admitted(self.limit)
        return entry


def penalty_scale(
    budget: Budget, reference: Sequence[np.ndarray], labels: Sequence[np.ndarray] | None
) -> PenaltyScale:
    """The scale for `budget`; `reference` and `labels` are the float model's gated output and
    the labels (accuracy only) on the evaluation set, batch by batch."""
    if budget.gate != "max_drop" or budget.metric not in STEP_METRICS:
        return PenaltyScale(f"{budget.metric} penalty (additive)", budget.penalty)
    flips = FlipModel.from_outputs(reference, labels if budget.metric == "accuracy" else None)
    capacity = flips.capacity(budget.limit)
    return PenaltyScale("top-1 margin noise", capacity, flips, budget.limit)
