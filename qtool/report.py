"""report.json: every node's plan and what ONNX Runtime really did with it.

The nodes list is the Plan (precision, why, weight format and why) joined with the runtime truth
the verify stage read from ORT's optimised graph (fused into which op, or float, and why), so a
user can see at a glance both what qtool intended and what runs.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from qtool import __version__
from qtool.calibration.spec import CalibrationSpec
from qtool.io import atomic_write_bytes
from qtool.ort.cpu import CpuFeatures
from qtool.plan.layout import Layout, slot_key
from qtool.plan.plan import Plan, WeightPlan
from qtool.plan.settings import QuantizationSpec
from qtool.write.int4 import BlockwiseWeight
from qtool.write.params import ActivationParams, WeightParams


def _floats(values: np.ndarray) -> list[float] | float:
    array = np.asarray(values, dtype=np.float32)
    if array.ndim == 0:
        return float(array)
    return [float(v) for v in array]


def _low_bit_entry(name: str, bw: BlockwiseWeight, plan: WeightPlan) -> dict:
    """Blocked scales run to thousands of values: the report gives their shape and range."""
    kind = "int" if bw.symmetric else "uint"
    scale = np.asarray(bw.scale, dtype=np.float32)
    return {
        "tensor": name,
        "role": "weight",
        "dtype": f"{kind}{bw.bits}",
        "granularity": plan.granularity,
        "axis": bw.axis,
        "block_size": bw.block_size,
        "stored_shape": list(bw.values.shape),
        "transposed": plan.transposed,
        "scale_shape": list(scale.shape),
        "scale_range": [float(scale.min()), float(scale.max())],
        "symmetric": bw.symmetric,
        "method": plan.method,
    }


def _tensor_entries(
    inputs: list[str],
    layout: Layout,
    activations: dict[str, ActivationParams],
    weights: dict[str, WeightParams | BlockwiseWeight],
    method: str,
    activation_dtype: str,
    pairs: str,
) -> list[dict]:
    """The node's quantized inputs; `pairs` is the type of the pairs it reads (int8, fp8), or
    "dynamic" (its input is quantized at run time: no range is stored)."""
    tensors = []
    for name in inputs:
        key = slot_key(name, pairs) if pairs in ("int8", "fp8") else name
        if pairs == "dynamic" and name in layout.dynamic:
            tensors.append(
                {
                    "tensor": name,
                    "role": "activation",
                    "dtype": "uint8",
                    "range": "dynamic: DynamicQuantizeLinear takes each input's min/max at run "
                    "time (no calibration)",
                }
            )
        elif key in activations:
            params = activations[key]
            fp8 = pairs == "fp8"
            tensors.append(
                {
                    "tensor": name,
                    "role": "activation",
                    "dtype": "float8e4m3fn" if fp8 else activation_dtype,
                    "range": [float(params.low), float(params.high)],
                    "scale": float(params.scale),
                    "zero_point": float(params.zero_point) if fp8 else int(params.zero_point),
                    "method": method,
                    "stats_tensor": layout.activations[key].stats_tensor,
                }
            )
        elif name in weights and isinstance(weights[name], BlockwiseWeight):
            tensors.append(_low_bit_entry(name, weights[name], layout.plan.weight_plans()[name]))
        elif name in weights:
            params = weights[name]
            fp8 = params.values.dtype == ml_dtypes.float8_e4m3fn
            tensors.append(
                {
                    "tensor": name,
                    "role": "weight",
                    "dtype": "float8e4m3fn" if fp8 else str(params.values.dtype),
                    "granularity": "per-channel" if params.axis is not None else "per-tensor",
                    "axis": params.axis,
                    "scale": _floats(params.scale),
                    "zero_point": 0 if fp8 else int(params.zero_point_array().reshape(-1)[0]),
                    "method": "amax / 448" if fp8 else "minmax (symmetric)",
                }
            )
        elif name in layout.biases:
            tensors.append({"tensor": name, "role": "bias", "dtype": "int32"})
    return tensors


@dataclass(frozen=True)
class ReportHeader:
    """The settings report.json states at its top: where they came from and what they were."""

    source: str  # the recipe file
    quantization: QuantizationSpec
    calibration: CalibrationSpec
    seed: int


def build_report(
    header: ReportHeader,
    model_inputs: dict[str, list[str]],
    layout: Layout,
    activations: dict[str, ActivationParams],
    weights: dict[str, WeightParams | BlockwiseWeight],
    output_files: dict[str, str],
    cpu: CpuFeatures,
    verification: dict | None = None,
) -> dict:
    """A JSON-ready description of the quantized model; `model_inputs` maps node -> input names.

    `verification` is the verify stage's summary (fused counts, fused vs unfused outputs); the
    per-node runtime truth is already in each NodePlan.
    """
    quantization, calibration = header.quantization, header.calibration
    activation_dtype = "int8" if quantization.symmetric_activations else "uint8"
    nodes = []
    for node in layout.plan:
        entry = node.to_dict()
        if node.quantized:
            entry["tensors"] = _tensor_entries(
                model_inputs.get(node.name, []),
                layout,
                activations,
                weights,
                calibration.method,
                activation_dtype,
                node.activations,
            )
        nodes.append(entry)
    quantized = layout.plan.quantized()
    by_op = Counter(node.op_type for node in quantized)
    formats = Counter(plan.format for plan in layout.plan.weight_plans().values())
    return {
        "qtool_version": __version__,
        "recipe": header.source,
        "target": quantization.target,
        "cpu": cpu.to_dict(),
        "saturation_policy": quantization.saturation,
        "activation_dtype": activation_dtype,
        "method": calibration.method,
        "percentile": calibration.percentile if calibration.method == "percentile" else None,
        "seed": header.seed,
        "files": output_files,
        "summary": {
            "nodes": len(layout.plan),
            "quantized_nodes": len(quantized),
            "float_nodes": len(layout.plan) - len(quantized),
            "quantized_by_op_type": dict(sorted(by_op.items())),
            "activation_qdq_pairs": len(activations),
            "folded_activations": len(layout.folded_clamps),
            "weight_formats": dict(sorted(formats.items())),
            "precisions": layout.plan.counts(),
            "weight_only_nodes": sum(1 for n in quantized if n.activations == "float"),
            "dynamic_nodes": sum(1 for n in quantized if n.activations == "dynamic"),
            "dynamic_tensors": len(layout.dynamic),
        },
        "dynamic": dynamic_runtime(layout),
        "low_bit": low_bit_runtime(layout.plan),
        "low_bit_speed": (verification or {}).get("low_bit_speed"),
        "runtime": verification,
        "nodes": nodes,
    }


def dynamic_runtime(layout: Layout) -> dict | None:
    """The nodes whose inputs are quantized at run time, and what ORT runs each as (from the
    runtime truth): DynamicQuantizeMatMul or MatMulIntegerToFloat where it fused them, the
    written MatMulInteger otherwise. None when the model has no dynamic node."""
    nodes = [n for n in layout.plan.quantized() if n.activations == "dynamic"]
    if not nodes:
        return None
    runs_as = Counter((n.runtime or {}).get("runs_as") or "unknown" for n in nodes)
    return {
        "nodes": [n.name for n in nodes],
        "tensors_quantized_at_run_time": list(layout.dynamic),
        "ranges": layout.dynamic_ranges,
        "runs_as": dict(sorted(runs_as.items())),
        "fused": sum(1 for n in nodes if (n.runtime or {}).get("status") == "fused"),
    }


def low_bit_runtime(plan: Plan) -> dict:
    """Per op type, what ORT does with the 4-bit and weight-only nodes, in plain words.

    A 4-bit weight that ORT dequantizes before a float kernel makes the file smaller and the model
    no faster; the report says which of the two each node got, from the runtime truth.
    """
    groups: dict[str, dict] = {}
    for node in plan.quantized():
        # 4-bit and weight-only nodes; FP8 nodes have FP8 activations, they are not weight-only
        if node.weight is None or (node.precision != "int4" and node.activations != "float"):
            continue
        key = f"{node.precision} {node.op_type}"
        entry = groups.setdefault(key, {"nodes": 0, "fused": 0, "runs_as": {}})
        entry["nodes"] += 1
        runtime = node.runtime or {}
        runs_as = runtime.get("runs_as") or "unknown"
        entry["runs_as"][runs_as] = entry["runs_as"].get(runs_as, 0) + 1
        if runtime.get("status") == "fused":
            entry["fused"] += 1
    for entry in groups.values():
        if entry["fused"] == entry["nodes"]:
            kinds = ", ".join(sorted(entry["runs_as"]))
            entry["effect"] = f"smaller file, and ORT runs a low-bit kernel ({kinds})"
        elif entry["fused"] == 0:
            entry["effect"] = (
                "smaller file only: ORT dequantizes the weight and runs the float op, "
                "so it runs at float speed"
            )
        else:
            entry["effect"] = (
                f"smaller file; {entry['fused']} of {entry['nodes']} run on a low-bit kernel, "
                "the rest dequantized at float speed"
            )
    return dict(sorted(groups.items()))


def report_bytes(report: dict) -> bytes:
    """report.json's content, for committing it together with the models it describes."""
    return (json.dumps(report, indent=2, sort_keys=False) + "\n").encode("utf-8")


def write_report(path: Path, report: dict) -> None:
    atomic_write_bytes(path, report_bytes(report))
