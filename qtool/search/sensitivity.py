"""`analyze`: measure how much each quantized node of the recipe's plan costs, three ways.

- one-at-a-time: only node i quantized (at each candidate precision), everything else float:
  the penalty node i adds on its own, the number the mixed-precision search sums;
- all-but-one: the recipe's plan with node i alone kept float: what keeping it float recovers;
- layer: the full plan and the float model run once with every quantized node's input and
  output exposed (layers.py): where the error enters and how it accumulates.

Each variant is the recipe plus `overrides:` entries (variants.py) scored fused on the same
analysis subset of the evaluation data (scoring.py), and every measurement is cached under a key
of all it depends on (cache.py). Statistics come from `--stats`, else the recipe's stats file,
else a calibration run for every tensor the requested variants need, written where `qtool
calibrate` writes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx
import onnxruntime
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from qtool import __version__
from qtool.calibration.hessian_file import load_hessians
from qtool.calibration.stats_file import load_stats
from qtool.data.batches import Batch
from qtool.data.spec import same_source
from qtool.errors import CalibrationError, ModelError, RecipeError
from qtool.io import commit_files
from qtool.model import provenance
from qtool.model.opset21 import TARGET_OPSET
from qtool.pipeline.job import Job
from qtool.pipeline.prepare import Prepared
from qtool.pipeline.requests import requests_for
from qtool.pipeline.statistics import collect_statistics
from qtool.plan.layout import Layout
from qtool.plan.settings import Override
from qtool.progress import bars
from qtool.search.cache import AnalysisCache, cache_key
from qtool.search.candidates import model_candidates, offered
from qtool.search.layers import layer_sqnr
from qtool.search.result import (
    CANDIDATES,
    MODE_CHOICES,
    MODES,
    Measurement,
    NodeSensitivity,
    SensitivityResult,
    json_number,
)
from qtool.search.scoring import METRICS, Metric, Scorer
from qtool.search.variants import Assembler, pin, union_layout

DEFAULT_SAMPLES = 128


def parse_modes(text: str) -> tuple[str, ...]:
    """'all' or a comma-separated list of modes, in canonical order; errors name --mode."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in MODE_CHOICES:
            raise RecipeError(
                f"--mode: {name!r} is not one of {', '.join(MODE_CHOICES)} (or a comma list)"
            )
    if not names:
        raise RecipeError(f"--mode: give one of {', '.join(MODE_CHOICES)}")
    if "all" in names:
        return MODES
    return tuple(mode for mode in MODES if mode in names)


def parse_candidates(text: str) -> tuple[str, ...]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in CANDIDATES:
            hint = " (float is the reference, not a candidate)" if name == "float" else ""
            raise RecipeError(f"--candidates: {name!r} is not one of {', '.join(CANDIDATES)}{hint}")
    if not names:
        raise RecipeError(f"--candidates: give one or more of {', '.join(CANDIDATES)}")
    return tuple(c for c in CANDIDATES if c in names)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _candidates(
    job: Job, prepared: Prepared, requested: Sequence[str] | None, notes: list[str]
) -> tuple[str, ...]:
    """The candidates to measure. int4 needs the opset-21 model the stats were collected on,
    so it is never switched on by re-preparing behind the user's back."""
    opset = _opset(prepared.model.model)
    if requested is not None:
        if "int4" in requested and opset < TARGET_OPSET:
            raise RecipeError(
                f"--candidates int4: 4-bit weights need opset {TARGET_OPSET}, but {job.where} "
                f"prepares opset {opset}; set model.opset: {TARGET_OPSET} in the recipe (and "
                "calibrate again: the stats belong to the prepared model)"
            )
        return tuple(requested)
    if job.build.quantization.target == "tensorrt":
        chosen = model_candidates(None, "tensorrt", opset, job.where, notes)
        return tuple(p for p in chosen if p != "float")
    if opset < TARGET_OPSET:
        notes.append(
            f"int4 not analysed: {job.where} prepares opset {opset}, 4-bit weights need "
            f"opset {TARGET_OPSET} (set model.opset: {TARGET_OPSET} to analyse int4)"
        )
        return ("int8",)
    return ("int8", "int4")


