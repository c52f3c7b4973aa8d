"""What `qtool evaluate` prints: the table, and the lines under it that the numbers need.

The table has a row per output and metric, fused and unfused side by side; which metrics an
output gets is its `rows` (metrics/kinds.py: top-1 rows for class scores only, unless asked).
Under it: why each output got its rows, the fused model against its own QDQ semantics with what
that means and what to try, and what runs the low-bit weights.
"""

from __future__ import annotations

from rich.table import Table

from qtool.metrics.fusion_gap import kernels_matter, meaning
from qtool.metrics.kinds import CLASS_SCORES
from qtool.metrics.results import EvalResult, OutputResult, perplexity_rise
from qtool.metrics.signal import format_db
from qtool.runtime.fused_gap import kernel_advice, kernel_cause


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.2f}%"


def _ms(value: float) -> str:
    # Three significant digits keep sub-millisecond models readable (0.00426 ms, not 0.004 ms).
    return f"{value:.3f} ms" if value >= 1 else f"{value:.3g} ms"


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def _compare(fp32: float, quant: float, less: str, more: str) -> str:
    """'2.00x faster' or '2.44x slower': a ratio is always >= 1 and the word says which way,
    because '0.41x speed-up' reads as a speed-up."""
    if quant <= 0 or fp32 <= 0:
        return "n/a"
    if fp32 >= quant:
        return f"{fp32 / quant:.2f}x {less}"
    return f"{quant / fp32:.2f}x {more}"


def _points(value: float) -> str:
    return f"{value + 0.0:+.2f} pts"  # + 0.0 turns -0.0 into 0.0 so no change reads "+0.00"


