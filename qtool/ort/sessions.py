"""The one place qtool creates ONNX Runtime sessions.

Calibration, sensitivity analysis and evaluation all compare numbers produced by ONNX Runtime, so
they must all run under the same session settings: the CPU provider unless a GPU provider is asked
for by name, sequential execution with one inter-op thread (so results and timings do not depend
on scheduling), and an explicit intra-op thread count when the caller gives one. Load failures
become `ModelError` naming the file, because ORT's own messages bury the path in a stack trace.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper

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


def session_options(threads: int | None, optimize: bool) -> onnxruntime.SessionOptions:
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


# The oldest IR version qtool asks for: opset 17, its minimum opset, needs IR 8.
_OLDEST_IR = 8


@functools.cache
def max_ir_version() -> int:
    """The newest ONNX IR version the installed onnxruntime loads.

    The installed onnx package stamps its own (newer) IR version on every model it builds, and ORT
    refuses any IR version above the one it was built with, but has no API that says which one
    that is; so it is probed with a one-node model, a millisecond per candidate.
    """
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "ir_probe",
        [value],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = session_options(threads=1, optimize=False)
    for version in range(max(onnx.IR_VERSION, _OLDEST_IR), _OLDEST_IR - 1, -1):
        probe.ir_version = version
        try:
            onnxruntime.InferenceSession(
                probe.SerializeToString(), sess_options=options, providers=[CPU_PROVIDER]
            )
        except Exception:  # ORT's private exception types; the next older version is tried
            continue
        return version
    raise ModelError(
        f"onnxruntime {onnxruntime.__version__} loads no model of IR version {_OLDEST_IR} to "
        f"{onnx.IR_VERSION}: the installation is broken"
    )


def create_session(
    model: str | Path | bytes,
    *,
    threads: int | None = None,
    optimize: bool = True,
    providers: list[str] | None = None,
    config: dict[str, str] | None = None,
    save_optimized: Path | None = None,
    spinning: bool = True,
    arena: bool = True,
) -> onnxruntime.InferenceSession:
    """Create an inference session with qtool's deterministic settings.

    `arena=False`: ORT frees each run's tensors instead of keeping them in its memory arena,
    for a session that runs a few batches beside another one and is then dropped (verification's
    unfused run: an LLM's logits grew the arena by gigabytes that nothing reused).

    `spinning=False`: ORT's idle intra-op threads sleep instead of spinning for the next run.
    For sessions whose caller works between runs (calibration observes every output): the
    spinning thread would burn a core through that work, 3 of 17 CPU seconds calibrating the
    benchmark encoder. Latency measurements keep ORT's default, as deployments run it.

    `save_optimized`: where ORT also saves the graph it optimized (initializers of 1 MB or more
    to `save_optimized`.data), for reading what it runs (qtool.runtime.fusion).

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
    options = session_options(threads, optimize)
    for key, value in sorted((config or {}).items()):  # e.g. MatMulNBits' accuracy level
        options.add_session_config_entry(key, value)
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.enable_cpu_mem_arena = arena
    if save_optimized is not None:
        options.optimized_model_filepath = str(save_optimized)
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name",
            f"{Path(save_optimized).name}.data",
        )
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", str(1 << 20)
        )
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


# Run in a child process per provider: loading a GPU provider's library can abort the process
# (missing CUDA libraries, driver mismatch), and ORT falls back to the CPU without raising.
_PROBE_SCRIPT = """
import json, sys
import onnxruntime
provider = sys.argv[1]
try:
    session = onnxruntime.InferenceSession(sys.stdin.buffer.read(), providers=[provider])
    print(json.dumps({"active": session.get_providers()}))
except Exception as exc:
    print(json.dumps({"error": str(exc)}))
"""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MISSING_LIBRARY = re.compile(r"(lib[\w.+-]+?\.so[\w.]*): cannot open shared object file")


def _probe_reason(stderr: str, error: str | None) -> str:
    """Why a provider did not start, in a few words from ORT's own log lines."""
    text = _ANSI.sub("", stderr) + "\n" + (error or "")
    missing = _MISSING_LIBRARY.search(text)
    if missing is not None:
        return f"{missing.group(1)} not found"
    for line in text.splitlines():
        line = _ORT_SOURCE.sub(" ", _ORT_STATUS.sub("", line.strip()))
        if line.startswith(("[E:", "[W:")):
            line = line.split("] ", 1)[-1]
        if line and ("fail" in line.lower() or "error" in line.lower()):
            return line[:160]
    return "ONNX Runtime fell back to the CPU"


