"""Turn a Layout, calibration statistics and the float weights into the numbers the writer stores.

Three small steps kept apart from the pipeline so each can be reused (analysis and QAT will
re-run them per node): activation scales from the ranges, weights in the format the deployment
CPU needs (weight_format.py, which records its choice in the Plan), and int32 biases whose scale
is input scale x weight scale.
"""

from __future__ import annotations

import numpy as np
import onnx

from qtool.calibration.fp8_range import compute_fp8_range
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.observers import TensorStats
from qtool.calibration.ranges import compute_range
from qtool.calibration.spec import CalibrationSpec
from qtool.errors import CalibrationError
from qtool.model.external_data import tensor_array
from qtool.ort.cpu import CpuFeatures
from qtool.plan.layout import Layout
from qtool.plan.settings import QuantizationSpec
from qtool.write.fp8 import fp8_activation_params, quantize_fp8_weight
from qtool.write.int4 import BlockwiseWeight
from qtool.write.low_bit import LowBitOptions, quantize_low_bit
from qtool.write.params import ActivationParams, WeightParams, activation_params, quantize_bias
from qtool.write.qdq import BiasParams
from qtool.write.weight_format import choose_weight


def activation_parameters(
    layout: Layout,
    stats: dict[str, TensorStats],
    calibration: CalibrationSpec,
    symmetric: bool,
    device: str,
) -> dict[str, ActivationParams]:
    activations: dict[str, ActivationParams] = {}
    for key, slot in layout.activations.items():
        if slot.stats_tensor not in stats:
            raise CalibrationError(f"stats file has no statistics for tensor '{slot.stats_tensor}'")
        tensor_stats = stats[slot.stats_tensor]
        if slot.dtype == "fp8":
            low, high = compute_fp8_range(
                tensor_stats, calibration.method, calibration.percentile, device
            )
            activations[key] = fp8_activation_params(low, high)
            continue
        low, high = compute_range(
            tensor_stats, calibration.method, symmetric, calibration.percentile, device
        )
        activations[key] = activation_params(low, high, symmetric)
    return activations


def integer_kernel_weights(layout: Layout) -> set[str]:
    """Weights an integer kernel multiplies with uint8 activations: int8 per channel / tensor
    on a node whose activations are quantized (static pairs or at run time). Only these can
    saturate 16-bit pair sums."""
    return {
        node.weight.tensor
        for node in layout.plan
        if node.weight is not None
        and node.activations in ("int8", "dynamic")
        and node.weight.bits == 8
        and node.weight.block_size is None
    }


def weight_parameters(
    model: onnx.ModelProto,
    layout: Layout,
    spec: QuantizationSpec,
    cpu: CpuFeatures,
    device: str,
    hessians: dict[str, HessianAccumulator] | None = None,
    options: LowBitOptions | None = None,
) -> dict[str, WeightParams | BlockwiseWeight]:
    """Every planned weight in its stored form; `hessians` maps layer inputs
    (Layout.weight_inputs) to their calibration Hessians, which method gptq and scale
    estimation (`options`) round against."""
    initializers = {init.name: init for init in model.graph.initializer}
    plans = layout.plan.weight_plans()
    integer = integer_kernel_weights(layout)
    hessians = hessians or {}
    options = options if options is not None else LowBitOptions()
    weights: dict[str, WeightParams | BlockwiseWeight] = {}
    for name, slot in layout.weights.items():
        array = tensor_array(initializers[name])
        if plans[name].format == "e4m3":
            weights[name] = quantize_fp8_weight(array, slot.axis)
        elif name in integer:
            if slot.transposed:  # a dynamic Gemm's transB weight, stored [K, N] for MatMulInteger
                array = np.ascontiguousarray(array.T)
            weights[name] = choose_weight(array, slot, plans[name], cpu, spec.saturation, device)
        else:
            hessian = hessians.get(layout.weight_inputs.get(name, ""))
            weights[name] = quantize_low_bit(array, slot, plans[name], hessian, options)
    return weights


def bias_parameters(
    model: onnx.ModelProto,
    layout: Layout,
    activations: dict[str, ActivationParams],
    weights: dict[str, WeightParams],
) -> dict[str, BiasParams]:
    initializers = {init.name: init for init in model.graph.initializer}
    biases = {}
    for name, slot in layout.biases.items():  # int32 biases read int8 pairs (registry entries)
        values, scale = quantize_bias(
            tensor_array(initializers[name]),
            activations[slot.activation].scale,
            np.asarray(weights[slot.weight].scale),
        )
        biases[name] = BiasParams(values, scale)
    return biases
