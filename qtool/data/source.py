"""A data source bound to one model's inputs, its batch size, its sample limit and its seed.

Calibration, the algorithms that take a second look at the calibration samples (AdaRound, bias
correction, CLE's channel ranges), the verify stage and QAT all read "the first N samples of the
calibration set" in some batch size. Holding the five things that define those samples in one
value means every stage reads the same samples the same way, and no stage needs the recipe to
find them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from qtool.data.batches import Batch, count_samples_hint, iter_batches
from qtool.data.spec import DataSpec, InputSpec


@dataclass(frozen=True)
class BatchSource:
    spec: DataSpec
    inputs: tuple[InputSpec, ...]
    batch_size: int
    max_samples: int | None = None
    seed: int = 0

    def batches(self, batch_size: int | None = None, limit: int | None = None) -> Iterator[Batch]:
        """Every sample (up to `max_samples`, and `limit` when given) in `batch_size` batches
        (the source's own size by default)."""
        limit = self._limit(limit)
        return iter_batches(self.spec, self.inputs, batch_size or self.batch_size, limit, self.seed)

    def first_inputs(
        self, samples: int, batch_size: int | None = None
    ) -> Iterator[dict[str, np.ndarray]]:
        """The inputs of the first `samples` samples, read afresh, in `batch_size` batches."""
        return (batch.inputs for batch in self.batches(batch_size, samples))

    def samples_hint(self) -> int | None:
        """How many samples a full pass reads, when the source can tell without reading."""
        return count_samples_hint(self.spec, self.max_samples)

    def _limit(self, limit: int | None) -> int | None:
        if limit is None:
            return self.max_samples
        return min(limit, self.max_samples or limit)