@dataclasses.dataclass(frozen=True)
class _Variant:
    id: str
    mode: str  # "full", "one-at-a-time" or "all-but-one"
    node: str | None
    precision: str | None
    overrides: tuple[Override, ...]


def _variants(
    units: Sequence[NodeSensitivity],
    modes: Sequence[str],
    candidates: Sequence[str],
    target: str,
) -> list[_Variant]:
    names = [u.name for u in units]
    variants = [_Variant("full", "full", None, None, ())]
    if "one-at-a-time" in modes:
        all_float = pin(names, "float", "analysis (every analysed node float)")
        for unit in units:
            for precision in candidates:
                if precision == "int4" and unit.weight is None:
                    continue  # 4-bit is a weight format: nothing to store for this node
                if not offered(precision, unit.op_type, target):
                    continue  # no form at that precision on the target (an Add at fp8)
                only = pin(unit.name, precision, f"analysis ({unit.name} alone {precision})")
                variants.append(
                    _Variant(
                        f"one-at-a-time/{precision}/{unit.name}",
                        "one-at-a-time",
                        unit.name,
                        precision,
                        (all_float, only),
                    )
                )
    if "all-but-one" in modes:
        for unit in units:
            keep = pin(unit.name, "float", f"analysis ({unit.name} float)")
            variants.append(
                _Variant(f"all-but-one/{unit.name}", "all-but-one", unit.name, None, (keep,))
            )
    return variants


def _units(prepared: Prepared) -> list[NodeSensitivity]:
    initializers = {i.name: i for i in prepared.model.model.graph.initializer}
    units = []
    for node in prepared.layout.plan.quantized():
        weight = node.weight.tensor if node.weight is not None else None
        elements = None
        if weight is not None and weight in initializers:
            elements = 1
            for dim in initializers[weight].dims:
                elements *= int(dim)
        units.append(
            NodeSensitivity(node.name, node.op_type, len(units), node.precision, weight, elements)
        )
    return units


def check_request(job: Job, samples: int, metric: str | None) -> None:
    """Refuse what cannot work before anything slow runs (export, calibration)."""
    if job.evaluation is None or job.evaluation_data is None:
        raise RecipeError(
            f"{job.where}: evaluation: is required for `qtool analyze` (its data is scored)"
        )
    if samples < 1:
        raise RecipeError(f"--samples: must be >= 1, got {samples}")
    if metric is not None and metric not in METRICS:
        raise RecipeError(f"--metric: must be one of {', '.join(METRICS)}, got {metric!r}")


def analysis_batches(job: Job, samples: int) -> list[Batch]:
    """The first `samples` samples of the evaluation data."""
    check_request(job, samples, None)
    data = job.evaluation_data
    return list(data.batches(min(data.batch_size, samples), samples))


def _data_digest(batches: Sequence[Batch]) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch.inputs):
            array = batch.inputs[name]
            digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
            digest.update(array.tobytes())
        if batch.labels is not None:
            digest.update(batch.labels.tobytes())
    return digest.hexdigest()


def calibrate_for(prepared: Prepared, job: Job, layouts: Sequence[Layout], progress: bool) -> None:
    """Calibrate for every tensor any of `layouts` needs and commit the stats file where
    `qtool calibrate` writes it, so one file serves them all and `qtool quantize --stats`
    of the settings' own plan."""
    union = union_layout(layouts)
    requests = requests_for(
        prepared.model.model, union, job.build.algorithms, job.build.calibration, job.where
    )
    model = prepared.model
    # Staged for its size (under protobuf's limit, its bytes held): the staged files stay for
    # the command that writes the float model, which commits or removes them, and the model is
    # read back; otherwise the float model file is committed with the stats and let go of.
    staged = model.staged is not None
    try:
        run = collect_statistics(
            model,
            requests,
            job.build.data,
            job.build.calibration.bins,
            job.outputs,
            job.where,
            progress,
            reload=staged,
            release=True,
        )
        if staged:
            kept = set(model.float_files(job.outputs.float_model))
            commit_files({path: data for path, data in run.files.items() if path not in kept})
            return
        commit_files(run.files)
        model.float_file = None  # renamed into place
    finally:
        if not staged:
            model.discard()


