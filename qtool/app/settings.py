"""A recipe read into the typed inputs of the stages: the only translation between the file's
shape and the pipeline's, so a change to the recipe format touches qtool/config and this."""

from __future__ import annotations

from qtool.config.fingerprint import recipe_sha256
from qtool.config.recipe import Recipe
from qtool.data.source import BatchSource
from qtool.pipeline.build import BuildSettings
from qtool.pipeline.job import Job
from qtool.pipeline.outputs import OutputFiles
from qtool.report import ReportHeader


def calibration_data(recipe: Recipe) -> BatchSource:
    spec = recipe.calibration
    return BatchSource(spec.data, recipe.inputs, spec.batch_size, spec.max_samples, recipe.seed)


def evaluation_data(recipe: Recipe) -> BatchSource | None:
    if recipe.evaluation is None:
        return None
    spec = recipe.evaluation
    return BatchSource(spec.data, recipe.inputs, spec.batch_size, None, recipe.seed)


def build_settings(recipe: Recipe) -> BuildSettings:
    return BuildSettings(
        recipe.quantization,
        recipe.calibration,
        calibration_data(recipe),
        recipe.seed,
        str(recipe.path),
        recipe.algorithms,
    )


def outputs(recipe: Recipe) -> OutputFiles:
    return recipe.outputs


def settings_sha256(recipe: Recipe) -> str:
    """The resolved recipe's hash (presets merged, changes made in code included)."""
    return recipe_sha256(recipe)


def job(recipe: Recipe) -> Job:
    return Job(
        build_settings(recipe),
        outputs(recipe),
        settings_sha256(recipe),
        recipe.evaluation,
        evaluation_data(recipe),
    )


def report_header(recipe: Recipe) -> ReportHeader:
    return ReportHeader(str(recipe.path), recipe.quantization, recipe.calibration, recipe.seed)
