"""The verify stage: what ONNX Runtime really runs, written into the Plan before the report.

A QDQ model states intentions; ORT's CPU provider decides what runs. This stage loads the written
model the way ORT will run it (qtool.runtime.fusion reads ORT's optimised graph), records in
every quantized NodePlan whether ORT fused it and into what, and compares the fused outputs with
the unfused QDQ semantics on a few calibration batches, so a saturating kernel or an unfused
node is reported instead of discovered in production.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from qtool.plan import Plan
from qtool.runtime.cpu import CpuFeatures, detect_cpu
from qtool.runtime.fusion import compare_fused_unfused, fusion_summary, fusion_truth

# Fused outputs this far below the unfused QDQ semantics mean the integer kernels do something
# the QDQ graph does not say (saturation, or a fusion that changes the arithmetic).
FUSED_GAP_WARN_DB = 30.0


@dataclass
class Verification:
    summary: dict  # fusion_summary plus the fused-vs-unfused comparison
    warnings: list[str] = field(default_factory=list)


def _json_db(value: float) -> float | str:
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def verify(
    quantized: bytes,
    plan: Plan,
    feeds: Iterable[dict[str, np.ndarray]],
    target_cpu: CpuFeatures,
    threads: int = 1,
) -> Verification:
    """Fill `plan`'s runtime truth and return the summary and the warnings to show the user."""
    planned = {node.name: node.op_type for node in plan.quantized()}
    truth = fusion_truth(quantized, planned, threads)
    for name, runtime in truth.items():
        plan[name].runtime = runtime.to_dict()
    summary = fusion_summary(truth)
    warnings = [
        f"{entry['name']} ({entry['op_type']}) runs as {entry['runs_as'] or 'nothing'} "
        f"in float, not fused: {entry['reason'] or 'no known ORT rule explains it'}"
        for entry in summary["unfused"]
    ]
    here = detect_cpu()
    sqnr = compare_fused_unfused(quantized, feeds, threads)
    summary["fused_vs_unfused_sqnr_db"] = {name: _json_db(v) for name, v in sqnr.items()}
    summary["verified_on_cpu"] = here.to_dict()
    for name, value in sqnr.items():
        if value < FUSED_GAP_WARN_DB:
            cause = (
                "this CPU has no VNNI and its uint8 x int8 kernels saturate 16-bit pair sums"
                if here.u8s8_saturates
                else "ORT's integer kernels compute differently from the QDQ graph"
            )
            warnings.append(
                f"output {name!r}: fused ORT run is only {value:.1f} dB from the unfused QDQ "
                f"semantics on calibration data ({cause})"
            )
    if here.u8s8_saturates != target_cpu.u8s8_saturates:
        warnings.append(
            f"verified on this machine ({here.describe()}), but the model was quantized for "
            f"{target_cpu.source}: fused results on the target CPU may differ"
        )
    return Verification(summary, warnings)
