"""The model-level keep-only-if-better rule: a recipe's range method and algorithms ship only
where their model beats plain min-max on the tuning rows.

Each algorithm checks itself layer by layer (SmoothQuant per input, AdaRound and bias correction
per layer, all on tuning rows), but layer choices that each help can still add up to a worse
model, and a clipping range method can cut what rows it never saw need. So when the recipe's
model differs from plain min-max (qtool/pipeline/tuning.py, `compares_with_minmax`), the build
also makes the plain one, the same plan with min-max ranges and no algorithm, from the same
calibration pass (every observer keeps its exact min/max beside its histogram), and both are
scored on the tuning rows with the evaluation gate's metric (TuningScore), as their QDQ
semantics (ORT_DISABLE_ALL: the same on every CPU). The recipe's model is kept only when it is
strictly better; on a tie the metric falls back to output SQNR, and on a tie there too the
simpler model (min-max) is kept. `report.json` `model_choice` says which was kept and gives both
scores. Cross-layer equalization is not judged here: it changes the float model both candidates
are built from (docs/algorithms.md).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx

from qtool.algorithms.spec import Algorithms
from qtool.data.batches import Batch
from qtool.errors import DataError, ModelError
from qtool.metrics.labels import LabelAccuracy
from qtool.metrics.signal import SignalQuality, json_float
from qtool.model.inline_write import write_model
from qtool.ort.sessions import as_declared, create_session, ort_reason, runs_by_rows
from qtool.phases import phase
from qtool.pipeline import planning
from qtool.pipeline.build import BuildSettings, Built, build_quantized
from qtool.pipeline.float_model import FloatModel
from qtool.pipeline.statistics import Statistics
from qtool.pipeline.tuning import TuningScore
from qtool.plan.layout import Layout

RECIPE, MINMAX = "recipe", "minmax"


@dataclasses.dataclass
class Scores:
    """One candidate's numbers on the tuning rows (None: not measurable there)."""

    sqnr_db: float
    cosine: float | None
    agreement: float | None
    accuracy: float | None

    def value(self, metric: str) -> float | None:
        return self.sqnr_db if metric == "sqnr" else getattr(self, metric)

    def to_dict(self) -> dict:
        return {
            "sqnr_db": json_float(self.sqnr_db),
            "cosine": self.cosine,
            "agreement": self.agreement,
            "accuracy": self.accuracy,
        }


def plain_settings(settings: BuildSettings) -> BuildSettings:
    """The recipe's build settings with min-max ranges and no algorithm: the baseline."""
    calibration = dataclasses.replace(settings.calibration, method="minmax")
    return dataclasses.replace(
        settings, calibration=calibration, algorithms=Algorithms(), compare_minmax=False
    )


def build_kept(
    float_model: FloatModel,
    layout: Layout,
    statistics: Statistics,
    settings: BuildSettings,
    progress: bool,
) -> Built:
    """The recipe's model, or plain min-max where that is at least as good on the tuning rows
    (module docstring); `Built.choice` records the comparison."""
    built = build_quantized(float_model, layout, statistics, settings, progress)
    if not settings.compare_minmax:
        return built
    if not layout.activations and not settings.algorithms:
        # Nothing reads a range (weight-only, dynamic, float) and no algorithm runs: plain
        # min-max is this very model. Built and scored anyway, it cost a decoder two more
        # sessions and its tuning logits (examples/smollm: 2.6 GB against 0.7 GB).
        built.choice = {
            "kept": RECIPE,
            "metric": settings.score.metric,
            "recipe_model": {"method": settings.calibration.method, "algorithms": []},
            "reason": "the plan quantizes no activation with a calibrated range and the recipe "
            "runs no algorithm: plain min-max is the same model, so nothing was compared",
        }
        return built
    if settings.tuning is None:
        raise ValueError("the comparison with plain min-max needs tuning rows")
    if float_model.model is None and float_model.staged is not None:
        float_model.model = float_model.staged.load()  # the first build let go of it
    baseline = plain_settings(settings)
    plain_layout = planning.plan(float_model.model, baseline.quantization, "minmax", settings.where)
    with phase("plain min-max model (the baseline the recipe's model must beat)"):
        plain = build_quantized(float_model, plain_layout, statistics, baseline, progress)
    with phase("scoring both models on the tuning rows"):
        output, rows, scores = score_models(
            float_model.session_source(),
            {RECIPE: built.model, MINMAX: plain.model},
            (batch for batch in settings.tuning.batches()),
            settings.score,
        )
    kept = choose(scores, settings.score.metric)
    choice = {
        "kept": kept,
        "metric": settings.score.metric,
        "output": output,
        "tuning_samples": rows,
        "scores": {name: value.to_dict() for name, value in scores.items()},
        "recipe_model": {
            "method": settings.calibration.method,
            "algorithms": list(settings.algorithms.names()),
        },
        "reason": _reason(kept, scores, settings.score.metric),
    }
    if kept == RECIPE:
        built.choice = choice
        return built
    # The algorithms' own report entries stay in the report, under the rejected model.
    choice["rejected_algorithms"] = built.algorithms
    plain.choice = choice
    return plain


