"""Input checks for evaluate: the data must fit both models, and the two models must match.

ONNX Runtime would reject bad data too, but with a message that names neither the input nor the
file; these checks run before it, on every batch, and say which input, batch and model is at
fault. The float and quantized models are matched output by output, by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import helper

from qtool.errors import DataError, ModelError


def ort_type_to_numpy(ort_type: str, model: Path, name: str) -> np.dtype:
    """Map ORT's 'tensor(float)' strings through ONNX's own dtype table rather than a copy of it."""
    if not (ort_type.startswith("tensor(") and ort_type.endswith(")")):
        raise ModelError(f"{model}: input {name!r} has type {ort_type}; only tensors are supported")
    elem = ort_type[len("tensor(") : -1].upper()
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(onnx.TensorProto.DataType.Value(elem)))
    except (ValueError, KeyError) as exc:
        raise ModelError(f"{model}: input {name!r} has unsupported type {ort_type}") from exc


def format_expected(shape: list) -> str:
    """Show symbolic dims by name ('N') and unknown ones as '?', as a user would write them."""
    dims = [str(d) if isinstance(d, int) else (d if d else "?") for d in shape]
    return "[" + ", ".join(dims) + "]"


@dataclass
class ModelInput:
    name: str
    dtype: np.dtype
    shape: list  # ints for fixed dims, str/None for symbolic ones


def input_specs(session: onnxruntime.InferenceSession, model: Path) -> list[ModelInput]:
    return [
        ModelInput(i.name, ort_type_to_numpy(i.type, model, i.name), list(i.shape))
        for i in session.get_inputs()
    ]


def validate_inputs(
    inputs: Mapping[str, np.ndarray], specs: list[ModelInput], model: Path, batch_index: int
) -> None:
    """Reject data that does not fit the model before ORT does, with a message naming the input."""
    expected = {s.name for s in specs}
    extra = sorted(set(inputs) - expected)
    if extra:
        raise DataError(
            f"evaluation batch {batch_index} has input {extra[0]!r} but {model.name} has inputs "
            f"{sorted(expected)}"
        )
    for spec in specs:
        if spec.name not in inputs:
            raise DataError(
                f"evaluation batch {batch_index} is missing input {spec.name!r} "
                f"required by {model.name}"
            )
        array = inputs[spec.name]
        if not isinstance(array, np.ndarray):
            raise DataError(
                f"evaluation input {spec.name!r} is a {type(array).__name__}, not a numpy array"
            )
        if array.dtype != spec.dtype:
            raise DataError(
                f"evaluation input {spec.name!r} has dtype {array.dtype} but {model.name} "
                f"expects {spec.dtype}"
            )
        fits = array.ndim == len(spec.shape) and all(
            not isinstance(d, int) or d == n for d, n in zip(spec.shape, array.shape, strict=True)
        )
        if not fits:
            raise DataError(
                f"evaluation input {spec.name!r} has shape {tuple(array.shape)} but the model "
                f"expects {format_expected(spec.shape)} ({model.name})"
            )
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise DataError(
                f"evaluation input {spec.name!r} contains NaN or Inf in batch {batch_index}"
            )


def check_labels(
    labels: np.ndarray, predictions: np.ndarray, output: str, batch_index: int
) -> np.ndarray:
    """Labels must give one class index per top-1 prediction (shape = output shape minus last)."""
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"evaluation labels in batch {batch_index} have dtype {labels.dtype}; "
            "expected integer class indices"
        )
    if labels.shape != predictions.shape:
        raise DataError(
            f"evaluation labels in batch {batch_index} have shape {labels.shape} but the top-1 "
            f"predictions of output {output!r} have shape {predictions.shape}"
        )
    return labels


def output_names(
    ref: onnxruntime.InferenceSession,
    quant: onnxruntime.InferenceSession,
    fp32_path: Path,
    quant_path: Path,
) -> list[str]:
    """The FP32 model's outputs, in its order; the quantized model must have the same names."""
    names = [o.name for o in ref.get_outputs()]
    for o in ref.get_outputs():
        if not o.type.startswith("tensor("):
            raise ModelError(f"{fp32_path}: output {o.name!r} has type {o.type}; only tensors")
    quant_names = [o.name for o in quant.get_outputs()]
    if set(names) != set(quant_names):
        missing = [n for n in names if n not in quant_names]
        extra = [n for n in quant_names if n not in names]
        detail = (
            f"{quant_path.name} has no output {missing[0]!r}, which {fp32_path.name} has"
            if missing
            else f"{quant_path.name} has output {extra[0]!r}, which {fp32_path.name} lacks"
        )
        raise ModelError(
            f"{detail} (outputs are matched by name: {fp32_path.name} has {names}, "
            f"{quant_path.name} has {quant_names})"
        )
    return names
