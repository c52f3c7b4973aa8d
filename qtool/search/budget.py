"""The budget a mixed-precision plan must meet, read as the evaluation gate of the same name.

`max_drop` counts points of accuracy (or top-1 agreement) lost against float, or the percent
perplexity gained over float's, exactly as `qtool evaluate --max-drop` does; `min_cosine` and
`min_sqnr` are floors on the gated output.
The same limit is also expressed in the analysis' penalty units (scoring.Metric.penalty), where
the knapsack adds the per-node penalties up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtool.errors import RecipeError
from qtool.metrics.results import perplexity_rise
from qtool.metrics.signal import db_from_noise_ratio, noise_ratio_from_db
from qtool.metrics.spec import EvaluationSpec, default_metric
from qtool.search.spec import MixedPrecisionSpec

_GATES = ("max_drop", "min_cosine", "min_sqnr")
_METRIC_OF = {"min_cosine": "cosine", "min_sqnr": "sqnr"}


@dataclass(frozen=True)
class Budget:
    metric: str  # accuracy | agreement | perplexity | cosine | sqnr (scoring.METRICS)
    gate: str  # max_drop | min_cosine | min_sqnr
    limit: float
    source: str  # where the limit was read, for the output

    @property
    def penalty(self) -> float:
        """The limit in penalty units: points (percent for perplexity), 1 - cosine, or
        noise-to-signal power."""
        if self.gate == "max_drop":
            return self.limit
        if self.gate == "min_cosine":
            return max(0.0, 1.0 - self.limit)
        return noise_ratio_from_db(self.limit)

    def holds(self, value: float, float_value: float) -> bool:
        """Whether a measured metric value meets the budget (as the gate would judge it)."""
        if math.isnan(value):
            return False
        if self.gate == "max_drop" and self.metric == "perplexity":
            return perplexity_rise(float_value, value) <= self.limit
        if self.gate == "max_drop":
            return float_value - value <= self.limit
        return value >= self.limit

    def value_at(self, penalty: float, float_value: float) -> float:
        """The metric value a penalty stands for (to print a predicted metric)."""
        if self.metric in ("accuracy", "agreement"):
            return float_value - penalty
        if self.metric == "perplexity":
            return float_value * (1.0 + penalty / 100.0)
        if self.metric == "cosine":
            return 1.0 - penalty
        return db_from_noise_ratio(penalty)

    def describe(self) -> str:
        if self.gate == "max_drop" and self.metric == "perplexity":
            what = f"perplexity rise <= {self.limit:g}%"
        elif self.gate == "max_drop":
            what = f"{self.metric} drop <= {self.limit:g} points"
        elif self.gate == "min_cosine":
            what = f"cosine >= {self.limit:g}"
        else:
            what = f"SQNR >= {self.limit:g} dB"
        return f"{what} ({self.source})"

    def to_dict(self) -> dict:
        return {
            "metric": self.metric,
            "gate": self.gate,
            "limit": self.limit,
            "penalty": self.penalty,
            "source": self.source,
        }


def resolve_budget(
    spec: MixedPrecisionSpec | None, evaluation: EvaluationSpec, labelled: bool, where: str
) -> Budget:
    """The budget of `mixed_precision.budget`, else the first evaluation gate (max_drop, then
    min_cosine, then min_sqnr: the order `qtool analyze` picks its metric in). A max_drop counts
    the budget's metric, else evaluation.metric, else perplexity on text, accuracy with other
    labels and agreement without, as `qtool evaluate` does. `where` names the recipe, for
    errors."""
    if spec is not None and spec.budget is not None:
        budget, source = spec.budget, "mixed_precision.budget"
        metric = budget.metric
    else:
        budget, source, metric = evaluation, "evaluation", None
    gate = next((g for g in _GATES if getattr(budget, g) is not None), None)
    if gate is None:
        raise RecipeError(
            f"{where}: mixed_precision.budget: is required when evaluation: sets no gate "
            "(max_drop, min_cosine or min_sqnr)"
        )
    limit = float(getattr(budget, gate))
    if gate == "max_drop":
        metric = metric or evaluation.metric or default_metric(evaluation.data, labelled)
        if metric in ("accuracy", "perplexity") and not labelled:
            raise RecipeError(
                f"{where}: {source}.max_drop counts {metric}, but the evaluation data has no "
                "labels (set metric: agreement)"
            )
    else:
        metric = _METRIC_OF[gate]
    return Budget(metric, gate, limit, f"{source}.{gate}")
