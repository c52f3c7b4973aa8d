"""TensorRT's own word, where it can be had: build the engine and read each layer's precision.

Where the `tensorrt` Python package and a CUDA GPU are present, the quantized file is parsed into
a strongly typed network (TensorRT 11 builds no other kind; on TensorRT 10 the STRONGLY_TYPED
flag asks for it), built with detailed profiling verbosity, and the engine inspector's JSON gives
every layer's inputs and outputs with their formats and types. That is what report.json records
as measured by TensorRT. Anywhere else `unavailable()` says why, and nothing is claimed.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping

# The type words TensorRT's inspector prints inside a "Format/Datatype" string.
_TYPE_WORDS = (
    ("FP8", "fp8"),
    ("Int8", "int8"),
    ("Int4", "int4"),
    ("BFloat16", "bf16"),
    ("Half", "fp16"),
    ("Float", "fp32"),
    ("Int32", "int32"),
    ("Int64", "int64"),
    ("Bool", "bool"),
)


def unavailable() -> str | None:
    """Why no engine can be built here, or None when one can."""
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt Python package is not installed"
    try:
        import tensorrt as trt  # noqa: PLC0415 - optional, GPU-only dependency

        builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
        if builder is None:  # TensorRT logs the CUDA failure and returns no builder
            return "TensorRT found no CUDA GPU"
    except Exception as exc:  # TensorRT raises its own types when no GPU or driver is present
        return f"TensorRT cannot start here: {exc}"
    return None


def _datatype(text: str) -> str:
    for word, name in _TYPE_WORDS:
        if word in text:
            return name
    return text


def _layer(entry: Mapping) -> dict:
    def formats(key: str) -> list[str]:
        return [_datatype(str(t.get("Format/Datatype", ""))) for t in entry.get(key, [])]

    return {
        "name": entry.get("Name", ""),
        "type": entry.get("LayerType", ""),
        "inputs": formats("Inputs"),
        "outputs": formats("Outputs"),
        "tactic": entry.get("TacticName", ""),
    }


def inspect_engine(model: bytes, shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """Build `model` with TensorRT and return each layer's types (the engine inspector's).

    `shapes`: every input's shape, used as the optimization profile's min = opt = max (the
    calibration batch the recipe describes). Raises RuntimeError with TensorRT's words when the
    file does not parse or the build fails."""
    import tensorrt as trt  # noqa: PLC0415 - optional, GPU-only dependency

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    strongly = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly is not None:
        flags |= 1 << int(strongly)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model):
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser refused the model: {errors}")
    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    profile = builder.create_optimization_profile()
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        shape = tuple(shapes.get(tensor.name, tuple(tensor.shape)))
        profile.set_shape(tensor.name, shape, shape, shape)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT could not build an engine from the model (see its log)")
    engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
    inspector = engine.create_engine_inspector()
    information = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    layers = [_layer(entry) for entry in information.get("Layers", []) if isinstance(entry, dict)]
    counts: dict[str, int] = {}
    for layer in layers:
        kind = layer["outputs"][0] if layer["outputs"] else "none"
        counts[kind] = counts.get(kind, 0) + 1
    return {
        "built": True,
        "tensorrt_version": trt.__version__,
        "strongly_typed": strongly is not None or _major(trt.__version__) >= 11,
        "layers_by_output_type": dict(sorted(counts.items())),
        "layers": layers,
    }


def _major(version: str) -> int:
    match = re.match(r"(\d+)", version)
    return int(match.group(1)) if match else 0


def engine_block(model: bytes, shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """report.json's `tensorrt.engine`: the built engine's layers, or why there is none."""
    why = unavailable()
    if why is not None:
        return {"built": False, "why": why}
    try:
        return inspect_engine(model, shapes)
    except RuntimeError as exc:
        return {"built": False, "why": str(exc), "failed": True}
