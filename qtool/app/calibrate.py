"""`qtool calibrate`: stream the calibration set through the float model, write the stats."""

from __future__ import annotations

from qtool import distributed
from qtool.app.common import prepare, statistics
from qtool.calibration.observers import TensorStats
from qtool.config.recipe import Recipe
from qtool.distributed import Shard
from qtool.io import commit_files
from qtool.pipeline.prepare import Prepared


def calibrate(
    recipe: Recipe,
    prepared: Prepared | None = None,
    progress: bool = True,
    shard: Shard | None = None,
) -> list[TensorStats]:
    """Stream the calibration set (or `shard` of it) through the model, across the processes
    torchrun started when it did; write (rank 0) and return the statistics."""
    prepared = prepared if prepared is not None else prepare(recipe)
    model = prepared.model
    try:
        run = statistics(
            recipe, prepared, None, progress, distributed.current(), shard, reload=False
        )
        if run.primary:
            commit_files(run.files)
            model.float_file = None  # renamed into place: a later run stages its own
    finally:
        model.discard()  # staged files: renamed into place by the commit, or removed here
    return run.stats
