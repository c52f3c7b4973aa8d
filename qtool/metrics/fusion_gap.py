"""The fused model against its own QDQ semantics: the warning, and what the distance means.

evaluate runs the quantized model fused (ORT_ENABLE_ALL, what deploys) and unfused
(ORT_DISABLE_ALL, the QDQ semantics the quantizer chose) and compares each with FP32, and the two
with each other (FusedVsUnfused). The distance between the two is ORT's kernels' doing; set
against the quantization's own error (unfused vs FP32) it says whether the kernels matter.
The cause and the advice are runtime/fused_gap.py's, the words `qtool quantize` prints too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from qtool.metrics.results import EvalWarning, OutputResult
from qtool.metrics.signal import format_db
from qtool.ort.cpu import CpuFeatures
from qtool.runtime.fused_gap import kernel_advice, kernel_cause

# A fused model this many dB below its own QDQ semantics is losing to its kernels, not to the
# quantization: a gap that large is far beyond run-to-run or rounding-order differences.
FUSED_GAP_DB = 3.0
# Kernel error this far below the quantization error changes the fused numbers by < 0.5 dB.
NEGLIGIBLE_MARGIN_DB = 10.0


def fused_gap_warning(outputs: Iterable[OutputResult], cpu: CpuFeatures) -> EvalWarning | None:
    """A warning when the fused SQNR of any output is more than FUSED_GAP_DB below the unfused.

    The likely cause depends on the CPU: without VNNI, ORT's uint8 x int8 kernels saturate their
    16-bit pair sums, which a model quantized for this CPU avoids; elsewhere the fused kernels
    round their own way.
    """
    gaps = []
    for out in outputs:
        if out.fused is None:  # no fused variant: nothing to compare
            continue
        fused, unfused = out.fused.sqnr_db, out.unfused.sqnr_db
        if math.isinf(fused) and math.isinf(unfused) and (fused > 0) == (unfused > 0):
            continue  # both exact (or both zero signal): no gap to speak of
        if unfused - fused > FUSED_GAP_DB:
            fused_db, unfused_db = format_db(fused), format_db(unfused)
            gaps.append(f"output {out.name!r} fused {fused_db} dB vs unfused {unfused_db} dB")
    if not gaps:
        return None
    message = (
        f"the fused quantized model (ORT_ENABLE_ALL, what deploys) is more than "
        f"{FUSED_GAP_DB:g} dB below its unfused QDQ semantics in SQNR ({'; '.join(gaps)}); "
        f"likely cause: {kernel_cause(cpu)}; try: {kernel_advice(cpu)}"
    )
    return EvalWarning("fused_below_unfused", message)


def kernels_matter(out: OutputResult) -> bool | None:
    """Whether ORT's kernels add error comparable to the quantization's on `out` (None: no
    fused-vs-unfused comparison)."""
    gap = out.fused_vs_unfused
    if gap is None:
        return None
    if math.isinf(gap.sqnr_db) and gap.sqnr_db > 0:
        return False
    return gap.sqnr_db - out.unfused.sqnr_db < NEGLIGIBLE_MARGIN_DB


def meaning(out: OutputResult) -> str:
    """One clause: what the fused-vs-unfused distance of `out` means for the numbers above."""
    gap = out.fused_vs_unfused
    if gap is None:
        return "not measured"
    quantization = format_db(out.unfused.sqnr_db)
    if math.isinf(gap.sqnr_db) and gap.sqnr_db > 0:
        return "identical: ORT's kernels compute exactly the QDQ semantics"
    if not kernels_matter(out):
        return (
            f"ORT's kernels round differently, but at least {NEGLIGIBLE_MARGIN_DB:g} dB below the "
            f"quantization's own error (unfused vs FP32 {quantization} dB): negligible"
        )
    return (
        f"ORT's kernels add error comparable to the quantization's own (unfused vs FP32 "
        f"{quantization} dB): the fused column is what deploys"
    )