def choose(scores: dict[str, Scores], metric: str) -> str:
    """RECIPE when strictly better on `metric` (then on SQNR where that ties), else MINMAX."""
    for key in (metric, "sqnr"):
        ours, theirs = scores[RECIPE].value(key), scores[MINMAX].value(key)
        if ours is None or theirs is None:
            raise DataError(f"the tuning rows give no {key} to compare the models on")
        if ours != theirs:
            return RECIPE if ours > theirs else MINMAX
    return MINMAX


def _reason(kept: str, scores: dict[str, Scores], metric: str) -> str:
    ours, theirs = scores[RECIPE].value(metric), scores[MINMAX].value(metric)
    if kept == RECIPE:
        return (
            f"the recipe's model is better on the tuning rows ({metric} {ours:.6g} > {theirs:.6g})"
        )
    return (
        f"plain min-max is at least as good on the tuning rows ({metric} {theirs:.6g} vs the "
        f"recipe's {ours:.6g}): the recipe's range method and algorithms are not applied"
    )


def score_models(
    float_source: bytes | Path,
    candidates: dict[str, onnx.ModelProto],
    batches: Iterable[Batch],
    score: TuningScore,
) -> tuple[str, int, dict[str, Scores]]:
    """Each candidate against the float model on `batches`, as QDQ semantics, at the output
    `score` names: that output, the samples scored, and the scores."""
    with tempfile.TemporaryDirectory(prefix="qtool-keep-") as tmp:
        paths = {}
        for name, model in candidates.items():
            paths[name] = Path(tmp) / f"{name}.onnx"
            write_model(model, paths[name])  # over 2 GB: with external data
        sessions = {
            name: create_session(path, optimize=False, spinning=False)
            for name, path in paths.items()
        }
    reference = create_session(float_source, spinning=False)
    names = [o.name for o in reference.get_outputs()]
    output = score.output or names[0]
    if output not in names:
        raise ModelError(f"the model has no output {output!r} (outputs: {', '.join(names)})")
    qualities = {name: SignalQuality(cosine="rows", top1=True) for name in candidates}
    accuracies = {name: LabelAccuracy() for name in candidates}
    rows = 0
    for index, batch in enumerate(batches):
        try:
            # a large batch (an LLM's logits) runs a few rows at a time: runs_by_rows
            for rows_run, (ref,) in runs_by_rows(reference, [output], batch.inputs):
                part = batch.rows(rows_run.start, rows_run.stop)
                feed = dict(part.inputs)
                # a candidate written with float_io: float_type declares FP16 inputs: fed so
                tests = {
                    name: s.run([output], as_declared(feed, s))[0] for name, s in sessions.items()
                }
                for name, test in tests.items():
                    qualities[name].update(ref, test)
                    if part.labels is not None and np.ndim(test) >= 2:
                        accuracies[name].update(test, part.labels)
        except Exception as exc:  # ORT raises private types for bad feeds
            raise DataError(f"tuning batch {index} failed: {ort_reason(exc)}") from None
        rows += len(batch)
    if not rows:
        raise DataError("no tuning rows to compare the models on")
    if score.metric == "accuracy" and any(a.value() is None for a in accuracies.values()):
        raise DataError("the evaluation gate counts accuracy, but the tuning rows have no labels")
    return (
        output,
        rows,
        {
            name: Scores(
                q.sqnr_db(),
                q.cosine() if q.rows else None,
                q.agreement(),
                accuracies[name].value(),
            )
            for name, q in qualities.items()
        },
    )
