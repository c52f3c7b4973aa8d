"""`qtool calibrate`: stream the calibration set through the float model, write the stats."""

from __future__ import annotations

from qtool import distributed
from qtool.app import settings
from qtool.app.common import prepare
from qtool.calibration.observers import TensorStats
from qtool.config.recipe import Recipe
from qtool.distributed import Shard
from qtool.io import commit_files
from qtool.pipeline.prepare import Prepared
from qtool.pipeline.requests import requests_for
from qtool.pipeline.statistics import collect_statistics


def calibrate(
    recipe: Recipe,
    prepared: Prepared | None = None,
    progress: bool = True,
    shard: Shard | None = None,
) -> list[TensorStats]:
    """Stream the calibration set (or `shard` of it) through the model, across the processes
    torchrun started when it did; write (rank 0) and return the statistics."""
    prepared = prepared if prepared is not None else prepare(recipe)
    model, where = prepared.model, str(recipe.path)
    try:
        requests = requests_for(
            model.model, prepared.layout, recipe.algorithms, recipe.calibration, where
        )
        run = collect_statistics(
            model,
            requests,
            settings.calibration_data(recipe),
            recipe.calibration.bins,
            settings.outputs(recipe),
            where,
            progress,
            shard,
            distributed.current(),
            reload=False,
            release=True,
        )
        if run.primary:
            commit_files(run.files)
            model.float_file = None  # renamed into place: a later run stages its own
    finally:
        model.discard()  # staged files: renamed into place by the commit, or removed here
    return run.stats
