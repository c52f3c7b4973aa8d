"""What the mixed-precision search minimises and the accuracy budget it must keep."""

from __future__ import annotations

from dataclasses import dataclass

# mixed_precision: what the search minimises, and the precisions it may give a node.
MIXED_OBJECTIVES = ("size", "latency")

MIXED_METRICS = ("accuracy", "agreement", "perplexity", "cosine", "sqnr")


@dataclass(frozen=True)
class BudgetSpec:
    """The metric drop a mixed-precision plan may cost: exactly one limit is set, read as the
    evaluation gate of the same name reads it (max_drop in points of accuracy or agreement, or
    in percent of perplexity gained)."""

    # None: perplexity on text, accuracy with other labels, else agreement (max_drop only)
    metric: str | None = None
    max_drop: float | None = None
    min_cosine: float | None = None
    min_sqnr: float | None = None


@dataclass(frozen=True)
class MixedPrecisionSpec:
    """`mixed_precision:` (qtool/mixed/): minimise `objective` within `budget`.

    None fields come from elsewhere: `budget` from the evaluation gates, `candidates` from the
    target (qtool/mixed/candidates.py)."""

    objective: str = "size"
    budget: BudgetSpec | None = None
    candidates: tuple[str, ...] | None = None
    max_iterations: int = 8
    samples: int = 128  # evaluation samples the sensitivity analysis scores on