def _statistics(
    prepared: Prepared,
    job: Job,
    layouts: Sequence[Layout],
    stats_path: Path | None,
    progress: bool,
) -> tuple[dict, dict, Path, list[str]]:
    """Stats and Hessians (and the files they came from) for the variants' layouts."""
    digests = []
    fingerprint_expected = prepared.model.fingerprint
    if stats_path is None:
        stats_path = job.outputs.stats
        if not stats_path.is_file():
            calibrate_for(prepared, job, layouts, progress)
    stats, fingerprint = load_stats(stats_path)
    if fingerprint != fingerprint_expected:
        raise CalibrationError(
            f"{stats_path}: collected on a different model than {job.where} describes "
            "(re-run `qtool calibrate`)"
        )
    digests.append(provenance.sha256_file(stats_path))
    hessians = {}
    if any(layout.hessian_tensors() for layout in layouts):
        path = stats_path.parent / "hessians.npz"
        if path.is_file():
            hessians = load_hessians(path, fingerprint_expected)
            digests.append(provenance.sha256_file(path))
    return stats, hessians, stats_path, digests


def _key_inputs(
    job: Job,
    prepared: Prepared,
    stats_digests: list[str],
    data_digest: str,
    samples: int,
    metric: str | None,
    cpu_description: str,
) -> dict:
    evaluation = job.evaluation
    calibration = job.build.calibration
    return {
        "qtool": __version__,
        "onnxruntime": onnxruntime.__version__,
        "model_sha256": prepared.model.fingerprint,
        "stats_sha256": stats_digests,
        "data_sha256": data_digest,
        "samples": samples,
        "metric": metric,
        "evaluation": {
            "output": evaluation.output,
            "metric": evaluation.metric,
            "max_drop": evaluation.max_drop,
            "min_cosine": evaluation.min_cosine,
            "min_sqnr": evaluation.min_sqnr,
        },
        "quantization": repr(job.build.quantization),
        "calibration": [calibration.method, calibration.percentile, calibration.bins],
        "cpu": cpu_description,
    }


