"""report.json: every node's fate, so a user can see why each layer is (or is not) quantized."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from qtool import __version__
from qtool.io import atomic_write_text
from qtool.quantize.layout import Layout
from qtool.quantize.params import ActivationParams, WeightParams
from qtool.recipe import Recipe


def _floats(values: np.ndarray) -> list[float] | float:
    array = np.asarray(values, dtype=np.float32)
    if array.ndim == 0:
        return float(array)
    return [float(v) for v in array]


def build_report(
    recipe: Recipe,
    model_inputs: dict[str, list[str]],
    layout: Layout,
    activations: dict[str, ActivationParams],
    weights: dict[str, WeightParams],
    output_files: dict[str, str],
) -> dict:
    """A JSON-ready description of the quantized model; `model_inputs` maps node -> input names."""
    activation_dtype = "int8" if recipe.quantization.symmetric_activations else "uint8"
    nodes = []
    for decision in layout.decisions:
        entry: dict = {
            "name": decision.name,
            "op_type": decision.op_type,
            "precision": "int8" if decision.quantized else "fp32",
            "reason": decision.reason,
        }
        if decision.quantized:
            tensors = []
            for name in model_inputs.get(decision.name, []):
                if name in activations:
                    params = activations[name]
                    tensors.append(
                        {
                            "tensor": name,
                            "role": "activation",
                            "dtype": activation_dtype,
                            "range": [float(params.low), float(params.high)],
                            "scale": float(params.scale),
                            "zero_point": int(params.zero_point),
                            "method": recipe.calibration.method,
                            "stats_tensor": layout.activations[name].stats_tensor,
                        }
                    )
                elif name in weights:
                    params = weights[name]
                    tensors.append(
                        {
                            "tensor": name,
                            "role": "weight",
                            "dtype": "int8",
                            "granularity": "per-channel"
                            if params.axis is not None
                            else "per-tensor",
                            "axis": params.axis,
                            "scale": _floats(params.scale),
                            "method": "minmax (symmetric)",
                        }
                    )
                elif name in layout.biases:
                    tensors.append({"tensor": name, "role": "bias", "dtype": "int32"})
            entry["tensors"] = tensors
        nodes.append(entry)
    counts = Counter(n["precision"] for n in nodes)
    by_op = Counter(n["op_type"] for n in nodes if n["precision"] == "int8")
    return {
        "qtool_version": __version__,
        "recipe": str(recipe.path),
        "target": recipe.quantization.target,
        "activation_dtype": activation_dtype,
        "weight_dtype": "int8",
        "method": recipe.calibration.method,
        "percentile": recipe.calibration.percentile
        if recipe.calibration.method == "percentile"
        else None,
        "seed": recipe.seed,
        "files": output_files,
        "summary": {
            "nodes": len(nodes),
            "quantized_nodes": counts.get("int8", 0),
            "float_nodes": counts.get("fp32", 0),
            "quantized_by_op_type": dict(sorted(by_op.items())),
            "activation_qdq_pairs": len(activations),
            "folded_relus": len(layout.folded_relus),
        },
        "nodes": nodes,
    }


def write_report(path: Path, report: dict) -> None:
    atomic_write_text(path, json.dumps(report, indent=2, sort_keys=False) + "\n")
