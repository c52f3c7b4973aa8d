"""What every orchestrator that starts from a recipe's model does first."""

from __future__ import annotations

from pathlib import Path

from qtool import distributed
from qtool.app import settings
from qtool.config.recipe import Recipe
from qtool.pipeline.prepare import Prepared
from qtool.pipeline.prepare import prepare as prepare_stage
from qtool.pipeline.requests import requests_for
from qtool.pipeline.statistics import Statistics, collect_statistics, read_statistics


def prepare(recipe: Recipe, lazy_weights: bool = False) -> Prepared:
    """The recipe's model loaded, prepared, equalized when asked, frozen and planned.
    `lazy_weights`: see pipeline.prepare.prepare (quantize without the search). A float model
    over protobuf's limit is an output only when the recipe asks (`output.float_model`)."""
    prepared = prepare_stage(
        recipe.model,
        recipe.quantization,
        recipe.calibration.method,
        settings.calibration_data(recipe),
        recipe.float_model_path,
        str(recipe.path),
        recipe.algorithms.cross_layer_equalization,
        lazy_weights,
    )
    model = prepared.model
    model.commit_staged = recipe.float_model == "always" or not model.over_limit
    return prepared


def statistics(
    recipe: Recipe,
    prepared: Prepared,
    stats_path: Path | None,
    progress: bool,
    group: distributed.Group | None = None,
    shard: distributed.Shard | None = None,
    reload: bool = True,
) -> Statistics:
    """This run's statistics: from a new calibration pass over `shard` of the batches (its
    files not written yet; split across the ranks of `group` and merged exactly), or read from
    `stats_path`. `reload`: read a staged model's weights back after the pass (callers that
    build a model next)."""
    where = str(recipe.path)
    model = prepared.model
    requests = requests_for(
        model.model, prepared.layout, recipe.algorithms, recipe.calibration, where
    )
    if stats_path is not None:
        return read_statistics(stats_path, model, requests, where)
    return collect_statistics(
        model,
        requests,
        settings.calibration_data(recipe),
        recipe.calibration.bins,
        settings.outputs(recipe),
        where,
        progress,
        shard,
        group,
        reload=reload,
        release=True,
    )