def provider_status(timeout_s: float = 4.0) -> dict[str, str]:
    """For each provider this onnxruntime build has, 'runs' or 'cannot run here (why)'.

    `get_available_providers()` lists what the build contains (onnxruntime-gpu lists CUDA and
    TensorRT on a machine without a GPU); this creates a one-node session with each provider, in
    parallel child processes, and checks that the session really uses it.
    """
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "provider_probe",
        [value],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = _OLDEST_IR
    data = model.SerializeToString()
    status: dict[str, str] = {}
    children: dict[str, subprocess.Popen] = {}
    for provider in onnxruntime.get_available_providers():
        if provider == CPU_PROVIDER:
            status[provider] = "runs"
            continue
        children[provider] = subprocess.Popen(
            [sys.executable, "-c", _PROBE_SCRIPT, provider],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    for provider, child in children.items():
        try:
            out, err = child.communicate(data, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            status[provider] = f"cannot run here (no session within {timeout_s:g} s)"
            continue
        stderr = err.decode(errors="replace")
        if child.returncode != 0:
            status[provider] = f"cannot run here (loading it crashed: exit {child.returncode})"
            continue
        try:
            result = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            result = {"error": "no answer from the probe"}
        if provider in result.get("active", [])[:1]:
            status[provider] = "runs"
        else:
            status[provider] = f"cannot run here ({_probe_reason(stderr, result.get('error'))})"
    return status


# ONNX element types of the float inputs a typed model may declare (quantization.float_io).
_FLOAT_INPUTS = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def as_declared(feed: Mapping[str, np.ndarray], session: onnxruntime.InferenceSession) -> dict:
    """`feed` with each float array in the float type `session` declares for that input: a
    model written with `quantization.float_io: float_type` takes FP16 inputs where the data and
    the FP32 model have FP32. Every other array (and a matching one) is passed as it is."""
    declared = {i.name: _FLOAT_INPUTS.get(i.type) for i in session.get_inputs()}
    converted = {}
    for name, array in feed.items():
        wanted = declared.get(name)
        floating = isinstance(array, np.ndarray) and array.dtype in (np.float32, np.float16)
        converted[name] = array.astype(wanted) if wanted and floating else array
    return converted


# Output values one comparison run may produce. A batch of 8 decoder windows of 512 tokens made
# SmolLM2-135M's logits 200M values, and ORT's activations for the whole batch at once took its
# quantize to 6.8 GB (10x the file); such a batch runs a few rows at a time instead.
RUN_ELEMENTS = 1 << 24


def feed_rows(feed: Mapping[str, np.ndarray], rows: slice) -> dict[str, np.ndarray]:
    """Samples `rows` (the first axis) of every input of a batch's feed (views)."""
    return {name: array[rows] for name, array in feed.items()}


def runs_by_rows(
    session: onnxruntime.InferenceSession,
    names: list[str],
    feed: Mapping[str, np.ndarray],
    limit: int | None = None,
) -> Iterator[tuple[slice, list[np.ndarray]]]:
    """(rows, outputs) runs of `session` covering the batch `feed` (every input's first axis is
    its samples): one run where the outputs of the whole batch stay under `limit` values
    (RUN_ELEMENTS), else runs of as many rows as do. The first row's outputs tell the size of
    one row's; a batch that fits, or a model whose inputs fix the batch dimension, runs whole,
    exactly as it would without this."""
    limit = RUN_ELEMENTS if limit is None else limit
    total = len(next(iter(feed.values())))
    # a model whose inputs fix their first dimension (an exported batch of 4) takes whole batches
    fixed = any(
        i.name in feed and i.shape and isinstance(i.shape[0], int) for i in session.get_inputs()
    )
    if fixed or total <= 1:
        yield slice(0, total), session.run(names, as_declared(feed, session))
        return
    first = session.run(names, as_declared(feed_rows(feed, slice(0, 1)), session))
    step = max(1, limit // max(sum(int(o.size) for o in first), 1))
    if step >= total:
        yield slice(0, total), session.run(names, as_declared(feed, session))
        return
    yield slice(0, 1), first
    for start in range(1, total, step):
        rows = slice(start, min(start + step, total))
        yield rows, session.run(names, as_declared(feed_rows(feed, rows), session))
