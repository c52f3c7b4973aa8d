"""The one place qtool creates ONNX Runtime sessions.

Calibration, sensitivity analysis and evaluation all compare numbers produced by ONNX Runtime, so
they must all run under the same session settings: the CPU provider unless a GPU provider is asked
for by name, sequential execution with one inter-op thread (so results and timings do not depend
on scheduling), and an explicit intra-op thread count when the caller gives one. Load failures
become `ModelError` naming the file, because ORT's own messages bury the path in a stack trace.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnxruntime

from qtool.errors import ModelError, first_line

CPU_PROVIDER = "CPUExecutionProvider"
# ORT prefixes messages with a status code and a C++ source location; users need only the reason.
_ORT_STATUS = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_SOURCE = re.compile(r"/\S+\.(?:cc|cpp|h):\d+ [^()]*\([^()]*\) ")


def ort_reason(exc: Exception) -> str:
    """The first line of ORT's message without its status prefix and C++ source location."""
    return _ORT_SOURCE.sub(" ", _ORT_STATUS.sub("", first_line(exc)))


def _describe(model: str | Path | bytes) -> str:
    """Name the model in error messages: its path, or a note that it came from memory."""
    if isinstance(model, bytes):
        return "<in-memory model>"
    return str(model)


def _session_options(threads: int | None, optimize: bool) -> onnxruntime.SessionOptions:
    """Options shared by every session so results and timings are comparable between commands."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    options = onnxruntime.SessionOptions()
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    if threads is not None:
        options.intra_op_num_threads = threads
    options.graph_optimization_level = (
        onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    # GPU kernels (e.g. reductions using atomics) may otherwise differ from run to run.
    options.use_deterministic_compute = True
    # ORT's warnings (e.g. about unused initializers) go to stderr and clutter the CLI output;
    # real failures still raise.
    options.log_severity_level = 3
    return options


def _resolve_providers(providers: list[str] | None) -> list[str]:
    """CPU unless the caller names providers; a named provider that this build lacks is an error."""
    if not providers:
        return [CPU_PROVIDER]
    available = onnxruntime.get_available_providers()
    missing = [p for p in providers if p not in available]
    if missing:
        raise ModelError(
            f"execution provider {missing[0]!r} is not available in this onnxruntime build "
            f"(available: {', '.join(available)})"
        )
    return list(providers)


def create_session(
    model: str | Path | bytes,
    *,
    threads: int | None = None,
    optimize: bool = True,
    providers: list[str] | None = None,
    config: dict[str, str] | None = None,
) -> onnxruntime.InferenceSession:
    """Create an inference session with qtool's deterministic settings.

    `model` is a path to an .onnx file or the serialized model bytes (used for models built in
    memory, e.g. during calibration with extra outputs). `threads` sets intra-op threads; None
    leaves ORT's default (one per physical core). `optimize=False` disables graph rewrites, which
    is needed when intermediate tensors must keep their names and values.
    """
    name = _describe(model)
    if not isinstance(model, bytes):
        path = Path(model)
        if not path.is_file():
            raise ModelError(f"model file {name} does not exist")
        model = str(path)
    requested = _resolve_providers(providers)
    options = _session_options(threads, optimize)
    for key, value in sorted((config or {}).items()):  # e.g. MatMulNBits' accuracy level
        options.add_session_config_entry(key, value)
    try:
        session = onnxruntime.InferenceSession(model, sess_options=options, providers=requested)
    except Exception as exc:  # ORT raises several private exception types for a bad model.
        raise ModelError(f"ONNX Runtime cannot load {name}: {ort_reason(exc)}") from exc
    # ORT silently falls back to CPU when a GPU provider fails to initialise (no device, missing
    # CUDA libraries); a run that asked for the GPU must not quietly measure the CPU instead.
    active = session.get_providers()
    dropped = [p for p in requested if p not in active]
    if dropped:
        raise ModelError(
            f"execution provider {dropped[0]!r} could not be initialised for {name} "
            f"(active: {', '.join(active)})"
        )
    return session
