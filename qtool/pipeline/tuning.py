"""The recipe's `tuning:` section: which rows the data-driven choices are scored on, and whether
the model the recipe's algorithms and range method make must beat plain min-max there.

The discipline (docs/recipe.md, "tuning"): calibration rows are what ranges and algorithms fit
on; tuning rows are what every choice is scored on (SmoothQuant's alpha, AdaRound's and bias
correction's keep rules, the model-level comparison below); the evaluation set is what the user
reports. The three are disjoint. Without `tuning.data`, the tuning rows are a deterministic part
of the calibration set that calibration then does not read (qtool/data/split.py); that split is
taken only when something is scored on it, so a plain min-max recipe calibrates on every sample
as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtool.algorithms.spec import Algorithms
from qtool.data.spec import DataSpec

BASELINES = ("minmax", "none")
# Without tuning.data: every EVERY-th calibration sample is a tuning row, up to MAX_SAMPLES rows.
# 1 in 4 keeps three quarters of a small calibration set for the ranges; 128 rows score a choice
# to well under 0.1 dB of noise on the models measured (benchmarks/README.md, "Held-out") while
# the rest of a large set still calibrates.
EVERY = 4
MAX_SAMPLES = 128
MAX_EVERY = 1000
# Algorithms that score their choices on the tuning rows (CLE makes none: it is exact, or
# bounded by calibration maxima through a Clip).
SCORED_ALGORITHMS = ("smoothquant", "adaround", "bias_correction")


@dataclass(frozen=True)
class TuningSpec:
    """`tuning:`: a separate source (`data`), or the split of the calibration set (`every`);
    at most `max_samples` tuning rows, read in `batch_size` batches; `baseline` "minmax": keep
    the recipe's model only where it beats plain min-max on the tuning rows."""

    data: DataSpec | None = None
    every: int = EVERY
    max_samples: int = MAX_SAMPLES
    batch_size: int = 32
    baseline: str = "minmax"


def compares_with_minmax(algorithms: Algorithms, method: str, tuning: TuningSpec) -> bool:
    """Whether the build also makes the plain min-max model and keeps the better one: when the
    recipe's model differs from it by a range method or an algorithm of the build stage
    (cross-layer equalization changes the float model both are built from)."""
    if tuning.baseline != "minmax":
        return False
    built_differently = any(getattr(algorithms, name) is not None for name in SCORED_ALGORITHMS)
    return built_differently or method != "minmax"


def gate_score(
    max_drop: float | None,
    min_cosine: float | None,
    min_sqnr: float | None,
    metric: str | None,
    output: str | None,
) -> TuningScore:
    """The evaluation gate's metric (max_drop, else min_cosine, else min_sqnr, the order the
    mixed-precision budget takes them in), or output SQNR without a gate."""
    if max_drop is not None:
        return TuningScore("accuracy" if metric == "accuracy" else "agreement", output)
    if min_cosine is not None:
        return TuningScore("cosine", output)
    return TuningScore("sqnr", output)


def uses_tuning_rows(algorithms: Algorithms, method: str, tuning: TuningSpec) -> bool:
    """Whether anything is scored on tuning rows (only then is the calibration set split)."""
    scored = any(getattr(algorithms, name) is not None for name in SCORED_ALGORITHMS)
    return scored or compares_with_minmax(algorithms, method, tuning)


SCORE_METRICS = ("sqnr", "cosine", "agreement", "accuracy")


@dataclass(frozen=True)
class TuningScore:
    """What the model-level comparison measures on the tuning rows: the evaluation gate's
    metric on its output (`sqnr` in dB, mean row `cosine`, top-1 `agreement` with FP32, or
    `accuracy` against the tuning rows' labels); higher is better for each. Without a gate:
    output SQNR. `output` None: the model's first output."""

    metric: str = "sqnr"
    output: str | None = None
