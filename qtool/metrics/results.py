"""What an evaluation found: per-model, per-output and per-variant numbers, and their JSON form.

Plain data with no I/O, so the loop that fills them (metrics/evaluate.py), the gates that judge
them (metrics/gates.py) and the renderers (metrics/tables.py, metrics/junit.py) share one
vocabulary without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from qtool.errors import DataError
from qtool.metrics.signal import json_float
from qtool.ort.accuracy_level import ACCURACY_LEVELS, ORT_DEFAULT_ACCURACY_LEVEL
from qtool.ort.cpu import CpuFeatures
from qtool.runtime.low_bit import LowBitUsage

VARIANTS = ("fused", "unfused")


@dataclass
class ModelMetrics:
    """Per-model numbers; accuracy (on the gated output) is None without labels."""

    accuracy: float | None
    latency_ms_median: float
    latency_ms_p90: float
    file_bytes: int


@dataclass
class VariantMetrics:
    """One way of running the quantized model (fused or unfused) vs FP32, on one output.

    agreement is None for outputs without a class axis (rank < 2: no top-1 to agree on);
    accuracy is None except on the gated output of labelled data. On an output scored on
    next-token labels (metrics/tokens.py) agreement counts the predicted positions only, and
    perplexity and kl (mean KL(FP32 || quantized) in nats) are set.
    """

    sqnr_db: float
    cosine: float
    agreement: float | None
    accuracy: float | None = None
    perplexity: float | None = None
    kl: float | None = None


@dataclass
class FusedVsUnfused:
    """The fused model against its own unfused QDQ semantics on one output: what ORT's kernels
    change. `top1_changed` is None without a class axis (rank < 2)."""

    sqnr_db: float
    top1_changed: int | None
    predictions: int

    def to_dict(self) -> dict:
        return {
            "sqnr_db": json_float(self.sqnr_db),
            "top1_changed": self.top1_changed,
            "top1_predictions": self.predictions if self.top1_changed is not None else None,
        }


@dataclass
class OutputResult:
    """Every metric of one model output, fused and unfused.

    `kind` ("class_scores" | "dense", metrics/kinds.py) and `rows` (the metric rows the table
    shows) are set by evaluate_models from the data; a result built by hand leaves them None,
    and then every metric that has a value is shown.
    """

    name: str
    fused: VariantMetrics | None  # None: no fused variant (EvalResult.unfused_only says why)
    unfused: VariantMetrics
    fp32_accuracy: float | None = None
    kind: str | None = None
    kind_evidence: str | None = None
    rows: tuple[str, ...] | None = None
    fused_vs_unfused: FusedVsUnfused | None = None
    # Set on an output scored on next-token labels: FP32's perplexity and the predicted tokens.
    fp32_perplexity: float | None = None
    tokens: int | None = None

    def variant(self, name: str) -> VariantMetrics | None:
        return self.fused if name == "fused" else self.unfused

    @property
    def scores_tokens(self) -> bool:
        return self.fp32_perplexity is not None

    @property
    def judged_variant(self) -> str:
        """The variant gates judge: fused (what deploys on the CPU) where there is one, else
        unfused (a float8 model, which ORT's CPU provider runs only unfused)."""
        return "fused" if self.fused is not None else "unfused"

    @property
    def judged(self) -> VariantMetrics:
        return self.fused if self.fused is not None else self.unfused

    def to_dict(self) -> dict:
        def variant(m: VariantMetrics | None) -> dict | None:
            if m is None:
                return None
            entry = {
                "accuracy": m.accuracy,
                "agreement": m.agreement,
                "sqnr_db": json_float(m.sqnr_db),
                "cosine": m.cosine,
            }
            if self.scores_tokens:
                entry["perplexity"] = _json_optional(m.perplexity)
                entry["kl"] = _json_optional(m.kl)
            return entry

        gap = self.fused_vs_unfused
        tokens = {}
        if self.scores_tokens:
            tokens = {
                "fp32_perplexity": _json_optional(self.fp32_perplexity),
                "tokens": self.tokens,
            }
        return {
            "name": self.name,
            "fp32_accuracy": self.fp32_accuracy,
            **tokens,
            "fused": variant(self.fused),
            "unfused": variant(self.unfused),
            "kind": self.kind,
            "kind_evidence": self.kind_evidence,
            "rows": None if self.rows is None else list(self.rows),
            "fused_vs_unfused": None if gap is None else gap.to_dict(),
        }


def _json_optional(value: float | None) -> float | str | None:
    return None if value is None else json_float(value)


def perplexity_rise(fp32: float, quantized: float) -> float:
    """How much higher the quantized model's perplexity is than FP32's, in percent (negative:
    lower). What `max_drop` counts for the perplexity metric."""
    return (quantized / fp32 - 1.0) * 100.0


@dataclass
class EvalWarning:
    """What the numbers alone do not say: `code` is stable for scripts, `message` for people."""

    code: str  # "fused_below_unfused" | "foreign_fp32" | "no_provenance"
    message: str


class JudgedGate(Protocol):
    """A judged CI gate as the JSON report needs it (metrics/gates.py GateResult): typed by its
    shape, so results need not import the gates that judge them."""

    passed: bool

    def to_dict(self) -> dict: ...


@dataclass
class EvalResult:
    """FP32 vs quantized. `quant` is the fused model (what deploys); every output is in `outputs`.

    `output` is the gated output: labels are compared with its top-1, and the properties
    `agreement`, `sqnr_db`, `cosine` are its fused numbers.
    """

    fp32: ModelMetrics
    quant: ModelMetrics
    samples: int
    outputs: list[OutputResult]
    output: str
    # Batch size of the latency runs: 1 unless the model's batch axis is fixed to another size.
    latency_batch: int = 1
    latency_runs: int = 0
    warnings: list[EvalWarning] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)
    cpu: CpuFeatures | None = None
    fp32_path: Path | None = None
    quant_path: Path | None = None
    # What runs the 4-bit / blocked weights, and MatMulNBits' accuracy level (None: ORT default).
    low_bit: LowBitUsage | None = None
    accuracy_level: int | None = None
    # accuracy_level -> MatMulNBits nodes written in the model file (the session option does not
    # reach them; it applies to the nodes ORT forms from DequantizeLinear -> MatMul).
    written_levels: dict[int, int] = field(default_factory=dict)
    # The user's model file the quantized model records it was made from (provenance), when it
    # does: its size is what "smaller" is measured against, besides the prepared FP32 file.
    source_bytes: int | None = None
    # Why the quantized model has no fused variant on this CPU (float8 Q/DQ), or None; then the
    # gates, the change column and the latency are the unfused run's.
    unfused_only: str | None = None
    # How a file the CPU cannot run was measured instead (BF16: an FP32 emulation), or None.
    emulated: str | None = None

    @property
    def judged_variant(self) -> str:
        return "unfused" if self.unfused_only is not None else "fused"

    def accuracy_level_note(self) -> str | None:
        """Which MatMulNBits compute the fused numbers came from, when MatMulNBits ran."""
        if self.low_bit is None or not self.low_bit.kernels.get("MatMulNBits"):
            return None
        notes = [
            f"{count} written with accuracy level {level}: {ACCURACY_LEVELS.get(level, '?')}"
            for level, count in sorted(self.written_levels.items())
        ]
        formed = self.low_bit.kernels["MatMulNBits"] - sum(self.written_levels.values())
        if formed > 0:
            level = self.accuracy_level
            source = "set by the recipe/CLI"
            if level is None:
                level, source = ORT_DEFAULT_ACCURACY_LEVEL, "ORT's session default"
            notes.append(
                f"{formed} formed from QDQ at accuracy level {level}: {ACCURACY_LEVELS[level]} "
                f"({source})"
            )
        elif self.accuracy_level is not None:
            notes.append(
                f"the session's accuracy level {self.accuracy_level} does not apply to nodes "
                "written as MatMulNBits"
            )
        return "MatMulNBits: " + "; ".join(notes)

    @property
    def has_labels(self) -> bool:
        return self.fp32.accuracy is not None and self.quant.accuracy is not None

    def gated(self) -> OutputResult:
        return next(o for o in self.outputs if o.name == self.output)

    @property
    def agreement(self) -> float | None:
        return self.gated().judged.agreement

    @property
    def sqnr_db(self) -> float:
        return self.gated().judged.sqnr_db

    @property
    def cosine(self) -> float:
        return self.gated().judged.cosine

    def drop_points(self, metric: str, variant: str | None = None) -> float:
        """Points lost on the gated output: accuracy (FP32 - quantized) or top-1 disagreement;
        for perplexity, the percent it rose over FP32's. `variant` None: the judged one (fused,
        or unfused where there is no fused variant)."""
        gated = self.gated()
        measured = gated.variant(variant) if variant is not None else gated.judged
        if measured is None:
            raise DataError(f"there is no {variant} variant: {self.unfused_only}")
        if metric == "perplexity":
            if gated.fp32_perplexity is None or measured.perplexity is None:
                raise DataError(
                    f"perplexity needs next-token labels for output {self.output!r} (a text: "
                    "data source), but the evaluation data has none"
                )
            return perplexity_rise(gated.fp32_perplexity, measured.perplexity)
        if metric == "accuracy":
            if gated.fp32_accuracy is None or measured.accuracy is None:
                raise DataError("accuracy needs labels, but the evaluation data has none")
            return (gated.fp32_accuracy - measured.accuracy) * 100.0
        if measured.agreement is None:
            raise DataError(
                f"output {self.output!r} has no class axis (rank < 2), so top-1 agreement is "
                "undefined; gate it with a cosine or SQNR floor"
            )
        return (1.0 - measured.agreement) * 100.0

    def default_metric(self) -> str:
        """Perplexity on next-token labels, else accuracy with labels, else agreement."""
        if self.gated().scores_tokens:
            return "perplexity"
        return "accuracy" if self.has_labels else "agreement"

    def accuracy_drop_points(self) -> float:
        """The default gate number (fused): perplexity rise on next-token labels, accuracy lost
        with other labels, else top-1 disagreement."""
        return self.drop_points(self.default_metric())

    def speedup(self) -> float:
        """FP32 median latency over the quantized median (fused, or unfused where there is no
        fused variant; > 1 means the quantized is faster)."""
        return self.fp32.latency_ms_median / self.quant.latency_ms_median

    def size_ratio(self) -> float:
        """FP32 file size over quantized file size (> 1 means the quantized is smaller)."""
        return self.fp32.file_bytes / self.quant.file_bytes

    def source_ratio(self) -> float | None:
        """The user's model file size over the quantized file's (None when not recorded)."""
        if self.source_bytes is None:
            return None
        return self.source_bytes / self.quant.file_bytes

    def to_dict(self, gates: Iterable[JudgedGate] = ()) -> dict:
        """JSON-ready, with the judged `gates` (qtool.metrics.gates): strict JSON has no Infinity,
        so an infinite SQNR is written as "inf"."""
        gates = list(gates)
        ratio = self.speedup()
        return {
            "models": {
                "fp32": None if self.fp32_path is None else str(self.fp32_path),
                "quant": None if self.quant_path is None else str(self.quant_path),
            },
            "samples": self.samples,
            "gated_output": self.output,
            "labels": self.has_labels,
            "outputs": [o.to_dict() for o in self.outputs],
            "gates": [g.to_dict() for g in gates],
            "passed": all(g.passed for g in gates),
            "warnings": [{"code": w.code, "message": w.message} for w in self.warnings],
            "fused_variant": {
                "available": self.unfused_only is None,
                "why_not": self.unfused_only,
                "judged": self.judged_variant,
            },
            "emulated": self.emulated,
            "latency": {
                "compared": "fp32 vs quantized fused (ORT_ENABLE_ALL)"
                if self.unfused_only is None
                else "fp32 vs quantized unfused (ORT_DISABLE_ALL: no fused variant)",
                "batch": self.latency_batch,
                "runs": self.latency_runs,
                "fp32_ms": {
                    "median": self.fp32.latency_ms_median,
                    "p90": self.fp32.latency_ms_p90,
                },
                "quant_ms": {
                    "median": self.quant.latency_ms_median,
                    "p90": self.quant.latency_ms_p90,
                },
                # FP32 median / quantized median: > 1 the quantized model is faster, < 1 slower.
                "fp32_over_quant_median": ratio,
                "quant_is": "faster" if ratio >= 1.0 else "slower",
            },
            "size": {
                "fp32_bytes": self.fp32.file_bytes,
                "quant_bytes": self.quant.file_bytes,
                "ratio": self.size_ratio(),
                "source_bytes": self.source_bytes,
                "source_ratio": self.source_ratio(),
            },
            "cpu": None if self.cpu is None else self.cpu.to_dict(),
            "provenance": self.provenance,
            "low_bit": None if self.low_bit is None else self.low_bit.to_dict(),
            "matmul_nbits_accuracy_level": self.accuracy_level_note(),
        }