def _perplexity(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _kl(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _rise(fp32: float | None, quantized: float | None) -> str:
    """A perplexity's change as a percent of FP32's: what --max-drop counts for perplexity."""
    if fp32 is None or quantized is None:
        return ""
    return f"{perplexity_rise(fp32, quantized) + 0.0:+.2f}%"


def _shown_rows(out: OutputResult, result: EvalResult) -> tuple[str, ...]:
    """The output's rows; a hand-built result without them shows every metric it has."""
    if out.rows is not None:
        return out.rows
    labelled = out.name == result.output and result.has_labels
    return ("accuracy", "top1", "sqnr", "cosine") if labelled else ("top1", "sqnr", "cosine")


def _fused(out: OutputResult, show) -> str:
    """A fused cell: `show(metrics)`, or n/a where the model has no fused variant."""
    return "n/a" if out.fused is None else show(out.fused)


def render_table(result: EvalResult) -> Table:
    """The human summary: a row per output and metric, fused and unfused side by side.

    Fidelity metrics compare quantized to FP32, so their FP32 cell is '-'. The gated output's
    rows are bold and its name is starred; "change" is the judged model's: fused (what
    deploys), or unfused for a model that has no fused CPU variant (float8), said in the title.
    """
    judged = result.judged_variant
    title = (
        f"FP32 vs quantized ({result.samples} samples; fused = as ONNX Runtime runs it, "
        "unfused = QDQ semantics)"
    )
    if result.unfused_only is not None:
        title = (
            f"FP32 vs quantized ({result.samples} samples; unfused = QDQ semantics, as ONNX "
            "Runtime's CPU provider runs float8; no fused variant)"
        )
    table = Table(title=title)
    table.add_column("output")
    table.add_column("metric")
    table.add_column("FP32", justify="right")
    table.add_column("fused", justify="right")
    table.add_column("unfused", justify="right")
    table.add_column(f"change ({judged})", justify="right")

    for out in result.outputs:
        gated = out.name == result.output and len(result.outputs) > 1
        label = f"{out.name} *" if gated else out.name
        style = "bold" if gated else None
        rows = _shown_rows(out, result)
        labelled = out.name == result.output and result.has_labels
        if "accuracy" in rows and labelled:
            change = (out.judged.accuracy - out.fp32_accuracy) * 100.0
            table.add_row(
                label,
                "accuracy",
                _pct(out.fp32_accuracy),
                _fused(out, lambda m: _pct(m.accuracy)),
                _pct(out.unfused.accuracy),
                _points(change),
                style=style,
            )
        if "perplexity" in rows and out.scores_tokens:
            table.add_row(
                label,
                "perplexity",
                _perplexity(out.fp32_perplexity),
                _perplexity(out.fused.perplexity),
                _perplexity(out.unfused.perplexity),
                _rise(out.fp32_perplexity, out.fused.perplexity),
                style=style,
            )
        if "top1" in rows:
            agreement_change = ""
            if out.judged.agreement is not None and not labelled:
                agreement_change = _points(-(1.0 - out.judged.agreement) * 100.0)
            table.add_row(
                label,
                "top-1 agreement",
                "-",
                _fused(out, lambda m: _pct(m.agreement)),
                _pct(out.unfused.agreement),
                agreement_change,
                style=style,
            )
        if "kl" in rows and out.scores_tokens:
            table.add_row(
                label,
                "KL nats/token",
                "-",
                _kl(out.fused.kl),
                _kl(out.unfused.kl),
                "",
                style=style,
            )
        if "sqnr" in rows:
            table.add_row(
                label,
                "SQNR dB",
                "-",
                _fused(out, lambda m: format_db(m.sqnr_db)),
                format_db(out.unfused.sqnr_db),
                "",
                style=style,
            )
        if "cosine" in rows:
            table.add_row(
                label,
                "cosine",
                "-",
                _fused(out, lambda m: f"{m.cosine:.5f}"),
                f"{out.unfused.cosine:.5f}",
                "",
                style=style,
            )
    batch = "" if result.latency_batch == 1 else f" (batch {result.latency_batch})"
    fused_only = result.unfused_only is None
    for label, ref, q in (
        ("latency median", result.fp32.latency_ms_median, result.quant.latency_ms_median),
        ("latency p90", result.fp32.latency_ms_p90, result.quant.latency_ms_p90),
    ):
        cells = (_ms(q), "-") if fused_only else ("n/a", _ms(q))
        table.add_row("", f"{label}{batch}", _ms(ref), *cells, _compare(ref, q, "faster", "slower"))
    table.add_row(
        "",
        "file size",
        _size(result.fp32.file_bytes),
        _size(result.quant.file_bytes),
        _size(result.quant.file_bytes),
        _compare(result.fp32.file_bytes, result.quant.file_bytes, "smaller", "larger"),
    )
    if result.source_bytes is not None and result.source_bytes != result.fp32.file_bytes:
        table.add_row(
            "",
            "vs your file",
            _size(result.source_bytes),
            _size(result.quant.file_bytes),
            _size(result.quant.file_bytes),
            _compare(result.source_bytes, result.quant.file_bytes, "smaller", "larger"),
        )
    if result.low_bit is not None and result.low_bit.total:
        table.add_row("", "low-bit weights", "-", result.low_bit.brief(), "-", "")
    return table


def unfused_only_notes(result: EvalResult) -> list[str]:
    """Why there is no fused column, and how a file the CPU cannot run was measured."""
    notes = []
    if result.unfused_only is not None:
        notes.append(f"no fused variant: {result.unfused_only}")
    if result.emulated is not None:
        notes.append(f"emulated: {result.emulated}")
    return notes


def kind_notes(result: EvalResult) -> list[str]:
    """Why each output got its rows, so a missing top-1 row is never a mystery."""
    notes = []
    for out in result.outputs:
        if out.kind is None:
            continue
        what = "class scores" if out.kind == CLASS_SCORES else "dense values"
        if out.scores_tokens:
            what = f"next-token scores, {out.tokens} predicted tokens"
        hint = "" if out.kind == CLASS_SCORES else "; --rows top1 adds top-1 agreement"
        notes.append(f"output {out.name!r}: {what} ({out.kind_evidence}){hint}")
    return notes


def fused_unfused_notes(result: EvalResult) -> list[str]:
    """The fused model against its own QDQ semantics, per output: SQNR between the two, top-1
    predictions they disagree on (class scores), what that means, and, where ORT's kernels
    matter, the likely cause and what to try."""
    notes = []
    for out in result.outputs:
        gap = out.fused_vs_unfused
        if gap is None:
            continue
        changed = ""
        shows_top1 = out.kind == CLASS_SCORES or "top1" in (out.rows or ())
        if gap.top1_changed is not None and shows_top1:
            changed = f", top-1 changed on {gap.top1_changed} of {gap.predictions}"
        notes.append(
            f"fused vs unfused, output {out.name!r}: SQNR {format_db(gap.sqnr_db)} dB{changed}: "
            f"{meaning(out)}"
        )
    if result.cpu is not None and any(kernels_matter(o) for o in result.outputs):
        notes.append(f"  cause: {kernel_cause(result.cpu)}; try: {kernel_advice(result.cpu)}")
    return notes


def low_bit_notes(result: EvalResult) -> list[str]:
    """The lines under the table that say what the 4-bit weights run on, and at which accuracy
    level, so a smaller file is never read as a faster model."""
    if result.low_bit is None or not result.low_bit.total:
        return []
    notes = [f"low-bit weights: {result.low_bit.describe()}"]
    level = result.accuracy_level_note()
    if level is not None:
        notes.append(level)
    return notes
