"""Which rows an output gets: top-1 rows for class scores, cosine and SQNR for everything else.

Top-1 agreement is a fair number only where the argmax is a prediction. On an embedding its
argmax is whichever of 384 near-equal values is largest, and quantization noise far below the
signal flips it (MiniLM INT4: cosine 0.9905, SQNR 17 dB, "83.67% agreement, -16.33 pts"); on a
detector's score tensor most rows are background anchors whose scores tie (64.9 dB SQNR, 40.94%
agreement). A CI gate on such an agreement rejects a near-perfect model. So evaluate decides per
output, from the FP32 values over the whole evaluation set and never from names, in this order:

1. Labels are given for the output: class scores (the user said so).
2. Rank other than 2: dense. One prediction per sample needs [batch, classes]; a per-token,
   per-anchor or per-pixel map's argmax over its last axis is mostly padding or background.
3. Fewer than two columns: dense (no choice to agree on).
4. Every row is non-negative and sums to 1: class scores (softmax probabilities).
5. Every row has unit L2 norm: dense (a normalised embedding).
6. Two columns of raw values: dense (too few values to tell scores from coordinates).
7. Otherwise the top value must stand out of its row: z = (top - mean of the rest) / std of the
   rest, and in the median row z >= STANDOUT_Z gives class scores. Values with no class behind
   them stay within the spread of their row: Gaussian rows reach z of about 3 at 1,000 columns
   and under 5 at 100,000 (a one-sided outlier test); MiniLM's embedding measures 3.0, while
   EfficientNet-Lite0's ImageNet logits measure 9.0. A weak or unconfident classifier without
   labels then falls on the dense side: when unsure, evaluate shows cosine and SQNR, never a
   misleading agreement, and `--rows top1` (or labels) asks for the top-1 rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qtool.metrics.spec import ROWS, TOKEN_ROWS

CLASS_SCORES = "class_scores"
DENSE = "dense"

STANDOUT_Z = 5.0
# Relative tolerance of the unit-norm and sum-to-one tests (float32 softmax / normalize).
UNIT_TOLERANCE = 1e-3


@dataclass(frozen=True)
class OutputKind:
    kind: str  # CLASS_SCORES | DENSE
    evidence: str  # why, in a clause a user can check

    @property
    def is_class(self) -> bool:
        return self.kind == CLASS_SCORES


class KindEvidence:
    """What the FP32 values of one output say about its kind, gathered batch by batch."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] | None = None
        self.probability_rows = True
        self.unit_rows = True
        self.standout: list[np.ndarray] = []  # per-row z, rank-2 outputs of >= 3 columns

    def update(self, values: np.ndarray) -> None:
        self.shape = tuple(values.shape)
        if values.ndim != 2 or values.shape[1] < 2 or values.shape[0] == 0:
            return
        rows = np.asarray(values, np.float64)
        sums = rows.sum(axis=1)
        if self.probability_rows:
            self.probability_rows = bool(
                rows.min() >= 0 and np.all(np.abs(sums - 1.0) <= UNIT_TOLERANCE)
            )
        if self.unit_rows:
            norms = np.linalg.norm(rows, axis=1)
            self.unit_rows = bool(np.all(np.abs(norms - 1.0) <= UNIT_TOLERANCE))
        if rows.shape[1] >= 3:
            self.standout.append(_standout(rows, sums))

    def decide(self, labelled: bool) -> OutputKind:
        if labelled:
            return OutputKind(CLASS_SCORES, "labels are given for it")
        # the first axis is the batch: its size varies from batch to batch
        dims = () if self.shape is None else ("N", *map(str, self.shape[1:]))
        shape = "[" + ", ".join(dims[: len(self.shape or ())]) + "]"
        if self.shape is None or len(self.shape) != 2:
            return OutputKind(
                DENSE, f"shape {shape} is not [batch, classes]: no single prediction per sample"
            )
        columns = self.shape[1]
        if columns < 2:
            return OutputKind(DENSE, f"shape {shape}: one column, no class to choose")
        if self.probability_rows:
            return OutputKind(CLASS_SCORES, "its rows are probabilities (>= 0, summing to 1)")
        if self.unit_rows:
            return OutputKind(DENSE, "its rows have unit L2 norm: a normalised embedding")
        if columns == 2:
            return OutputKind(DENSE, "two raw columns: too few to tell scores from coordinates")
        z = float(np.median(np.concatenate(self.standout)))
        if z >= STANDOUT_Z:
            return OutputKind(
                CLASS_SCORES, f"its top value stands out of its row (median z {z:.1f})"
            )
        shown = "inf" if math.isinf(z) else f"{z:.1f}"
        return OutputKind(
            DENSE,
            f"no value stands out of its row (median z {shown} < {STANDOUT_Z:g}): "
            "an embedding or other dense values",
        )


def _standout(rows: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """Per row: how many standard deviations of the other values the top value lies above
    their mean (inf when the others are all equal and the top is above them)."""
    top = rows.max(axis=1)
    rest = rows.shape[1] - 1
    mean = (sums - top) / rest
    deviation = rows - mean[:, None]  # centred first: logits with a large common offset stay exact
    spread = np.sum(deviation * deviation, axis=1) - (top - mean) ** 2
    std = np.sqrt(np.maximum(spread / rest, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (top - mean) / std
    return np.where(std > 0, z, np.where(top > mean, np.inf, 0.0))


# The kind of an output scored on next-token labels (metrics/tokens.py): a decoder's logits.
NEXT_TOKEN_EVIDENCE = "next-token labels are given for it"


def default_rows(kind: OutputKind, labelled: bool, tokens: bool = False) -> tuple[str, ...]:
    """The rows of an output nobody asked rows for: next-token scores get perplexity, top-1
    agreement and KL; class scores get accuracy (with labels) and top-1 agreement; all get SQNR
    and cosine; dense outputs get SQNR and cosine only."""
    if tokens:
        return ("perplexity", "top1", "kl", "sqnr", "cosine")
    if not kind.is_class:
        return ("sqnr", "cosine")
    return ("accuracy", "top1", "sqnr", "cosine") if labelled else ("top1", "sqnr", "cosine")


def chosen_rows(requested: Sequence[str], labelled: bool, tokens: bool = False) -> tuple[str, ...]:
    """The rows a user asked for, in table order; accuracy only where labels belong, perplexity
    and KL only where they are next-token labels."""
    return tuple(
        r
        for r in ROWS
        if r in requested and (r != "accuracy" or labelled) and (r not in TOKEN_ROWS or tokens)
    )
