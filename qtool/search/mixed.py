"""The mixed-precision stage of `qtool quantize`: analyse, choose, verify, hand the plan on.

1. `qtool analyze`'s one-at-a-time measurements (its cache: a rerun measures nothing) give each
   node's penalty at each candidate precision on the analysis subset; penalties.py turns them
   into the knapsack's additive penalties (for a max_drop budget a margin noise, whose expected
   drop in points the flip model of flips.py predicts from the evaluation set's float margins);
2. the QDQ writer builds the all-int8 and all-int4 models once; sizes.py prices each node at
   each precision in the bytes those files really hold (weights, scales, zero points, QDQ nodes),
   so a plan's predicted size is the size of the file that would be written;
3. the exact multiple-choice knapsack picks the smallest plan whose summed penalties fit the
   budget;
4. verify-and-promote (promote.py) scores it on the full evaluation set as `qtool evaluate`
   would gate it, promoting nodes until it passes or no more plans may be tried;
5. never larger than a passing reference (reference.py): a uniform model that passes and is
   smaller than that plan is chosen instead, and report.json and the CLI say so.

The chosen plan is the settings' plan plus one `overrides:` entry per precision; the search
returns that Plan and the very model it verified (built by the pipeline's build stage, with the
settings' algorithms), which is what `qtool quantize --auto` writes, and plan.yaml reproduces it.
When no plan meets the budget, the best one measured is written as model.failed.onnx and
plan.failed.yaml, report.json says why, and the CLI exits 1. Sizes in the report are files as
written, qtool's provenance metadata included.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from rich.console import Console

from qtool.calibration.hessian_file import load_hessians
from qtool.calibration.stats_file import load_stats, stats_data_sha256
from qtool.data.batches import Batch
from qtool.errors import CalibrationError, DataError, ModelError, RecipeError
from qtool.ort.float8 import unfused_only_reason
from qtool.ort.sessions import create_session
from qtool.phases import phase
from qtool.pipeline.build import Built, build_quantized
from qtool.pipeline.finish import stamp_provenance
from qtool.pipeline.float_model import FloatModel
from qtool.pipeline.job import Job
from qtool.pipeline.prepare import Prepared
from qtool.pipeline.statistics import Statistics
from qtool.plan.layout import Layout
from qtool.plan.settings import Override, with_overrides
from qtool.runtime.latency import latency_feed, measure_latency
from qtool.runtime.profile import NodeTimes, node_times
from qtool.search.budget import Budget, resolve_budget
from qtool.search.candidates import ORDER, model_candidates, node_candidates
from qtool.search.knapsack import Choice, solve
from qtool.search.mixed_report import iteration_line, mixed_block
from qtool.search.penalties import PenaltyScale, penalty_scale
from qtool.search.plan_file import plan_yaml
from qtool.search.promote import (
    Iteration,
    Measured,
    SearchResult,
    measure_iteration,
    verify_and_promote,
)
from qtool.search.reference import Reference, ceiling, prefer_reference
from qtool.search.result import SensitivityResult
from qtool.search.scoring import Scorer, choose_metric
from qtool.search.sensitivity import analyze
from qtool.search.sizes import (
    SizeModel,
    Uniform,
    clamp_owners,
    size_model,
    uniform,
    wanted_slots,
)
from qtool.search.spec import MixedPrecisionSpec
from qtool.search.variants import Assembler, pin

LATENCY_RUNS = 30
PROFILE_RUNS = 20  # profiled runs per uniform model (median per node) for objective: latency
ANALYSIS_MODES = ("one-at-a-time",)


@dataclass
class MixedOutcome:
    """The search's result: the chosen Plan (in `built.layout`) and the model built and verified
    for it, the statistics it was built from, where to write it, the extra files (plan.yaml),
    and report.json's `mixed_precision` block."""

    passed: bool
    model_path: Path
    files: dict[Path, bytes]
    block: dict
    built: Built
    statistics: Statistics
    notes: list[str] = field(default_factory=list)
    # The models the block measured (float, int8, int4, chosen), with keep_models only.
    models: dict[str, bytes] = field(default_factory=dict)


