"""Turn a Layout, calibration statistics and the float weights into the numbers the writer stores.

Three small steps kept apart from the pipeline so each can be reused (analysis and QAT will
re-run them per node): activation scales from the ranges, weights in the format the deployment
CPU needs (weight_format.py, which records its choice in the Plan), and int32 biases whose scale
is input scale x weight scale.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.calibration.observers import TensorStats
from qtool.calibration.ranges import compute_range
from qtool.errors import CalibrationError
from qtool.quantize.layout import Layout
from qtool.quantize.params import ActivationParams, WeightParams, activation_params, quantize_bias
from qtool.quantize.qdq import BiasParams
from qtool.quantize.weight_format import choose_weight
from qtool.recipe import CalibrationSpec, QuantizationSpec
from qtool.runtime.cpu import CpuFeatures


def activation_parameters(
    layout: Layout,
    stats: dict[str, TensorStats],
    calibration: CalibrationSpec,
    symmetric: bool,
    device: str,
) -> dict[str, ActivationParams]:
    activations: dict[str, ActivationParams] = {}
    for tensor, slot in layout.activations.items():
        if slot.stats_tensor not in stats:
            raise CalibrationError(f"stats file has no statistics for tensor '{slot.stats_tensor}'")
        low, high = compute_range(
            stats[slot.stats_tensor],
            calibration.method,
            symmetric,
            calibration.percentile,
            device,
        )
        activations[tensor] = activation_params(low, high, symmetric)
    return activations


def weight_parameters(
    model: onnx.ModelProto,
    layout: Layout,
    spec: QuantizationSpec,
    cpu: CpuFeatures,
    device: str,
) -> dict[str, WeightParams]:
    initializers = {init.name: init for init in model.graph.initializer}
    plans = layout.plan.weight_plans()
    return {
        name: choose_weight(
            numpy_helper.to_array(initializers[name]),
            slot,
            plans[name],
            cpu,
            spec.saturation,
            device,
        )
        for name, slot in layout.weights.items()
    }


def bias_parameters(
    model: onnx.ModelProto,
    layout: Layout,
    activations: dict[str, ActivationParams],
    weights: dict[str, WeightParams],
) -> dict[str, BiasParams]:
    initializers = {init.name: init for init in model.graph.initializer}
    biases = {}
    for name, slot in layout.biases.items():
        values, scale = quantize_bias(
            numpy_helper.to_array(initializers[name]),
            activations[slot.activation].scale,
            np.asarray(weights[slot.weight].scale),
        )
        biases[name] = BiasParams(values, scale)
    return biases