def _progress(enabled: bool):
    return bars(
        enabled,
        TextColumn("analysing"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        line="analysing: {count} measurements ({description})",
    )


def analyze(
    prepared: Prepared,
    job: Job,
    *,
    stats_path: Path | None = None,
    modes: Sequence[str] = MODES,
    candidates: Sequence[str] | None = None,
    samples: int = DEFAULT_SAMPLES,
    metric: str | None = None,
    progress: bool = True,
    use_cache: bool = True,
    cache_dir: Path | None = None,
    threads: int | None = None,
    on_variant: Callable[[str, Measurement], None] | None = None,
) -> SensitivityResult:
    """Measure the recipe's plan node by node; see the module docstring for the modes.

    `candidates` None: int8, and int4 on an opset-21 model for ort-cpu. `samples`: the first N
    samples of the evaluation data. `metric` None: the gate `qtool evaluate` judges
    (scoring.choose_metric). `cache_dir` (default: the output folder) holds the cache.
    `on_variant(id, measurement)` is called after each variant measured in this run.
    """
    check_request(job, samples, metric)
    prepared.model.hold_bytes()  # the scorer's float session needs the model's bytes
    if prepared.model.serialized is None:
        raise ModelError(
            f"{job.where}: sensitivity analysis does not support models stored as external data "
            "(over 2 GB) yet"
        )
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise RecipeError(f"modes: {unknown or modes!r} (choose from {', '.join(MODES)})")
    notes: list[str] = []
    batches = analysis_batches(job, samples)
    if same_source(job.evaluation_data.spec, job.build.data.spec):
        notes.append(
            "evaluation.data is the calibration data: every variant is scored on rows its "
            "ranges were fitted on, which flatters them; name evaluation data of another source"
        )
    chosen = _candidates(job, prepared, candidates, notes)
    algorithms = job.build.algorithms.names()
    if algorithms:
        notes.append(
            f"quantization.algorithms ({', '.join(algorithms)}) are not applied to the analysed "
            "variants: their numbers are for the plan without them"
        )
    units = _units(prepared)
    variants = _variants(units, modes, chosen, job.build.quantization.target)

    # Every variant is planned before any statistics are read (milliseconds each), so a
    # calibration run, when one is needed, covers all of them at once.
    cpu = job.build.cpu()
    assembler = Assembler(job.build, prepared.model.model, {}, cpu=cpu)
    layouts = {v.id: assembler.layout(v.overrides) for v in variants}
    stats, hessians, stats_path, digests = _statistics(
        prepared, job, list(layouts.values()), stats_path, progress
    )
    assembler.use_statistics(stats, hessians)
    inputs = _key_inputs(
        job, prepared, digests, _data_digest(batches), samples, metric, cpu.describe()
    )
    key = cache_key(inputs)
    cache = AnalysisCache(cache_dir or job.outputs.folder, key, inputs, enabled=use_cache)

    todo = [v for v in variants if v.id not in cache.variants]
    layer_needed = "layer" in modes and cache.layer is None
    scorer: Scorer | None = None
    if todo or layer_needed or not cache.header:
        scorer = Scorer(
            prepared.model.serialized,
            batches,
            job.evaluation,
            metric,
            threads,
            fused=job.build.quantization.target == "ort-cpu",
        )
        cache.header = {
            "metric": dataclasses.asdict(scorer.metric),
            "float_value": json_number(scorer.float_value),
            "samples": scorer.samples,
        }
    header = cache.header
    full_model: onnx.ModelProto | None = None
    with _progress(progress) as bar:
        task = bar.add_task("", total=len(todo) + int(layer_needed))
        for variant in todo:
            bar.update(task, description=variant.id)
            start = time.perf_counter()
            layout = layouts[variant.id]
            problem = assembler.missing(layout)
            if problem is None and variant.node is not None and variant.precision is not None:
                planned = layout.plan[variant.node]
                if planned.precision != variant.precision:
                    problem = f"the layout keeps it {planned.precision}: {planned.reason}"
            if problem is not None and variant.mode == "full":
                raise CalibrationError(f"{stats_path}: cannot build the recipe's plan: {problem}")
            if problem is not None:
                measured = Measurement.skip(problem)
            else:
                model = assembler.build(layout)
                if variant.mode == "full":
                    full_model = model
                score = scorer.score(model.SerializeToString())
                seconds = round(time.perf_counter() - start, 4)  # as the cache stores it
                measured = Measurement(
                    score.value,
                    score.penalty,
                    score.sqnr_db,
                    score.cosine,
                    seconds,
                    margin_noise=score.margin_noise,
                )
            cache.variants[variant.id] = measured
            if on_variant is not None:
                on_variant(variant.id, measured)
            bar.advance(task)
            cache.save()  # an interrupted run keeps what it measured
        if layer_needed:
            bar.update(task, description="layer by layer")
            start = time.perf_counter()
            if full_model is None:
                full_model = assembler.build(assembler.layout(()))
            scores = layer_sqnr(
                prepared.model.model, full_model, prepared.layout.plan, batches, threads
            )
            cache.layer = (round(time.perf_counter() - start, 4), scores)
            bar.advance(task)
    cache.save()

    for variant in variants:
        measured = cache.variants[variant.id]
        if variant.mode == "one-at-a-time":
            next(u for u in units if u.name == variant.node).one_at_a_time[variant.precision] = (
                measured
            )
        elif variant.mode == "all-but-one":
            next(u for u in units if u.name == variant.node).all_but_one = measured
    layer_seconds = 0.0
    if "layer" in modes:
        layer_seconds, scores = cache.layer
        by_name = {s.node: s for s in scores}
        for unit in units:
            unit.layer = by_name.get(unit.name)
    skipped = [
        f"{v.id}: {cache.variants[v.id].skipped}"
        for v in variants
        if cache.variants[v.id].skipped is not None
    ]
    if skipped:
        notes.append(f"{len(skipped)} variant(s) not measured; first: {skipped[0]}")
    metric_info = Metric(**header["metric"])
    return SensitivityResult(
        recipe=job.where,
        metric=metric_info,
        samples=int(header["samples"]),
        modes=tuple(modes),
        candidates=chosen,
        float_value=float(header["float_value"]),
        full=cache.variants["full"],
        nodes=units,
        key=key,
        layer_seconds=layer_seconds,
        notes=notes,
        cached=not todo and not layer_needed,
    )
