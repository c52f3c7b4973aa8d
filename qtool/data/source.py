"""A data source bound to one model's inputs, its batch size, its sample limit and its seed.

Calibration, the algorithms that take a second look at the calibration samples (AdaRound, bias
correction, CLE's channel ranges), the verify stage and QAT all read "the first N samples of the
calibration set" in some batch size. Holding the things that define those samples in one value
means every stage reads the same samples the same way, and no stage needs the recipe to find
them. `split` takes one part of a source split into calibration and tuning rows
(qtool/data/split.py): the calibration source and the tuning source of a recipe without its own
tuning data are the same source with complementary splits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from qtool.data.batches import Batch, count_samples_hint, iter_batches
from qtool.data.spec import DataSpec, InputSpec
from qtool.data.split import SampleSplit


@dataclass(frozen=True)
class BatchSource:
    spec: DataSpec
    inputs: tuple[InputSpec, ...]
    batch_size: int
    max_samples: int | None = None
    seed: int = 0
    split: SampleSplit | None = None  # None: every sample of the source

    def batches(self, batch_size: int | None = None, limit: int | None = None) -> Iterator[Batch]:
        """Every sample of the part (of the first `max_samples` of the source), at most `limit`
        when given, in `batch_size` batches (the source's own size by default)."""
        return iter_batches(
            self.spec,
            self.inputs,
            batch_size or self.batch_size,
            self.max_samples,
            self.seed,
            split=self.split,
            limit=limit,
        )

    def first_inputs(
        self, samples: int, batch_size: int | None = None
    ) -> Iterator[dict[str, np.ndarray]]:
        """The inputs of the first `samples` samples, read afresh, in `batch_size` batches."""
        return (batch.inputs for batch in self.batches(batch_size, samples))

    def samples_hint(self) -> int | None:
        """How many samples a full pass reads, when the source can tell without reading."""
        total = count_samples_hint(self.spec, self.max_samples)
        if total is None or self.split is None:
            return total
        return self.split.count(total)
