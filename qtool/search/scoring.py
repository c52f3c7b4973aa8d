"""Score a model variant on the analysis subset with the metric `qtool evaluate` gates on.

The float model runs once and its gated output is kept; every variant then runs fused (as ONNX
Runtime deploys it, the model the gates judge; for a target other than ort-cpu, and for float8,
unfused: the QDQ semantics the target's own kernels compute) on the same batches and is compared
with the accumulators evaluate uses, so a drop measured here is the drop `qtool evaluate` would
report on these samples. Each metric also has a *penalty* that is 0 for the float model and
grows as the variant gets worse, in units where penalties of separate nodes roughly add up
(points of accuracy or agreement, percent of perplexity gained, 1 - cosine, noise-to-signal
power): the mixed-precision search sums them.

Memory: the float model's gated output of every analysis batch is kept, for SQNR and cosine;
for a decoder's logits that is window x vocabulary floats per sample (512 tokens of a 49k
vocabulary: 100 MB), so an LLM is analysed on a few windows (`--samples`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from qtool.data.batches import Batch
from qtool.errors import DataError, ModelError, RecipeError
from qtool.metrics.labels import LabelAccuracy
from qtool.metrics.results import perplexity_rise
from qtool.metrics.signal import SignalQuality, noise_ratio_from_db
from qtool.metrics.spec import EvaluationSpec, default_metric
from qtool.metrics.tokens import TokenQuality
from qtool.ort.float8 import unfused_only_reason
from qtool.ort.sessions import as_declared, create_session

METRICS = ("accuracy", "agreement", "perplexity", "cosine", "sqnr")
_UNITS = {
    "accuracy": "points of accuracy lost vs float",
    "agreement": "points of top-1 disagreement with float",
    "perplexity": "percent of perplexity gained over float",
    "cosine": "1 - cosine to float",
    "sqnr": "noise-to-signal power ratio (10^(-SQNR/10))",
}


@dataclass(frozen=True)
class Metric:
    """The number a variant is judged by, and where that choice came from (said in the output)."""

    name: str  # one of METRICS
    output: str  # the gated model output
    source: str

    @property
    def penalty_unit(self) -> str:
        return _UNITS[self.name]

    @property
    def value_unit(self) -> str:
        return {"accuracy": "%", "agreement": "%", "perplexity": "", "cosine": "", "sqnr": "dB"}[
            self.name
        ]

    def describe(self) -> str:
        what = {
            "accuracy": "accuracy",
            "agreement": "top-1 agreement with float",
            "perplexity": "perplexity on the next-token labels",
            "cosine": "cosine to float",
            "sqnr": "SQNR vs float",
        }[self.name]
        return f"{what} of output {self.output!r} ({self.source}); penalty: {self.penalty_unit}"

    def penalty(self, value: float, float_value: float) -> float:
        """How much worse than float `value` is (0 for float itself; may be negative)."""
        if self.name in ("accuracy", "agreement"):
            return float_value - value
        if self.name == "perplexity":
            return perplexity_rise(float_value, value)
        if self.name == "cosine":
            return 1.0 - value
        return noise_ratio_from_db(value)


def choose_metric(
    evaluation: EvaluationSpec, labelled: bool, output: str, requested: str | None = None
) -> Metric:
    """The gate `qtool evaluate` would judge, one of them: an explicit metric (--metric, then
    evaluation.metric) wins; then max_drop's metric, min_cosine, min_sqnr; else perplexity on
    text, accuracy with other labels and top-1 agreement without."""
    if requested is not None:
        if requested not in METRICS:
            raise RecipeError(f"--metric: must be one of {', '.join(METRICS)}, got {requested!r}")
        name, source = requested, "--metric"
    elif evaluation.metric is not None:
        name, source = evaluation.metric, "evaluation.metric"
    elif evaluation.max_drop is None and evaluation.min_cosine is not None:
        name, source = "cosine", "evaluation.min_cosine"
    elif evaluation.max_drop is None and evaluation.min_sqnr is not None:
        name, source = "sqnr", "evaluation.min_sqnr"
    else:
        name = default_metric(evaluation.data, labelled)
        source = {
            "perplexity": "the evaluation data is text",
            "accuracy": "the evaluation data has labels",
            "agreement": "the evaluation data has no labels",
        }[name]
    if name in ("accuracy", "perplexity") and not labelled:
        raise DataError(f"{source}: {name} needs labels, but the evaluation data has none")
    return Metric(name, output, source)


@dataclass(frozen=True)
class Score:
    """One variant on the analysis subset: the metric's value and penalty, with SQNR and cosine
    of the gated output for reference, and for accuracy and agreement the margin noise (the mean
    squared change of the top-1 margin: continuous where the metric is a step; NaN otherwise)."""

    value: float
    penalty: float
    sqnr_db: float
    cosine: float
    margin_noise: float = math.nan


class Scorer:
    """The float model's gated output on the analysis batches, and the metric to compare with."""

    def __init__(
        self,
        float_model: bytes,
        batches: Sequence[Batch],
        evaluation: EvaluationSpec,
        requested_metric: str | None = None,
        threads: int | None = None,
        fused: bool = True,
    ) -> None:
        if not batches:
            raise DataError(f"{evaluation.data.where}: the analysis subset is empty")
        self.batches = list(batches)
        self.threads = threads
        # ort-cpu: what deploys is ORT's fused model. Another target (TensorRT) runs its own
        # kernels: the search scores the QDQ semantics (unfused), not ORT's CPU fusion.
        self.fused = fused
        session = create_session(float_model, threads=threads, optimize=True)
        names = [o.name for o in session.get_outputs()]
        output = evaluation.output or names[0]
        if output not in names:
            raise ModelError(
                f"evaluation.output {output!r}: the model has no such output "
                f"(outputs: {', '.join(names)})"
            )
        labelled = self.batches[0].labels is not None
        self.metric = choose_metric(evaluation, labelled, output, requested_metric)
        self.reference = [session.run([output], b.inputs)[0] for b in self.batches]
        if self.metric.name in ("accuracy", "agreement", "perplexity"):
            if self.reference[0].ndim < 2:
                raise DataError(
                    f"output {output!r} has shape {self.reference[0].shape}: no class axis for "
                    f"{self.metric.name} ({self.metric.source}); analyze with --metric cosine"
                )
        self.samples = sum(len(b) for b in self.batches)
        self.labelled = self.metric.name == "accuracy"
        self.tokens = self.metric.name == "perplexity"
        if self.tokens:
            self.float_value = self._perplexity(self.reference)
        elif self.labelled:
            correct = sum(
                int(np.count_nonzero(np.argmax(ref, axis=-1) == b.labels))
                for ref, b in zip(self.reference, self.batches, strict=True)
            )
            predictions = sum(int(np.argmax(ref, axis=-1).size) for ref in self.reference)
            self.float_value = 100.0 * correct / predictions
        else:
            self.float_value = {"agreement": 100.0, "cosine": 1.0, "sqnr": math.inf}[
                self.metric.name
            ]

    def _perplexity(self, outputs: Sequence[np.ndarray]) -> float:
        """Perplexity of the gated outputs of the analysis batches on their labels."""
        scored = TokenQuality()
        for out, batch in zip(outputs, self.batches, strict=True):
            if batch.labels.shape != out.shape[:-1]:
                raise DataError(
                    f"labels of shape {batch.labels.shape} do not fit output "
                    f"{self.metric.output!r} {out.shape}: perplexity needs one label per "
                    "position (the text source's next tokens)"
                )
            scored.update(out, batch.labels)
        value = scored.perplexity()
        if value is None:
            raise DataError(
                f"{self.metric.source}: no position of the analysis batches has a label"
            )
        return value

    def score(self, model: bytes) -> Score:
        """Run `model` fused over the analysis batches and compare its gated output (unfused
        for a float8 model, which ORT's CPU provider runs no other way: ort/float8.py)."""
        fused = self.fused and unfused_only_reason(onnx.load_model_from_string(model)) is None
        session = create_session(model, threads=self.threads, optimize=fused)
        classes = self.metric.name in ("accuracy", "agreement")
        quality = SignalQuality(cosine="rows", top1=True, margin=classes)
        accuracy = LabelAccuracy()
        tokens = TokenQuality()
        for ref, batch in zip(self.reference, self.batches, strict=True):
            out = session.run([self.metric.output], as_declared(batch.inputs, session))[0]
            if out.shape != ref.shape:
                raise ModelError(
                    f"output {self.metric.output!r} has shape {out.shape} in a variant but "
                    f"{ref.shape} in the float model"
                )
            quality.update(ref, out)
            if self.labelled:
                accuracy.update(out, batch.labels)
            if self.tokens:
                tokens.update(out, batch.labels)
        sqnr_db, cosine = quality.sqnr_db(), quality.cosine()
        if self.metric.name == "perplexity":
            value = tokens.perplexity()
        elif self.metric.name == "accuracy":
            value = 100.0 * accuracy.value()
        elif self.metric.name == "agreement":
            value = 100.0 * quality.agreement()
        elif self.metric.name == "cosine":
            value = cosine
        else:
            value = sqnr_db
        penalty = self.metric.penalty(value, self.float_value)
        margin_noise = quality.margin_noise() if classes else None
        if margin_noise is None:
            margin_noise = math.nan
        return Score(value, penalty, sqnr_db, cosine, margin_noise)
