"""The evaluation set and the CI gates judged on it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtool.data.spec import DataSpec

# What `evaluation.metric` / `--metric` may name: the number `max_drop` is measured in (points
# of accuracy or top-1 agreement lost; for perplexity, percent gained over FP32's).
GATE_METRICS = ("accuracy", "agreement", "perplexity")
# The metric rows `evaluation.rows` / `--rows` may ask for, in table order (metrics/kinds.py
# chooses them by output kind when none are asked for). perplexity and kl need next-token labels.
ROWS = ("accuracy", "perplexity", "top1", "kl", "sqnr", "cosine")
TOKEN_ROWS = ("perplexity", "kl")


@dataclass(frozen=True)
class EvaluationSpec:
    """The evaluation set and the CI gates; every gate is judged on one output (`output`)."""

    data: DataSpec
    batch_size: int = 64
    output: str | None = None  # None: the model's first output
    metric: str | None = None  # None: default_metric()
    max_drop: float | None = None  # points of `metric` the quantized model may lose
    min_cosine: float | None = None
    min_sqnr: float | None = None
    # MatMulNBits' compute type for the fused session (qtool/runtime/low_bit.py); None: ORT's.
    accuracy_level: int | None = None
    rows: tuple[str, ...] | None = None  # None: by output kind (metrics/kinds.py)


def default_metric(data: DataSpec, labelled: bool) -> str:
    """What max_drop counts when no metric is named: perplexity on text (its labels are the
    next tokens), accuracy with other labels, top-1 agreement without."""
    if data.text is not None:
        return "perplexity"
    return "accuracy" if labelled else "agreement"


def gate_problem(key: str, value: float) -> str | None:
    """Why a gate value is unusable, or None; shared by the recipe and the CLI so that
    `evaluation.max_drop: -1` and `--max-drop -1` are refused with the same words.

    NaN compares false with everything, so an unchecked NaN limit would pass every model.
    """
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if key == "max_drop" and value < 0:
        return (
            "must be >= 0 (points of accuracy or agreement lost, or percent of perplexity "
            f"gained), got {value}"
        )
    if key == "min_cosine" and not -1.0 <= value <= 1.0:
        return f"must be in [-1, 1], got {value}"
    return None


def rows_problem(rows: tuple[str, ...]) -> str | None:
    """Why a list of rows is unusable, or None; shared by `evaluation.rows` and `--rows`."""
    if not rows:
        return f"must name at least one of {', '.join(ROWS)}"
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        return f"must be among {', '.join(ROWS)}, got {unknown[0]!r}"
    return None
