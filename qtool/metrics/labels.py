"""Top-1 accuracy against labels, accumulated batch by batch.

Kept apart from the signal-quality accumulator (metrics/signal.py): that one compares a tensor
with a reference tensor, this one a tensor's argmax with ground truth the user supplied.
"""

from __future__ import annotations

import numpy as np


class LabelAccuracy:
    """Correct top-1 predictions (argmax over the last axis) against class-index labels.

    A negative label marks a position with nothing to predict (the text source's IGNORE_LABEL,
    PyTorch's ignore_index) and is not counted."""

    def __init__(self) -> None:
        self.correct = 0
        self.predictions = 0

    def update(self, output: np.ndarray, labels: np.ndarray) -> None:
        top = np.argmax(output, axis=-1)
        counted = np.asarray(labels) >= 0
        self.correct += int(np.count_nonzero((top == labels) & counted))
        self.predictions += int(np.count_nonzero(counted))

    def value(self) -> float | None:
        """The fraction correct; None before any prediction."""
        return self.correct / self.predictions if self.predictions else None
