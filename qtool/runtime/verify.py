"""The verify stage: what ONNX Runtime really runs, written into the Plan before the report.

A QDQ model states intentions; ORT's CPU provider decides what runs. This stage loads the written
model the way ORT will run it (qtool.runtime.fusion reads ORT's optimised graph), records in
every quantized NodePlan whether ORT fused it and into what, and compares the fused outputs with
the unfused QDQ semantics on a few calibration batches, so a saturating kernel or an unfused
node is reported instead of discovered in production.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qtool.metrics.signal import json_float
from qtool.ort.accuracy_level import INT8_COMPUTE_LEVEL
from qtool.ort.cpu import CpuFeatures, detect_cpu
from qtool.ort.sessions import as_declared, create_session
from qtool.plan.ops import precision_key
from qtool.plan.ops import rule as op_rule
from qtool.plan.plan import NodePlan, Plan
from qtool.runtime.fused_gap import (
    int8_compute_advice,
    int8_compute_cause,
    kernel_advice,
    kernel_cause,
)
from qtool.runtime.fused_vs_unfused import (
    UnfusedReference,
    bad_batch,
    compare_fused_unfused,
    run_unfused,
)
from qtool.runtime.fusion import (
    FUSED,
    OptimizedSession,
    fusion_summary,
    fusion_truth,
    optimized_session,
)
from qtool.runtime.latency import latency_feed, measure_latency
from qtool.runtime.low_bit import written_accuracy_levels

if TYPE_CHECKING:
    import onnxruntime

# A quantized node of a model ORT's CPU provider runs only unfused (float8 Q/DQ).
UNFUSED_ONLY = "unfused-only"

# Fused outputs this far below the unfused QDQ semantics mean the integer kernels do something
# the QDQ graph does not say (saturation, or a fusion that changes the arithmetic).
FUSED_GAP_WARN_DB = 30.0


@dataclass
class Verification:
    summary: dict  # fusion_summary plus the fused-vs-unfused comparison
    warnings: list[str] = field(default_factory=list)


def _weight_only_reason(node: NodePlan, target: str) -> str:
    """Why a weight-only node runs in float, in the words a user deciding on INT4 needs: the
    reason of the registry entry it was written by (ORT's CPU provider verifies every target)."""
    rule = op_rule(node.op_type)
    entry = rule.entry(target, precision_key(node.precision, node.activations))
    return entry.not_fused_reason(node.weight)


# Interleaved batch-1 runs per model for the low-bit speed check: enough to tell "faster" from
# "only smaller" (the verdict needs a 5% margin), few enough to cost seconds on MiniLM.
SPEED_RUNS = 20
FASTER_MARGIN = 1.05


def low_bit_speed(
    float_model: bytes | Path,
    quantized: onnxruntime.InferenceSession,
    feed: dict[str, np.ndarray],
    cpu,
    threads: int,
) -> dict:
    """Is the low-bit model faster than FP32 on this CPU, or only smaller? Measured, batch 1,
    with `quantized`: the verify stage's own session of it (the same settings, `threads`)."""
    sessions = [create_session(float_model, threads=threads), quantized]
    single, _ = latency_feed(feed, [i.shape for i in sessions[0].get_inputs()])
    (fp32_ms, _), (quant_ms, _) = measure_latency(sessions, single, SPEED_RUNS)
    speedup = fp32_ms / quant_ms if quant_ms > 0 else float("inf")
    verdict = "faster" if speedup >= FASTER_MARGIN else "only smaller: no speed-up on this CPU"
    return {
        "cpu": cpu.describe(),
        "threads": threads,
        "batch": next(iter(single.values())).shape[0] if single else 1,
        "runs": SPEED_RUNS,
        "fp32_ms_median": fp32_ms,
        "quant_ms_median": quant_ms,
        "speedup": speedup,
        "verdict": verdict,
    }


def verify_unfused_only(
    quantized: bytes | Path,
    plan: Plan,
    feeds: Sequence[dict[str, np.ndarray]],
    threads: int,
    reason: str,
) -> Verification:
    """A model ORT's CPU provider runs only unfused (float8 Q/DQ): it is loaded and run as
    written on the calibration samples, every quantized node is recorded as running DQ -> float
    op there, and no fused number is made up."""
    session = create_session(quantized, threads=threads, optimize=False)
    names = [o.name for o in session.get_outputs()]
    for index, feed in enumerate(feeds):
        try:
            session.run(names, as_declared(feed, session))
        except Exception as exc:  # ORT raises private types for bad feeds
            raise bad_batch(index, exc) from exc
    by_op: dict[str, dict] = {}
    for node in plan.quantized():
        node.runtime = {
            "op_type": node.op_type,
            "status": UNFUSED_ONLY,
            "runs_as": f"DequantizeLinear -> {node.op_type} (unfused)",
            "ort_node": node.name,
            "reason": reason,
        }
        entry = by_op.setdefault(node.op_type, {"planned": 0, "fused": 0, "runs_as": {}})
        entry["planned"] += 1
    summary = {
        "planned": len(plan.quantized()),
        "fused": 0,
        "float": 0,
        "removed": 0,
        "unfused_only": reason,
        "by_op_type": dict(sorted(by_op.items())),
        "unfused": [],
        "fused_vs_unfused_sqnr_db": None,
        "verified_on_cpu": detect_cpu().to_dict(),
    }
    return Verification(summary, [])


def _fused_gap_warning(
    sqnr: dict[str, float], plan: Plan, loaded: OptimizedSession, cpu: CpuFeatures
) -> str | None:
    """One warning for every output whose fused run is farther than FUSED_GAP_WARN_DB from the
    unfused QDQ semantics (an LLM has dozens of outputs: one line, not one per present tensor),
    with the cause that applies: int8 compute inside MatMulNBits for a weight-only model,
    else the CPU's integer kernels."""
    low = {name: value for name, value in sqnr.items() if value < FUSED_GAP_WARN_DB}
    if not low:
        return None
    ordered = sorted(low.items(), key=lambda item: item[1])
    shown = ", ".join(f"{name!r} {value:.1f} dB" for name, value in ordered[:4])
    if len(ordered) > 4:
        shown += f" and {len(ordered) - 4} more (report.json: runtime.fused_vs_unfused_sqnr_db)"
    int8_compute = written_accuracy_levels(loaded.graph)[INT8_COMPUTE_LEVEL]
    weight_only = all(node.activations == "float" for node in plan.quantized())
    if weight_only and int8_compute:
        cause, advice = int8_compute_cause(int8_compute), int8_compute_advice()
    else:
        cause, advice = kernel_cause(cpu), kernel_advice(cpu)
    outputs = "output" if len(ordered) == 1 else f"{len(ordered)} outputs"
    return (
        f"fused ORT run is under {FUSED_GAP_WARN_DB:g} dB from the unfused QDQ semantics on "
        f"calibration data, {outputs}: {shown} ({cause}); try: {advice}"
    )


def verify(
    quantized: bytes | Path,
    plan: Plan,
    feeds: Sequence[dict[str, np.ndarray]],
    target_cpu: CpuFeatures,
    threads: int = 1,
    target: str = "ort-cpu",
    float_model: bytes | Path | None = None,
    loaded: OptimizedSession | None = None,
    reference: UnfusedReference | None = None,
) -> Verification:
    """Fill `plan`'s runtime truth and return the summary and the warnings to show the user.

    `quantized`: the serialized model, or its path (models with external data, over 2 GB).
    `loaded`: its optimized_session with `threads`, when the caller loaded it already.
    `reference`: run_unfused's outputs on `feeds`, made before `loaded` (closed here)."""
    if reference is None and loaded is None:  # unfused first: never both sessions at once
        reference = run_unfused(quantized, feeds, threads)
    try:
        if loaded is None:
            loaded = optimized_session(quantized, threads)
        return _verify_loaded(
            quantized, plan, feeds, target_cpu, threads, target, float_model, loaded, reference
        )
    finally:
        if reference is not None:
            reference.close()


def _verify_loaded(
    quantized: bytes | Path,
    plan: Plan,
    feeds: Sequence[dict[str, np.ndarray]],
    target_cpu: CpuFeatures,
    threads: int,
    target: str,
    float_model: bytes | Path | None,
    loaded: OptimizedSession,
    reference: UnfusedReference | None,
) -> Verification:
    """verify's work once the fused session is loaded (and the unfused reference made)."""
    # Planned op types: fusion_truth accepts the op a node's registry entries write it as.
    planned = {node.name: node.op_type for node in plan.quantized()}
    truth = fusion_truth(quantized, planned, threads, loaded.graph)
    weight_only = set()
    for name, runtime in truth.items():
        node = plan[name]
        if node.activations == "float" and runtime.status != FUSED:
            runtime = replace(runtime, reason=_weight_only_reason(node, target))
            weight_only.add(name)
        truth[name] = runtime
        node.runtime = runtime.to_dict()
    summary = fusion_summary(truth)
    # On a target other than ort-cpu these are ORT's words about the file, not the target's.
    prefix = "" if target == "ort-cpu" else "ONNX Runtime CPU check (not the target): "
    warnings = [
        f"{prefix}{entry['name']} ({entry['op_type']}) runs as {entry['runs_as'] or 'nothing'} "
        f"in float, not fused: {entry['reason'] or 'no known ORT rule explains it'}"
        for entry in summary["unfused"]
        if entry["name"] not in weight_only
    ]
    here = detect_cpu()
    sqnr = compare_fused_unfused(quantized, feeds, threads, loaded.session, reference)
    summary["fused_vs_unfused_sqnr_db"] = {name: json_float(v) for name, v in sqnr.items()}
    summary["verified_on_cpu"] = here.to_dict()
    gap_warning = _fused_gap_warning(sqnr, plan, loaded, here)
    if gap_warning is not None:
        warnings.append(prefix + gap_warning)
    if float_model is not None and any(
        n.weight is not None and (n.precision == "int4" or n.activations == "float")
        for n in plan.quantized()
    ):
        summary["low_bit_speed"] = low_bit_speed(
            float_model, loaded.session, feeds[0], here, threads
        )
    if here.u8s8_saturates != target_cpu.u8s8_saturates:
        warnings.append(
            f"verified on this machine ({here.describe()}), but the model was quantized for "
            f"{target_cpu.source}: fused results on the target CPU may differ"
        )
    return Verification(summary, warnings)