@dataclass
class _Problem:
    """The search's inputs: per-node choices (cost to minimise, knapsack penalty), the same
    choices priced in bytes (the size model's prices), the size model, the uniform models that
    priced them, and with the latency objective their per-node profiles (precision ->
    runtime.profile.NodeTimes)."""

    options: dict[str, list[Choice]]
    sizes: dict[str, list[Choice]]
    size_model: SizeModel
    references: dict[str, Uniform]  # precision -> the uniform model
    profiles: dict[str, NodeTimes] = field(default_factory=dict)
    # Readers of a tied weight that the analysis could not vary one at a time (the other reader,
    # pinned float, keeps the one stored table float): not pinned, so the recipe decides them
    unpinned: frozenset[str] = frozenset()


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _tied_alone(
    assembler: Assembler, names: Sequence[str], name: str, offered: Sequence[str]
) -> bool:
    """Whether `name`, quantized alone as the analysis does (every other node float), is kept
    float by the tied-weight rule: a reader of one stored table whose other reader is float."""
    plan = {other: "float" for other in names}
    plan[name] = offered[0]
    return assembler.layout(_pins(plan)).plan[name].source == "tied"


def _pins(plan: Mapping[str, str], unpinned: frozenset[str] = frozenset()) -> list[Override]:
    """One override per precision, in a fixed order, naming its nodes in graph order (those in
    `unpinned` left to the recipe)."""
    pins = []
    for precision in ORDER:
        names = [node for node, p in plan.items() if p == precision and node not in unpinned]
        if names:
            pins.append(pin(names, precision, f"mixed_precision ({precision})"))
    return pins


def _evaluation_batches(job: Job) -> list[Batch]:
    batches = list(job.evaluation_data.batches())
    if not batches:
        raise DataError(f"{job.evaluation_data.spec.where}: the evaluation data is empty")
    return batches


