"""The deterministic split of one data source into calibration rows and tuning rows.

Every data-driven choice qtool makes (SmoothQuant's alpha, AdaRound's and bias correction's keep
rules, the model-level comparison with plain min-max) is scored on rows the thing it scores was
not fitted on: ranges are fitted on the calibration rows, and a choice judged on those same rows
rewards fitting them (an activation range that exactly covers the rows it came from never
clips them; a rounding learned on them always looks better there). When the recipe gives no
separate tuning set, the calibration set is split: sample i (its position in the source, before
any batching) is a tuning row when `i % every == every - 1`, for the first `limit` such samples;
every other sample is a calibration row. The rule depends only on the sample's position, so both
parts are the same for any batch size and any chunking of the source, and every later sample
(past the `limit`-th tuning row) calibrates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PARTS = ("calibration", "tuning")


@dataclass(frozen=True)
class SampleSplit:
    """Which part of a source's samples a reader yields (`part`), by the rule above."""

    every: int
    limit: int
    part: str

    def __post_init__(self) -> None:
        if self.every < 2:
            raise ValueError(f"every must be >= 2, got {self.every}")
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {self.part!r}")

    def tuning_mask(self, indices: np.ndarray) -> np.ndarray:
        """Whether each source sample index is a tuning row."""
        indices = np.asarray(indices, np.int64)
        return (indices % self.every == self.every - 1) & (indices // self.every < self.limit)

    def selects(self, indices: np.ndarray) -> np.ndarray:
        """Whether each source sample index belongs to this part."""
        tuning = self.tuning_mask(indices)
        return tuning if self.part == "tuning" else ~tuning

    def count(self, total: int) -> int:
        """How many of the first `total` source samples belong to this part."""
        tuning = min(total // self.every, self.limit)
        return tuning if self.part == "tuning" else total - tuning

    def other(self) -> SampleSplit:
        """The complementary part of the same split."""
        part = "tuning" if self.part == "calibration" else "calibration"
        return SampleSplit(self.every, self.limit, part)
