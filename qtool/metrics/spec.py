"""The evaluation set and the CI gates judged on it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtool.data.spec import DataSpec

# What `evaluation.metric` / `--metric` may name: the number `max_drop` is measured in.
GATE_METRICS = ("accuracy", "agreement")
# The metric rows `evaluation.rows` / `--rows` may ask for, in table order (metrics/kinds.py
# chooses them by output kind when none are asked for).
ROWS = ("accuracy", "top1", "sqnr", "cosine")


@dataclass(frozen=True)
class EvaluationSpec:
    """The evaluation set and the CI gates; every gate is judged on one output (`output`)."""

    data: DataSpec
    batch_size: int = 64
    output: str | None = None  # None: the model's first output
    metric: str | None = None  # None: accuracy with labels, else top-1 agreement
    max_drop: float | None = None  # points of `metric` the quantized model may lose
    min_cosine: float | None = None
    min_sqnr: float | None = None
    # MatMulNBits' compute type for the fused session (qtool/runtime/low_bit.py); None: ORT's.
    accuracy_level: int | None = None
    rows: tuple[str, ...] | None = None  # None: by output kind (metrics/kinds.py)


def gate_problem(key: str, value: float) -> str | None:
    """Why a gate value is unusable, or None; shared by the recipe and the CLI so that
    `evaluation.max_drop: -1` and `--max-drop -1` are refused with the same words.

    NaN compares false with everything, so an unchecked NaN limit would pass every model.
    """
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if key == "max_drop" and value < 0:
        return f"must be >= 0 (points of accuracy or agreement lost), got {value}"
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
