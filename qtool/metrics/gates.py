"""CI gates on an evaluation: which limits hold, judged on the fused model.

A gate is judged on the quantized model as ONNX Runtime fuses it, because that is what deploys
(a float8 model has no fused CPU variant: its gates judge the unfused run, and say so);
the unfused (QDQ) value is recorded beside it so a failure caused by the kernels rather than the
quantization is visible. Each gate passes or fails on its own, so a report says which limit broke.
A drop gate that would count top-1 agreement on an output that is not class scores
(metrics/kinds.py) is refused rather than judged: such an agreement flips on near-ties and would
fail a near-perfect model. The JUnit form of the judged gates is metrics/junit.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtool.errors import RecipeError
from qtool.metrics.kinds import DENSE
from qtool.metrics.results import EvalResult
from qtool.metrics.signal import format_db, json_float


@dataclass(frozen=True)
class Gates:
    """The CI gates, all judged on the gated output of the fused model (what deploys).

    metric None means perplexity on next-token labels, accuracy with other labels, else top-1
    agreement, which is refused on an output that is not class scores: cosine is the gate for
    embeddings, where top-1 agreement means nothing. A metric named explicitly is judged whatever
    the output. For perplexity, max_drop is the percent the quantized model's perplexity may
    exceed FP32's (relative, so one limit fits models whose perplexities differ). Where
    max_drop came from (an option or a recipe key) is `max_drop_source`, for the refusal.
    """

    metric: str | None = None
    max_drop: float | None = None
    min_cosine: float | None = None
    min_sqnr: float | None = None
    max_drop_source: str = "max_drop"


@dataclass
class GateResult:
    gate: str  # "max_drop" | "min_cosine" | "min_sqnr"
    output: str
    metric: str  # "accuracy" | "agreement" | "perplexity" | "cosine" | "sqnr_db"
    # fused: the number judged (max_drop: points lost; for perplexity, percent gained)
    value: float
    unfused_value: float  # for reference only
    limit: float
    passed: bool
    model: str = "fused"  # the variant judged: unfused where there is no fused variant

    @property
    def title(self) -> str:
        """A name that stays the same from run to run (CI systems track tests by name)."""
        if self.gate == "max_drop" and self.metric == "perplexity":
            return f"{self.output}: perplexity rise <= {self.limit:g}%"
        if self.gate == "max_drop":
            return f"{self.output}: {self.metric} drop <= {self.limit:g} points"
        if self.gate == "min_cosine":
            return f"{self.output}: cosine >= {self.limit:g}"
        return f"{self.output}: SQNR >= {self.limit:g} dB"

    def describe(self) -> str:
        if self.gate == "max_drop" and self.metric == "perplexity":
            return (
                f"output {self.output!r}: perplexity {self.value + 0.0:+.2f}% vs FP32 "
                f"(limit +{self.limit:.2f}%; unfused {self.unfused_value + 0.0:+.2f}%)"
            )
        if self.gate == "max_drop":
            return (
                f"output {self.output!r}: {self.metric} dropped {self.value:.2f} points "
                f"(limit {self.limit:.2f}; unfused {self.unfused_value:.2f})"
            )
        if self.gate == "min_cosine":
            return (
                f"output {self.output!r}: cosine {self.value:.5f} (floor {self.limit:g}; "
                f"unfused {self.unfused_value:.5f})"
            )
        return (
            f"output {self.output!r}: SQNR {format_db(self.value)} dB (floor {self.limit:g} dB; "
            f"unfused {format_db(self.unfused_value)} dB)"
        )

    def to_dict(self) -> dict:
        return {
            "gate": self.gate,
            "output": self.output,
            "metric": self.metric,
            "model": self.model,
            "value": json_float(self.value),
            "unfused_value": json_float(self.unfused_value),
            "limit": self.limit,
            "passed": self.passed,
        }


def judge_gates(result: EvalResult, gates: Gates) -> list[GateResult]:
    """Each active gate passes or fails on its own, judged on the fused model.

    Raises RecipeError (exit 2) for a max_drop that would count top-1 agreement, by default, on
    an output evaluate found not to be class scores."""
    judged: list[GateResult] = []
    output = result.output
    model = result.judged_variant
    if gates.max_drop is not None:
        metric = gates.metric or result.default_metric()
        if gates.metric is None and metric == "agreement" and result.gated().kind == DENSE:
            raise RecipeError(agreement_refusal(result, gates))
        drop = result.drop_points(metric)
        unfused = result.drop_points(metric, "unfused")
        passed = drop <= gates.max_drop
        judged.append(
            GateResult("max_drop", output, metric, drop, unfused, gates.max_drop, passed, model)
        )
    gated = result.gated()
    if gates.min_cosine is not None:
        value = gated.judged.cosine
        judged.append(
            GateResult(
                "min_cosine",
                output,
                "cosine",
                value,
                gated.unfused.cosine,
                gates.min_cosine,
                value >= gates.min_cosine,
                model,
            )
        )
    if gates.min_sqnr is not None:
        value = gated.judged.sqnr_db
        judged.append(
            GateResult(
                "min_sqnr",
                output,
                "sqnr_db",
                value,
                gated.unfused.sqnr_db,
                gates.min_sqnr,
                value >= gates.min_sqnr,
                model,
            )
        )
    return judged


def agreement_refusal(result: EvalResult, gates: Gates) -> str:
    """Why a default agreement drop gate is not judged on this output, and what to use."""
    gated = result.gated()
    return (
        f"{gates.max_drop_source}: output {gated.name!r} is not class scores "
        f"({gated.kind_evidence}): its top-1 agreement counts flips between near-equal values, "
        f"not changed predictions ({gated.judged_variant} cosine {gated.judged.cosine:.5f}); "
        "gate it with --min-cosine or --min-sqnr (evaluation.min_cosine / min_sqnr), or name the "
        "metric (--metric agreement, evaluation.metric: agreement) to gate agreement anyway"
    )
