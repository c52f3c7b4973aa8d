"""A recipe read into the typed inputs of the stages: the only translation between the file's
shape and the pipeline's, so a change to the recipe format touches qtool/config and this."""

from __future__ import annotations

from qtool.config.fingerprint import recipe_sha256
from qtool.config.recipe import Recipe
from qtool.data.source import BatchSource
from qtool.data.split import SampleSplit
from qtool.pipeline.build import BuildSettings
from qtool.pipeline.job import Job
from qtool.pipeline.outputs import OutputFiles
from qtool.pipeline.tuning import TuningScore, compares_with_minmax, gate_score, uses_tuning_rows
from qtool.report import ReportHeader


def _split(recipe: Recipe, part: str) -> SampleSplit | None:
    """The calibration set's split into calibration and tuning rows, when the recipe scores
    something on tuning rows and names no tuning data of its own (qtool/pipeline/tuning.py)."""
    tuning = recipe.tuning
    if tuning.data is not None:
        return None
    if not uses_tuning_rows(recipe.algorithms, recipe.calibration.method, tuning):
        return None
    return SampleSplit(tuning.every, tuning.max_samples, part)


def calibration_data(recipe: Recipe) -> BatchSource:
    """The rows ranges and algorithms fit on: the calibration set, less its tuning rows when
    the recipe scores choices on a split of it."""
    spec = recipe.calibration
    return BatchSource(
        spec.data,
        recipe.inputs,
        spec.batch_size,
        spec.max_samples,
        recipe.seed,
        _split(recipe, "calibration"),
    )


def tuning_data(recipe: Recipe) -> BatchSource | None:
    """The rows choices are scored on, or None when nothing is scored."""
    tuning = recipe.tuning
    if not uses_tuning_rows(recipe.algorithms, recipe.calibration.method, tuning):
        return None
    if tuning.data is not None:
        return BatchSource(
            tuning.data, recipe.inputs, tuning.batch_size, tuning.max_samples, recipe.seed
        )
    spec = recipe.calibration
    return BatchSource(
        spec.data,
        recipe.inputs,
        tuning.batch_size,
        spec.max_samples,
        recipe.seed,
        _split(recipe, "tuning"),
    )


def evaluation_data(recipe: Recipe) -> BatchSource | None:
    if recipe.evaluation is None:
        return None
    spec = recipe.evaluation
    return BatchSource(spec.data, recipe.inputs, spec.batch_size, None, recipe.seed)


def _gate(recipe: Recipe) -> TuningScore:
    """What the model-level comparison scores: the evaluation gate's metric and output."""
    spec = recipe.evaluation
    if spec is None:
        return TuningScore()
    return gate_score(spec.max_drop, spec.min_cosine, spec.min_sqnr, spec.metric, spec.output)


def build_settings(recipe: Recipe) -> BuildSettings:
    return BuildSettings(
        recipe.quantization,
        recipe.calibration,
        calibration_data(recipe),
        recipe.seed,
        str(recipe.path),
        recipe.algorithms,
        tuning_data(recipe),
        compares_with_minmax(recipe.algorithms, recipe.calibration.method, recipe.tuning),
        _gate(recipe),
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
