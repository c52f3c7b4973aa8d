"""`qtool quantize`: from a recipe to the QDQ model, report.json and (with --auto) plan.yaml.

The orchestration, in order: prepare (load, equalize, freeze, plan) -> [mixed precision: the
search returns the Plan it verified and the model built for it] -> statistics (a calibration
pass, or the stats file given) -> build (algorithms, ranges, weights, write) -> verify what ONNX
Runtime runs -> report -> one commit of every output file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qtool import distributed
from qtool.app import settings
from qtool.app.common import prepare, statistics
from qtool.config.recipe import Recipe
from qtool.io import commit_files
from qtool.model.memory import release_freed_memory
from qtool.pipeline.build import Built, build_quantized
from qtool.pipeline.finish import verify_and_report, verify_feeds
from qtool.pipeline.prepare import Prepared
from qtool.pipeline.statistics import Statistics
from qtool.report import report_bytes
from qtool.search.mixed import MixedOutcome, search
from qtool.search.spec import MixedPrecisionSpec


@dataclass
class QuantizeResult:
    model_path: Path
    report_path: Path
    report: dict
    warnings: list[str] = field(default_factory=list)  # unfused nodes, fused-vs-unfused gaps


def quantize(
    recipe: Recipe, stats_path: Path | None = None, progress: bool = True, auto: bool = False
) -> QuantizeResult:
    """Ranges from statistics (calibrating first when no stats file is given) -> QDQ model.

    `auto` (or a `mixed_precision:` section) runs the mixed-precision search first: it chooses
    every node's precision, and the model written is the one it verified."""
    distributed.require_single_process("qtool quantize")
    searching = auto or recipe.mixed_precision is not None
    # Without the search, a model over 2 GB keeps its weights in the staged float file: each is
    # read when it is quantized (the search reads the whole float model, many times).
    prepared = prepare(recipe, lazy_weights=not searching)
    try:
        mixed: MixedOutcome | None = None
        if searching:
            mixed = search(
                prepared,
                settings.job(recipe),
                recipe.mixed_precision or MixedPrecisionSpec(),
                stats_path,
                progress,
            )
            run, built, model_path = mixed.statistics, mixed.built, mixed.model_path
        else:
            run = statistics(recipe, prepared, stats_path, progress)
            # The build reads the proto, sessions read the file: the bytes are not held too.
            prepared.model.spill(recipe.float_model_path)
            built = build_quantized(
                prepared.model, prepared.layout, run, settings.build_settings(recipe), progress
            )
            # verification runs ORT on the files: the float proto is read no more
            prepared.model.model = None
            release_freed_memory()
            model_path = recipe.quant_model_path
        if prepared.equalization is not None:  # first: the order the algorithms ran in
            equalization = {"cross_layer_equalization": prepared.equalization}
            built.algorithms = {**equalization, **built.algorithms}
        return _finish(recipe, prepared, run, built, model_path, mixed)
    finally:
        prepared.model.discard()  # staged files: renamed into place by the commit, or removed


def _finish(
    recipe: Recipe,
    prepared: Prepared,
    run: Statistics,
    built: Built,
    model_path: Path,
    mixed: MixedOutcome | None,
) -> QuantizeResult:
    """Verify, report and commit every output of the run together."""
    files = {
        "float_model": str(recipe.float_model_path),
        "quantized_model": str(model_path),
        "stats": str(run.path),
    }
    finished = verify_and_report(
        built,
        prepared.model,
        model_path,
        settings.report_header(recipe),
        verify_feeds(settings.calibration_data(recipe)),
        files,
        settings.settings_sha256(recipe),
        run.data_sha256,
    )
    try:
        report = finished.report
        if mixed is not None:
            report["mixed_precision"] = mixed.block
        commit_files(
            {
                **run.files,
                **finished.files,
                **prepared.model.float_files(recipe.float_model_path),
                recipe.report_path: report_bytes(report),
                **(mixed.files if mixed is not None else {}),
            }
        )
    finally:
        finished.discard()
    warnings = list(finished.warnings)
    if prepared.equalization is not None and "warning" in prepared.equalization:
        warnings.append(prepared.equalization["warning"])
    return QuantizeResult(model_path, recipe.report_path, report, warnings)
