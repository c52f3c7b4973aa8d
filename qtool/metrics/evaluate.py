"""Compare an FP32 ONNX model with its quantized version in ONNX Runtime, fused and unfused.

The quantized model runs twice per batch: as ONNX Runtime fuses it (ORT_ENABLE_ALL, what users
deploy: QLinearConv, QGemm, ... with the CPU's integer kernels) and unfused (ORT_DISABLE_ALL: every
QuantizeLinear/DequantizeLinear runs as written, the QDQ semantics the quantizer chose). The two
can differ: on x86 without VNNI, ORT's uint8 x int8 kernels add product pairs in saturating 16-bit
sums, which the QDQ graph never does, and everywhere the integer kernels round their own way.
Each is compared with FP32, and the two with each other, so a user can tell a loss that comes
from the quantization from one that comes from the kernels that run it.

All three sessions (FP32 once, quantized fused and unfused) see the same batches in one streaming
pass, so every metric compares outputs for identical inputs and the evaluation set is never held
in memory. Every output is compared, matched by name, and its FP32 values decide which rows it
gets (metrics/kinds.py). Latency is measured separately on single-sample runs of FP32 and the
fused model, alternating between them so that clock drift or a noisy neighbour affects both
equally.

This module is the loop; the types it fills are in results.py, the checks it runs on its inputs
in inputs.py and provenance_check.py, and the renderers in tables.py and junit.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from qtool.errors import DataError, ModelError
from qtool.metrics.fusion_gap import fused_gap_warning
from qtool.metrics.inputs import check_labels, input_specs, output_names, validate_inputs
from qtool.metrics.kinds import (
    NEXT_TOKEN_EVIDENCE,
    KindEvidence,
    OutputKind,
    chosen_rows,
    default_rows,
)
from qtool.metrics.labels import LabelAccuracy
from qtool.metrics.model_files import model_bytes, read_proto
from qtool.metrics.provenance_check import check_provenance
from qtool.metrics.results import (
    VARIANTS,
    EvalResult,
    FusedVsUnfused,
    ModelMetrics,
    OutputResult,
    VariantMetrics,
)
from qtool.metrics.signal import SignalQuality
from qtool.metrics.tokens import NextTokenComparison
from qtool.model import provenance
from qtool.ort.accuracy_level import ACCURACY_LEVEL_KEY
from qtool.ort.cpu import CpuFeatures, detect_cpu
from qtool.ort.float8 import unfused_only_reason
from qtool.ort.sessions import as_declared, create_session
from qtool.progress import bars
from qtool.runtime.bf16_emulation import EMULATED, emulated, has_bf16
from qtool.runtime.latency import latency_feed, measure_latency
from qtool.runtime.low_bit import low_bit_usage, written_accuracy_levels

Batch = tuple[Mapping[str, np.ndarray], np.ndarray | None]


def _progress(enabled: bool, total: int | None):
    return bars(
        enabled,
        TextColumn("evaluating"),
        BarColumn(),
        MofNCompleteColumn() if total is not None else TextColumn("{task.completed} batches"),
        TimeElapsedColumn(),
        line="evaluating: {count} batches",
    )


class _OutputTally:
    """Everything accumulated for one output: each variant vs FP32 (with cosine and top-1), the
    fused variant vs the unfused one, label accuracy of each variant, the kind evidence, and,
    on next-token labels, perplexity, next-token agreement and KL (metrics/tokens.py).
    `variants`: the variants run (unfused alone for a model with no fused CPU variant)."""

    def __init__(self, variants: Sequence[str] = VARIANTS, tokens: bool = False) -> None:
        self.variants = tuple(variants)
        self.quality = {v: SignalQuality(cosine="rows", top1=True) for v in self.variants}
        self.fused_vs_unfused = SignalQuality(top1=True)
        self.accuracy = {v: LabelAccuracy() for v in self.variants}
        self.evidence = KindEvidence()
        self.tokens = NextTokenComparison(self.variants) if tokens else None

    def update(
        self, ref: np.ndarray, runs: Mapping[str, np.ndarray], labels: np.ndarray | None
    ) -> None:
        for variant in self.variants:
            self.quality[variant].update(ref, runs[variant])
            if labels is not None:
                self.accuracy[variant].update(runs[variant], labels)
        if "fused" in runs:
            self.fused_vs_unfused.update(runs["unfused"], runs["fused"])
        self.evidence.update(ref)
        if self.tokens is not None and labels is not None:
            self.tokens.update(ref, runs, labels)

    def result(
        self, name: str, labelled: bool, fp32_accuracy: float | None, rows: Sequence[str] | None
    ) -> OutputResult:
        tokens = self.tokens if labelled else None
        metrics = {}
        for v in self.variants:
            metrics[v] = VariantMetrics(
                self.quality[v].sqnr_db(),
                self.quality[v].cosine(),
                self.quality[v].agreement(),
                self.accuracy[v].value() if labelled else None,
            )
            if tokens is not None:
                scored = tokens.variants[v]
                metrics[v].agreement = scored.agreement()
                metrics[v].perplexity = scored.perplexity()
                metrics[v].kl = scored.mean_kl()
        gap = self.fused_vs_unfused
        kind = self.evidence.decide(labelled)
        if tokens is not None:
            kind = OutputKind(kind.kind, NEXT_TOKEN_EVIDENCE)
        scored_tokens = tokens is not None
        return OutputResult(
            name,
            fused=metrics.get("fused"),
            unfused=metrics["unfused"],
            fp32_accuracy=fp32_accuracy,
            kind=kind.kind,
            kind_evidence=kind.evidence,
            rows=default_rows(kind, labelled, scored_tokens)
            if rows is None
            else chosen_rows(rows, labelled, scored_tokens),
            fused_vs_unfused=FusedVsUnfused(
                gap.sqnr_db(), gap.changed() if gap.predictions else None, gap.predictions
            )
            if "fused" in self.variants
            else None,
            fp32_perplexity=None if tokens is None else tokens.fp32.perplexity(),
            tokens=None if tokens is None else tokens.fp32.tokens,
        )


def evaluate_models(
    fp32_path: Path,
    quant_path: Path,
    batches: Iterable[Batch],
    *,
    output: str | None = None,
    output_where: str = "output",
    labels_required_by: str | None = None,
    allow_foreign_fp32: bool = False,
    threads: int | None = None,
    latency_runs: int = 50,
    progress: bool = True,
    cpu: CpuFeatures | None = None,
    accuracy_level: int | None = None,
    rows: Sequence[str] | None = None,
    token_labels: bool = False,
) -> EvalResult:
    """Run FP32 once and the quantized model fused and unfused over `batches`; compare outputs.

    `batches` yields (inputs by name, labels or None); either every batch has labels or none
    does. Labels are class indices for the top-1 (argmax over the last axis) of `output` (the
    gated output; default the first). `output_where` and `labels_required_by` name the option or
    recipe key behind them in error messages (`labels_required_by` set: data without labels is an
    error). `cpu` (default: this machine) decides the cause named when fused trails unfused.
    `accuracy_level` sets MatMulNBits' compute type for the fused session (None: ORT's default).
    `rows` (metrics/kinds.py ROWS) are the table rows of every output; None: by output kind.
    `token_labels`: the labels are the next token of every position of `output` (a decoder's
    logits [batch, sequence, vocab], labels [batch, sequence], negative where there is nothing
    to predict): it also gets perplexity, next-token agreement and KL, one batch at a time.
    """
    if latency_runs < 1:
        raise ValueError(f"latency_runs must be >= 1, got {latency_runs}")
    fp32_path, quant_path = Path(fp32_path), Path(quant_path)
    fp32_proto, quant_proto = read_proto(fp32_path), read_proto(quant_path)
    prov, warnings = check_provenance(
        fp32_path, quant_proto, quant_path, allow_foreign_fp32, fp32_proto
    )
    written_levels = dict(written_accuracy_levels(quant_proto))
    sizes = (model_bytes(fp32_path, fp32_proto), model_bytes(quant_path, quant_proto))
    unfused_only = unfused_only_reason(quant_proto)
    # ORT's CPU provider has no BF16 kernels: a BF16 file runs as its FP32 emulation.
    emulation = EMULATED if has_bf16(quant_proto) else None
    del fp32_proto, quant_proto
    runs: Path | bytes = quant_path
    if emulation is not None:
        runs = emulated(onnx.load(str(quant_path))).SerializeToString()
    ref_session = create_session(fp32_path, threads=threads)
    config = {} if accuracy_level is None else {ACCURACY_LEVEL_KEY: str(accuracy_level)}
    plain = unfused_only is None and emulation is None
    low_bit = low_bit_usage(quant_path, config) if plain else None
    sessions = {"unfused": create_session(runs, threads=threads, optimize=False)}
    if unfused_only is None:
        try:
            sessions["fused"] = create_session(runs, threads=threads, optimize=True, config=config)
        except ModelError as exc:  # loads unfused (above), not with ORT's optimizations
            unfused_only = (
                f"ONNX Runtime's CPU graph optimizations cannot load this file ({exc}); it runs "
                "unfused only (`qtool quantize` refuses such a file for ort-cpu, so it was "
                "written for another target)"
            )
            low_bit = None
    judged = "fused" if unfused_only is None else "unfused"
    variants = tuple(v for v in VARIANTS if v in sessions)
    ref_specs = input_specs(ref_session, fp32_path)
    q_specs = input_specs(sessions[judged], quant_path)
    names = output_names(ref_session, sessions[judged], fp32_path, quant_path)
    if output is None:
        output = names[0]
    elif output not in names:
        raise ModelError(
            f"{output_where} {output!r}: {fp32_path.name} has no such output "
            f"(outputs: {', '.join(names)})"
        )

    tallies = {name: _OutputTally(variants, token_labels and name == output) for name in names}
    fp32_accuracy = LabelAccuracy()
    has_labels: bool | None = None
    first_inputs: Mapping[str, np.ndarray] | None = None
    total = len(batches) if hasattr(batches, "__len__") else None
    with _progress(progress, total) as bar:
        task = bar.add_task("batches", total=total)
        for index, (inputs, labels) in enumerate(batches, start=1):
            validate_inputs(inputs, ref_specs, fp32_path, index)
            # a model written with float_io: float_type declares FP16 inputs: fed so
            q_feed = as_declared(inputs, sessions[judged])
            validate_inputs(q_feed, q_specs, quant_path, index)
            if has_labels is None:
                has_labels = labels is not None
                if not has_labels and labels_required_by is not None:
                    raise DataError(
                        f"{labels_required_by} needs labels, but the evaluation data has none"
                    )
            elif has_labels != (labels is not None):
                raise DataError(
                    f"evaluation batch {index} {'has no' if has_labels else 'has'} labels but "
                    f"batch 1 {'has' if has_labels else 'has none'}; label all batches or none"
                )
            feed = dict(inputs)
            ref = dict(zip(names, ref_session.run(names, feed), strict=True))
            runs = {
                v: dict(zip(names, s.run(names, q_feed), strict=True)) for v, s in sessions.items()
            }
            if labels is not None:
                if ref[output].ndim < 2:
                    raise DataError(
                        f"the evaluation data has labels but output {output!r} has shape "
                        f"{ref[output].shape}: no class axis to take a top-1 from"
                    )
                labels = check_labels(labels, np.argmax(ref[output], axis=-1), output, index)
                fp32_accuracy.update(ref[output], labels)
            for name in names:
                for variant, values in runs.items():
                    if values[name].shape != ref[name].shape:
                        raise ModelError(
                            f"output {name!r} has shape {values[name].shape} in {quant_path.name} "
                            f"({variant}) but {ref[name].shape} in {fp32_path.name}"
                        )
                tallies[name].update(
                    ref[name],
                    {v: runs[v][name] for v in variants},
                    labels if name == output else None,
                )
            if first_inputs is None:
                first_inputs = inputs
            bar.advance(task)

    if first_inputs is None:
        raise DataError("the evaluation data yielded no batches")
    scored = tallies[output].tokens
    if scored is not None and has_labels and scored.fp32.tokens == 0:
        raise DataError(f"no position of output {output!r} has a next-token label to score")

    outputs = []
    for name in names:
        labelled = bool(has_labels) and name == output
        outputs.append(
            tallies[name].result(name, labelled, fp32_accuracy.value() if labelled else None, rows)
        )
    cpu = cpu if cpu is not None else detect_cpu()
    gap = fused_gap_warning(outputs, cpu)
    if gap is not None:
        warnings.append(gap)

    feed, latency_batch = latency_feed(first_inputs, [spec.shape for spec in ref_specs])
    (ref_med, ref_p90), (q_med, q_p90) = measure_latency(
        [ref_session, sessions[judged]], feed, latency_runs
    )
    gated = next(o for o in outputs if o.name == output)
    return EvalResult(
        fp32=ModelMetrics(gated.fp32_accuracy, ref_med, ref_p90, sizes[0]),
        quant=ModelMetrics(gated.judged.accuracy, q_med, q_p90, sizes[1]),
        samples=tallies[names[0]].quality[judged].rows,
        outputs=outputs,
        output=output,
        latency_batch=latency_batch,
        latency_runs=latency_runs,
        warnings=warnings,
        provenance=prov,
        cpu=cpu,
        fp32_path=fp32_path,
        quant_path=quant_path,
        low_bit=low_bit,
        accuracy_level=accuracy_level,
        written_levels=written_levels,
        source_bytes=provenance.source_bytes(prov.get("recorded", {})),
        unfused_only=unfused_only,
        emulated=emulation,
    )
