"""`qtool analyze`: run the analysis, print the tables, commit sensitivity.json, plan.yaml and
the plot together (cli.py only parses the options)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from qtool.app import settings
from qtool.app.common import prepare
from qtool.config.recipe import Recipe
from qtool.errors import OutputError
from qtool.io import commit_files
from qtool.search import sensitivity
from qtool.search.plan_file import plan_yaml
from qtool.search.plot import PlotUnavailable, plot_png
from qtool.search.result import SensitivityResult
from qtool.search.sensitivity import parse_candidates, parse_modes
from qtool.search.sensitivity_report import (
    layer_table,
    sensitivity_json,
    sensitivity_table,
    summary_lines,
)


def run(
    recipe: Recipe,
    console: Console,
    *,
    stats: Path | None,
    mode: str,
    candidates: str | None,
    samples: int,
    metric: str | None,
    plot: Path | None,
    use_cache: bool,
    progress: bool,
) -> SensitivityResult:
    if plot is not None and plot.is_dir():  # refused before minutes of analysis, not after
        raise OutputError(f"--plot {plot}: is a directory; name the PNG file")
    modes = parse_modes(mode)
    chosen = parse_candidates(candidates) if candidates is not None else None
    job = settings.job(recipe)
    sensitivity.check_request(job, samples, metric)
    prepared = prepare(recipe)
    try:
        result = sensitivity.analyze(
            prepared,
            job,
            stats_path=stats,
            modes=modes,
            candidates=chosen,
            samples=samples,
            metric=metric,
            progress=progress,
            use_cache=use_cache,
        )
        out = recipe.output_dir
        files = {
            out / "sensitivity.json": sensitivity_json(result),
            out / "plan.yaml": plan_yaml(
                prepared.model.model,
                recipe.quantization,
                prepared.layout.plan,
                [f"qtool plan of {recipe.path}: the recipe's per-node precisions, pinned."],
            ).encode(),
        }
        plot_path = plot if plot is not None else out / "sensitivity.png"
        plot_note = None
        try:
            files[plot_path] = plot_png(result)
        except PlotUnavailable as exc:
            plot_note = f"no plot: {exc}"
        commit_files(files)
    finally:
        prepared.model.discard()  # a staged float model never outlives the run

    if any(m in result.modes for m in ("one-at-a-time", "all-but-one")):
        console.print(sensitivity_table(result))
    if "layer" in result.modes:
        console.print(layer_table(result))
    for line in summary_lines(result):
        console.print(line, highlight=False, markup=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    if plot_note is not None:
        console.print(f"note: {plot_note}", highlight=False, markup=False)
    written = ", ".join(str(path) for path in files)
    console.print(f"wrote {written}", highlight=False, markup=False, soft_wrap=True)
    return result


def analyze(recipe: Recipe, *, prepared=None, **options) -> SensitivityResult:
    """The sensitivity analysis of a recipe's plan (sensitivity.analyze on the recipe's typed
    settings); `prepared`: the recipe's prepared model when the caller has it."""
    prepared = prepared if prepared is not None else prepare(recipe)
    return sensitivity.analyze(prepared, settings.job(recipe), **options)


def analysis_batches(recipe: Recipe, samples: int):
    """The first `samples` samples of the recipe's evaluation data."""
    return sensitivity.analysis_batches(settings.job(recipe), samples)
