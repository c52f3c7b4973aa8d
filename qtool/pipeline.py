"""The jobs behind the CLI commands: calibrate, quantize, evaluate, each from a validated recipe.

Both calibrate and quantize start from the same prepared float model and the same layout, so the
stats file records the prepared model's SHA-256 and quantize refuses stats collected on another
model instead of silently applying ranges to the wrong tensors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import numpy_helper

from qtool import kernels
from qtool.calibration.collect import collect_statistics
from qtool.calibration.observers import TensorStats
from qtool.calibration.ranges import compute_range
from qtool.calibration.stats_file import load_stats, save_stats
from qtool.data import count_samples_hint, iter_batches
from qtool.errors import CalibrationError, ModelError, QtoolError
from qtool.evaluate import EvalResult, evaluate_models
from qtool.io import atomic_write_bytes
from qtool.models import load_model
from qtool.ort_session import create_session
from qtool.quantize.layout import Layout, plan_layout
from qtool.quantize.params import (
    ActivationParams,
    activation_params,
    quantize_bias,
    quantize_weight,
)
from qtool.quantize.prepare import prepare_model, tensor_types
from qtool.quantize.qdq import BiasParams, write_qdq_model
from qtool.recipe import Recipe
from qtool.report import build_report, write_report


@dataclass
class PreparedModel:
    model: onnx.ModelProto
    serialized: bytes
    fingerprint: str
    layout: Layout


@dataclass
class QuantizeResult:
    model_path: Path
    report_path: Path
    report: dict


def prepare(recipe: Recipe) -> PreparedModel:
    """Load, export if needed, prepare, and plan the QDQ layout (nothing is written yet)."""
    model = prepare_model(load_model(recipe.model, recipe.inputs), min_opset=recipe.model.opset)
    float_tensors = {
        name for name, (elem, _) in tensor_types(model).items() if elem == onnx.TensorProto.FLOAT
    }
    layout = plan_layout(model, recipe.quantization, float_tensors)
    if not layout.quantized_nodes():
        raise ModelError(
            f"{recipe.path}: no node can be quantized with quantization.op_types "
            f"{list(recipe.quantization.op_types)} and the exclude list"
        )
    serialized = model.SerializeToString()
    fingerprint = hashlib.sha256(serialized).hexdigest()
    return PreparedModel(model, serialized, fingerprint, layout)


def calibrate(recipe: Recipe, prepared: PreparedModel, progress: bool = True) -> list[TensorStats]:
    """Stream the calibration set through the model; write and return the statistics."""
    spec = recipe.calibration
    tensors = prepared.layout.stats_tensors()
    batches = iter_batches(spec.data, recipe.inputs, spec.batch_size, spec.max_samples, recipe.seed)
    stats = collect_statistics(
        prepared.model,
        tensors,
        batches,
        bins=spec.bins,
        device=kernels.default_device(),
        total_samples=count_samples_hint(spec.data, spec.max_samples),
        progress=progress,
    )
    save_stats(recipe.stats_path, stats, prepared.fingerprint, spec.bins)
    atomic_write_bytes(recipe.float_model_path, prepared.serialized)
    return stats


def quantize(
    recipe: Recipe, stats_path: Path | None = None, progress: bool = True
) -> QuantizeResult:
    """Ranges from statistics (calibrating first when no stats file is given) -> QDQ model."""
    prepared = prepare(recipe)
    if stats_path is None:
        stats = {s.name: s for s in calibrate(recipe, prepared, progress)}
    else:
        stats, fingerprint = load_stats(stats_path)
        if fingerprint != prepared.fingerprint:
            raise CalibrationError(
                f"{stats_path}: collected on a different model than {recipe.path} describes "
                "(re-run `qtool calibrate`)"
            )
    layout = prepared.layout
    device = kernels.default_device()
    symmetric = recipe.quantization.symmetric_activations
    activations: dict[str, ActivationParams] = {}
    for tensor, slot in layout.activations.items():
        if slot.stats_tensor not in stats:
            raise CalibrationError(f"stats file has no statistics for tensor '{slot.stats_tensor}'")
        low, high = compute_range(
            stats[slot.stats_tensor],
            recipe.calibration.method,
            symmetric,
            recipe.calibration.percentile,
            device,
        )
        activations[tensor] = activation_params(low, high, symmetric)
    initializers = {init.name: init for init in prepared.model.graph.initializer}
    weights = {
        name: quantize_weight(numpy_helper.to_array(initializers[name]), slot.axis, device)
        for name, slot in layout.weights.items()
    }
    biases = {}
    for name, slot in layout.biases.items():
        values, scale = quantize_bias(
            numpy_helper.to_array(initializers[name]),
            activations[slot.activation].scale,
            weights[slot.weight].scale,
        )
        biases[name] = BiasParams(values, scale)
    quantized = write_qdq_model(prepared.model, layout, activations, weights, biases)
    serialized = quantized.SerializeToString()
    try:
        create_session(serialized)
    except QtoolError as exc:
        raise ModelError(f"the quantized model does not load in ONNX Runtime: {exc}") from None
    atomic_write_bytes(recipe.quant_model_path, serialized)
    atomic_write_bytes(recipe.float_model_path, prepared.serialized)
    node_inputs = {node.name: list(node.input) for node in prepared.model.graph.node}
    files = {
        "float_model": str(recipe.float_model_path),
        "quantized_model": str(recipe.quant_model_path),
        "stats": str(stats_path or recipe.stats_path),
    }
    report = build_report(recipe, node_inputs, layout, activations, weights, files)
    write_report(recipe.report_path, report)
    return QuantizeResult(recipe.quant_model_path, recipe.report_path, report)


def evaluate(fp32_path: Path, quant_path: Path, batches, **options) -> EvalResult:
    """Evaluate recipe-style batches (qtool.data.Batch); `options` go to evaluate_models."""
    for path in (fp32_path, quant_path):
        if not Path(path).is_file():
            raise ModelError(f"{path}: model file not found (run `qtool quantize` first)")
    pairs = ((batch.inputs, batch.labels) for batch in batches)
    return evaluate_models(Path(fp32_path), Path(quant_path), pairs, **options)