def split_rows(batches: Sequence[Batch], samples: int, where: str) -> tuple[int, list[Batch]]:
    """The analysis rows' count and the verification rows: the analysis measures each node's
    penalty on the first `samples` evaluation samples (at most half of them), and plans are
    verified on the samples after those, so the loop that promotes nodes is judged on rows the
    penalties were not measured on (a plan fitted to the analysis rows' noise would pass there
    and nowhere else)."""
    total = sum(len(b) for b in batches)
    if total < 2:
        raise DataError(
            f"{where}: mixed precision needs at least 2 evaluation samples (analysis rows and "
            f"verification rows are disjoint), got {total}"
        )
    analysis = min(samples, total // 2)
    rest, skip = [], analysis
    for batch in batches:
        if skip >= len(batch):
            skip -= len(batch)
            continue
        rest.append(batch.rows(skip, len(batch)) if skip else batch)
        skip = 0
    return analysis, rest


def _statistics(prepared: Prepared, job: Job, stats_path: Path) -> Statistics:
    """The statistics the analysis used (it calibrated them when there were none), and the
    per-channel statistics beside them that SmoothQuant reads."""
    stats, fingerprint = load_stats(stats_path)
    if fingerprint != prepared.model.fingerprint:
        raise CalibrationError(
            f"{stats_path}: collected on a different model than {job.where} describes "
            "(re-run `qtool calibrate`)"
        )
    hessians = {}
    if prepared.layout.hessian_tensors():
        path = stats_path.parent / "hessians.npz"
        if path.is_file():
            hessians = load_hessians(path, prepared.model.fingerprint)
    return Statistics(
        list(stats.values()), hessians, {}, stats_data_sha256(stats_path), path=stats_path
    )


def _op_types(model: bytes, names: Sequence[str]) -> dict[str, str]:
    """Each planned node's op type as written in `model` (a 4-bit MatMul is MatMulNBits)."""
    written = {n.name: n.op_type for n in onnx.load_model_from_string(model).graph.node}
    return {name: written[name] for name in names}


def _profiles(
    prepared: Prepared,
    references: Mapping[str, Uniform],
    names: Sequence[str],
    feed: Mapping[str, np.ndarray],
) -> dict[str, NodeTimes]:
    """Per-node medians (runtime/profile) on the float model and on each all-int8 / all-int4
    model: a node's time at a precision is read from the uniform model that runs it so."""
    models = {"float": prepared.model.serialized}
    models.update({p: uniform.serialized for p, uniform in references.items()})
    return {
        precision: node_times(model, _op_types(model, names), feed, PROFILE_RUNS)
        for precision, model in models.items()
    }


def _stamp_bytes(float_model: FloatModel, job: Job, statistics: Statistics) -> int:
    """Bytes qtool's provenance metadata adds to the file written (finish stamps the model the
    search chose): what the size model adds to every plan, and the measured sizes too."""
    probe = onnx.ModelProto()
    stamp_provenance(probe, float_model, job.settings_sha256, statistics.data_sha256)
    return probe.ByteSize()


def _problem(
    job: Job,
    prepared: Prepared,
    analysis: SensitivityResult,
    assembler: Assembler,
    candidates: Sequence[str],
    explicit: bool,
    scale: PenaltyScale,
    stamp_bytes: int,
    notes: list[str],
    feed: Mapping[str, np.ndarray] | None = None,
) -> _Problem:
    """Each node's choices: its candidates that were measured and that the layout really gives
    it, with the knapsack penalty of `scale`, priced in bytes by the size model built from the
    all-int8 and all-int4 models the writer builds, and with a `feed` (the latency objective)
    in profiled microseconds on those models and the float one."""
    target = job.build.quantization.target
    units = analysis.nodes
    names = [u.name for u in units]
    allowed: dict[str, list[str]] = {}
    offered: dict[str, tuple[str, ...]] = {}
    for unit in units:
        offered[unit.name] = node_candidates(
            candidates, unit.op_type, unit.weight is not None, target, explicit
        )
        allowed[unit.name] = [
            p for p in offered[unit.name] if analysis.penalty(unit.name, p) is not None
        ]
    quantized = {name: [p for p in offered[name] if p != "float"] for name in names}
    unpinned = frozenset(
        name
        for name in names
        if quantized[name]
        and not [p for p in allowed[name] if p != "float"]
        and _tied_alone(assembler, names, name, quantized[name])
    )
    if unpinned:
        notes.append(
            f"{', '.join(sorted(unpinned))}: readers of one stored (tied) weight, which the "
            "analysis cannot quantize one at a time (the other reader, float, keeps the table "
            "float); left to the recipe's settings, and every plan is measured with them"
        )
    layouts: dict[str, Layout] = {}
    for precision in [p for p in ORDER if p != "float" and p in candidates]:
        chosen = [name for name in names if precision in allowed[name]]
        if not chosen:
            continue
        # The uniform plan of this precision; for int4, int8 where int4 is not a candidate
        # (the all-int4 model a user would compare with), float where neither is.
        plan = {}
        for name in names:
            fallback = "int8" if "int8" in allowed[name] and precision == "int4" else "float"
            plan[name] = precision if name in chosen else fallback
        layout = assembler.layout(_pins(plan, unpinned))  # tied readers as the recipe has them
        for name in chosen:
            planned = layout.plan[name]
            if planned.precision != precision:
                allowed[name].remove(precision)
                notes.append(f"{name}: no {precision} candidate ({planned.reason})")
        problem = assembler.missing(layout)
        if problem is not None:
            raise CalibrationError(
                f"{job.outputs.stats}: cannot build the all-{precision} plan: {problem} "
                "(delete the stats file so that the search calibrates every tensor it needs)"
            )
        layouts[precision] = layout
    float_model = prepared.model
    clamps = clamp_owners(float_model.model, list(layouts.values()))
    uniforms = {
        p: uniform(p, assembler.build(layout), layout, float_model.model, names, clamps)
        for p, layout in layouts.items()
    }
    wanted = wanted_slots(lambda plan: assembler.layout(_pins(plan)), names, uniforms)
    # What the recipe makes of the unpinned readers: in every plan, so priced at that alone
    # (priced float, a tied int8 table made every prediction high by its saving: SmolLM2 80 MB)
    recipe_made = {name: next(iter(uniforms.values())).plan[name] for name in unpinned if uniforms}
    sizes_model = size_model(
        float_model.model,
        len(float_model.serialized),
        names,
        uniforms,
        wanted,
        clamps,
        stamp_bytes,
        recipe_made,
    )
    notes.extend(sizes_model.notes)
    profiles = _profiles(prepared, uniforms, names, feed) if feed is not None else {}
    sizes: dict[str, list[Choice]] = {}
    options: dict[str, list[Choice]] = {}
    for name in names:
        prices = sizes_model.prices[name]
        usable = [p for p in reversed(ORDER) if p in allowed[name] and p in prices]
        if name in recipe_made and recipe_made[name] in prices:
            usable = [recipe_made[name]]  # the recipe's, in every plan: no choice to make
        if not usable:
            raise RecipeError(
                f"{job.where}: mixed_precision: node {name!r} has no usable candidate among "
                f"{', '.join(candidates)} (add float to mixed_precision.candidates)"
            )
        penalties = {
            p: 0.0 if name in recipe_made else scale.penalty(analysis, name, p) for p in usable
        }
        sizes[name] = [Choice(p, prices[p], penalties[p]) for p in usable]
        options[name] = sizes[name]
        if profiles:
            options[name] = [Choice(p, profiles[p].nodes[name], penalties[p]) for p in usable]
    return _Problem(options, sizes, sizes_model, uniforms, profiles, unpinned)


def _predicted_latency(problem: _Problem, plan: Mapping[str, str]) -> dict | None:
    """The profiler's sum for `plan`: the float model's time outside the planned nodes plus
    each node's time at its precision; beside it the uniform models' profiled totals."""
    if not problem.profiles:
        return None
    rest = problem.profiles["float"].other_us
    nodes = sum(problem.profiles[p].nodes[n] for n, p in plan.items())
    return {
        "profiled_us": round(rest + nodes, 2),
        "planned_nodes_us": round(nodes, 2),
        "other_us": round(rest, 2),
        "uniform_profiled_us": {p: round(t.total_us, 2) for p, t in problem.profiles.items()},
        "runs": PROFILE_RUNS,
        "threads": 1,
    }


def _start(problem: _Problem, scale: PenaltyScale, notes: list[str]) -> tuple[dict[str, str], str]:
    """The knapsack's plan within the scale's capacity; with an unbounded capacity (a budget
    larger than any drop the flip model can predict) each node's cheapest choice."""
    if math.isinf(scale.capacity):
        cheapest = {
            n: min(choices, key=lambda c: (c.cost, c.penalty, ORDER.index(c.precision))).precision
            for n, choices in problem.options.items()
        }
        return cheapest, "cheapest plan (the budget bounds no node)"
    plan = solve(problem.options, scale.capacity)
    if plan is not None:
        return {n: c.precision for n, c in plan.items()}, "knapsack plan"
    notes.append(
        "the analysis predicts no plan within the budget: the search starts from each node's "
        "least-penalty candidate"
    )
    start = {
        n: min(choices, key=lambda c: (max(c.penalty, 0.0), -ORDER.index(c.precision))).precision
        for n, choices in problem.options.items()
    }
    return start, "least-penalty plan"


def _feed(model: bytes, batches: Sequence[Batch]) -> dict[str, np.ndarray]:
    """The batch-1 feed every latency here is timed on (the fixed batch where the model has
    one)."""
    shapes = [i.shape for i in create_session(model, threads=1).get_inputs()]
    return latency_feed(batches[0].inputs, shapes)[0]


def _latency(models: Mapping[str, bytes], feed: Mapping[str, np.ndarray]) -> dict:
    """Median latency of the float, the all-int8 and the chosen model, measured here with one
    intra-op thread (stable on a shared machine), sessions alternated run by run."""
    labels = list(models)
    sessions = [
        create_session(
            models[k],
            threads=1,
            optimize=unfused_only_reason(onnx.load_model_from_string(models[k])) is None,
        )
        for k in labels
    ]
    timings = dict(zip(labels, measure_latency(sessions, dict(feed), LATENCY_RUNS), strict=True))
    float_ms, model_ms = timings["float"][0], timings["chosen"][0]
    block = {
        "batch": int(next(iter(feed.values())).shape[0]),
        "runs": LATENCY_RUNS,
        "threads": 1,
        "float_ms_median": float_ms,
        "model_ms_median": model_ms,
        "speedup": float_ms / model_ms if model_ms > 0 else None,
    }
    if "int8" in timings:
        int8_ms = timings["int8"][0]
        block["int8_ms_median"] = int8_ms
        block["vs_int8"] = int8_ms / model_ms if model_ms > 0 else None
    return block


def _references(
    problem: _Problem, scorer: Scorer, budget: Budget, stamp: int
) -> dict[str, Reference]:
    """Each uniform model scored on the evaluation set, sized as it would be written, beside
    the size the size model predicts for its plan."""
    references = {}
    for precision, model in problem.references.items():
        score = scorer.score(model.serialized)
        references[precision] = Reference(
            precision,
            dict(model.plan),
            len(model.serialized) + stamp,
            problem.size_model.predict(model.plan),
            score.value,
            budget.holds(score.value, scorer.float_value),
        )
    return references


def search(
    prepared: Prepared,
    job: Job,
    spec: MixedPrecisionSpec,
    stats_path: Path | None,
    progress: bool = True,
    console: Console | None = None,
    keep_models: bool = False,
) -> MixedOutcome:
    """Choose the per-node precisions: the Plan, and the model built and verified for it.
    `keep_models`: keep the measured models in the outcome (benchmarks time them)."""
    console = console or Console()
    if job.evaluation is None or job.evaluation_data is None:
        raise RecipeError(
            f"{job.where}: evaluation: is required for mixed precision (plans are verified on "
            "its data)"
        )
    float_model = prepared.model
    float_model.hold_bytes()  # every plan's session and the scorer's float one read them
    if float_model.serialized is None:
        raise ModelError(
            f"{job.where}: mixed precision does not support models stored as external data "
            "(over 2 GB) yet"
        )
    if job.build.algorithms.int8_fallback is not None:
        raise RecipeError(
            f"{job.where}: quantization.algorithms.int8_fallback and mixed precision (--auto, "
            "mixed_precision:) both choose which layers keep 8 bits: use one of them"
        )
    notes: list[str] = []
    explicit = spec.candidates is not None
    target = job.build.quantization.target
    candidates = model_candidates(spec, target, _opset(float_model.model), job.where, notes)
    analysis_rows, batches = split_rows(
        _evaluation_batches(job), spec.samples, job.evaluation_data.spec.where
    )
    labelled = batches[0].labels is not None
    budget = resolve_budget(spec, job.evaluation, labelled, job.where)
    # Passed to analyze only where it differs from the gate analyze picks by itself, so that a
    # plain `qtool analyze` run and this one share their cache.
    default = choose_metric(job.evaluation, labelled, "", None).name
    requested = None if default == budget.metric else budget.metric
    analysis = analyze(
        prepared,
        job,
        stats_path=stats_path,
        modes=ANALYSIS_MODES,
        candidates=tuple(p for p in candidates if p != "float"),
        samples=analysis_rows,
        metric=requested,
        progress=progress,
    )
    notes.extend(analysis.notes)
    algorithms = job.build.algorithms.names()
    if algorithms:
        notes.append(
            f"quantization.algorithms ({', '.join(algorithms)}): the analysis predicts each "
            "node's penalty without them; every plan verified below is built with them, and the "
            "model written is the one verified"
        )
    stats_path = stats_path or job.outputs.stats
    statistics = _statistics(prepared, job, stats_path)
    assembler = Assembler(job.build, float_model.model, statistics.by_name(), statistics.hessians)
    feed = _feed(float_model.serialized, batches)
    timed = feed if spec.objective == "latency" else None
    scorer = Scorer(
        float_model.serialized, batches, job.evaluation, budget.metric, fused=target == "ort-cpu"
    )
    labels = [b.labels for b in scorer.batches] if scorer.labelled else None
    scale = penalty_scale(budget, scorer.reference, labels)
    stamp = _stamp_bytes(float_model, job, statistics)
    with phase("pricing each node's precisions"):
        problem = _problem(
            job, prepared, analysis, assembler, candidates, explicit, scale, stamp, notes, timed
        )
    start, action = _start(problem, scale, notes)
    console.print(
        f"mixed precision: minimise {spec.objective} within {budget.describe()}; float "
        f"{scorer.metric.name} {scorer.float_value:.5g} on {scorer.samples} evaluation samples "
        f"(verification rows: those after the {analysis_rows} the analysis measured)",
        highlight=False,
        markup=False,
    )
    references = _references(problem, scorer, budget, stamp)
    # Kept: the plan measured last (it may pass) and the best so far (a passing plan, or the
    # failed plan if none passes: a pass always has the smaller penalty), each as the Built the
    # build stage made and the bytes scored.
    built: dict[tuple, tuple[tuple[float, int], Built, bytes]] = {}

    def measure(plan: Mapping[str, str]) -> Measured:
        pins = _pins(plan, problem.unpinned)
        layout = assembler.layout(pins)
        gap = assembler.missing(layout)
        if gap is not None:
            raise CalibrationError(
                f"{stats_path}: cannot build a mixed plan: {gap} (the statistics the "
                "analysis calibrated do not cover this combination of precisions)"
            )
        if algorithms:  # the whole build stage: the model written is the model verified
            # with the plan's pins in its settings: AWQ and the INT8 fallback re-plan the model
            # they change, which without them fell back to the recipe's precisions (every plan
            # measured was the recipe's own model)
            pinned = with_overrides(job.build.quantization, pins)
            settings = dataclasses.replace(job.build, quantization=pinned)
            candidate = build_quantized(float_model, layout, statistics, settings, False)
        else:
            candidate = assembler.built(layout)
        model = candidate.model.SerializeToString()
        score = scorer.score(model)
        size = len(model) + stamp  # the file as finish writes it
        measured = Measured(score.value, score.penalty, score.sqnr_db, score.cosine, size)
        key = tuple(sorted(plan.items()))
        best = min(built.items(), key=lambda kv: kv[1][0], default=None)
        built.clear()
        if best is not None:
            built[best[0]] = best[1]
        built[key] = ((measured.penalty, measured.size), candidate, model)
        return measured

    def report(iteration: Iteration) -> None:
        line = iteration_line(iteration, budget, scorer.float_value)
        console.print(line, highlight=False, markup=False)

    float_size = problem.size_model.all_float()

    def verify_one(index: int, what: str, plan: Mapping[str, str]) -> Iteration:
        return measure_iteration(
            index,
            what,
            plan,
            problem.options,
            problem.sizes,
            scale,
            budget,
            scorer.float_value,
            float_size,
            measure,
        )

    # Never larger than a passing reference: a size question, so for the size objective only.
    smallest = None
    if spec.objective == "size":
        smallest = ceiling(list(references.values()), problem.options)
    with phase("verifying mixed-precision plans"):
        result = verify_and_promote(
            start,
            problem.options,
            analysis,
            budget,
            scale,
            scorer.float_value,
            float_size,
            measure,
            spec.max_iterations,
            action,
            sizes=problem.sizes,
            report=report,
            ceiling=None if smallest is None else (smallest.size, smallest.label),
        )
        note = prefer_reference(result, smallest, verify_one, report)
    if note is not None:
        notes.append(note)
    chosen = result.chosen
    _, chosen_built, model_bytes = built[tuple(sorted(chosen.precisions.items()))]
    with phase("measuring latency"):
        timed_models = {"float": float_model.serialized, "chosen": model_bytes}
        if "int8" in problem.references:
            timed_models["int8"] = problem.references["int8"].serialized
        latency = _latency(timed_models, feed)
    predicted_latency = _predicted_latency(problem, chosen.precisions)
    if predicted_latency is not None:
        notes.append(
            "latency per node: medians of ONNX Runtime's profiler over "
            f"{PROFILE_RUNS} runs, one intra-op thread, on this machine; profiled sums exclude "
            "session overhead and are noisy on a shared machine"
        )

    for name in problem.unpinned:  # what the recipe made of them, as written
        chosen.precisions[name] = chosen_built.layout.plan[name].precision
    quantization = with_overrides(
        job.build.quantization, _pins(chosen.precisions, problem.unpinned)
    )
    out = job.outputs.folder
    if result.passed:
        plan_path = out / "plan.yaml"
        model_path = job.outputs.quantized_model(quantization.model_tag)
        heading = "the plan `qtool quantize --auto` chose"
    else:
        plan_path, model_path = out / "plan.failed.yaml", out / "model.failed.onnx"
        heading = "FAILED: the best plan `qtool quantize --auto` found; it misses the budget"
    comments = [
        f"qtool mixed precision of {job.where}: {heading} ({budget.describe()}).",
        f"measured {scorer.metric.name} {chosen.measured.value:.6g} (float "
        f"{scorer.float_value:.6g}) on {scorer.samples} evaluation samples (after the "
        f"{analysis_rows} the analysis measured).",
    ]
    text = plan_yaml(float_model.structure(), quantization, chosen_built.layout.plan, comments)
    block = mixed_block(
        spec,
        budget,
        scale,
        scorer,
        analysis,
        candidates,
        problem.sizes,
        problem.options,
        result,
        references,
        len(float_model.serialized),
        latency,
        {"plan": str(plan_path), "model": str(model_path)},
        notes,
        bool(problem.profiles),
        predicted_latency,
    )
    models = {}
    if keep_models:
        models = {"float": float_model.serialized, "chosen": model_bytes}
        models.update({p: uniform.serialized for p, uniform in problem.references.items()})
    return MixedOutcome(
        result.passed,
        model_path,
        {plan_path: text.encode()},
        block,
        chosen_built,
        statistics,
        notes,
        models,
    )


__all__ = ["MixedOutcome", "SearchResult", "search"]
