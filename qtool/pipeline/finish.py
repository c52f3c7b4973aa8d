"""The last stages of a quantized model: record what it was made from, write it (staged, not
yet committed), load it as ONNX Runtime will run it, verify what ORT really does with every
planned node, and describe all of it in report.json."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from qtool import __version__
from qtool.data.source import BatchSource
from qtool.errors import DataError, ModelError, QtoolError
from qtool.io import Staged, stage
from qtool.model import external_data, provenance
from qtool.model.inline_write import write_inline
from qtool.model.memory import release_freed_memory
from qtool.ort.float8 import unfused_only_reason
from qtool.phases import phase
from qtool.pipeline.build import Built
from qtool.pipeline.float_model import FloatModel
from qtool.plan.plan import Plan
from qtool.report import ReportHeader, build_report
from qtool.runtime.bf16_emulation import EMULATED, emulated, has_bf16
from qtool.runtime.fused_vs_unfused import run_unfused
from qtool.runtime.fusion import optimized_session
from qtool.runtime.tensorrt_engine import engine_block
from qtool.runtime.tensorrt_rules import check_placement
from qtool.runtime.verify import Verification, verify, verify_unfused_only

# Calibration samples the verify stage runs fused and unfused: a saturating kernel or a fusion
# that computes differently shows on any batch (digits without VNNI: 19 against 45 dB, the warning
# fires below 30), and the unfused QDQ run of a transformer is the stage's largest cost (bert
# benchmark: 0.35-0.5 of quantize's 3 CPU s above the inference floor at 8 samples).
VERIFY_SAMPLES = 4
VERIFY_THREADS = 1  # the fused-vs-unfused comparison is about numerics, not speed

# The speed check runs the float model beside the quantized one: for a float model over
# protobuf's limit that session alone is the model's size again (measured: qtool's peak on a
# 2.15 GB decoder went from 2.6 GB to 4.0 GB with weight-only INT8, whose DequantizeLinear ORT
# folds back to float weights), and its runs cost ~10 CPU s. `qtool evaluate` measures latency.
# The FP32 speed check's session holds the float model again (about 1.6x its file: Gemma 3
# 270M's 1.08 GB file took 1.7 GB, and its run 0.6 GB more, on top of the quantized model's
# sessions): the largest share of a big model's quantize peak. Above this size it is left to
# `qtool evaluate`.
SPEED_CHECK_MAX_BYTES = 512 << 20
SPEED_NOT_MEASURED = (
    "not measured: the float model is over 512 MB (its session would hold it again, about "
    "1.6x its size); `qtool evaluate` measures both models' latency"
)

# Who the `runtime` block speaks for: ORT's CPU provider is qtool's verifier for every target,
# and for TensorRT it says so rather than pass ORT's fusion off as TensorRT's.
RUNS_ON = {
    "ort-cpu": "ONNX Runtime, CPU execution provider (the target)",
    "tensorrt": "ONNX Runtime, CPU execution provider: qtool's verifier, not TensorRT (see the "
    "tensorrt block for TensorRT)",
}


def explained_fp32(plan: Plan, float_type: dict | None) -> dict[str, str]:
    """Nodes that compute in FP32 in a model with a low float type, and the Casts the typing
    pass wrote, each with why: what the TensorRT placement check accepts as a stated reason."""
    explained = {}
    for node in plan:
        record = node.float_type or {}
        if record.get("computes_in") == "fp32":
            explained[node.name] = record.get("reason") or "precision float (FP32) asked"
    for cast in (float_type or {}).get("casts", []):
        explained[cast["node"]] = cast["why"]
    return explained


def tensorrt_warnings(block: dict) -> list[str]:
    """A warning per placement violation, and one when TensorRT was there and refused the file."""
    warnings = [
        f"TensorRT rule {v['rule']} ({block['placement']['basis']}): {v['node']}: {v['detail']}"
        for v in block["placement"]["violations"]
    ]
    engine = block["engine"]
    if engine.get("failed"):
        warnings.append(f"TensorRT did not build the model: {engine['why']}")
    return warnings


@dataclass
class Finished:
    """The quantized model's files (staged or in memory) and its report, ready to commit."""

    files: dict[Path, bytes | Staged]
    report: dict
    verification: Verification
    source: bytes | Path  # what an ORT session loads the quantized model from
    staged: external_data.StagedModel | None = None
    warnings: list[str] = field(default_factory=list)

    def discard(self) -> None:
        if self.staged is not None:
            self.staged.discard()


def stamp_provenance(
    quantized: onnx.ModelProto,
    float_model: FloatModel,
    settings_sha256: str,
    data_sha256: str | None,
) -> None:
    """Record in `quantized` what it was made from, so `evaluate` can refuse a foreign FP32."""
    values = {
        provenance.VERSION: __version__,
        provenance.FLOAT_MODEL_SHA256: float_model.fingerprint,
        provenance.SOURCE_MODEL_SHA256: float_model.source_sha256,
        provenance.RECIPE_SHA256: settings_sha256,
        provenance.CALIBRATION_DATA_SHA256: data_sha256 or "none",
    }
    if float_model.source_bytes is not None:
        values[provenance.SOURCE_MODEL_BYTES] = str(float_model.source_bytes)
    provenance.stamp(quantized, values)


def stage_quantized(
    quantized: onnx.ModelProto, model_path: Path, external: bool, large: bool = False
) -> tuple[bytes | Path, dict[Path, bytes | Staged], external_data.StagedModel | None]:
    """The quantized model written for commit: in memory (the float weights it keeps that are
    still lazy read in), or as external data beside `model_path` when the float model is over
    protobuf's limit (ORT sessions then map the weights from the file instead of each copying
    the serialized model) or it is itself.

    `large` (a staged float model, STAGE_WEIGHTS_THRESHOLD): the file committed is still one
    protobuf, written by streaming (inline_write), and verification's sessions read a staged
    external-data copy (discarded with the returned StagedModel): from bytes, each session
    copied the whole model (a 138 MB int8 decoder: +160 MB for the unfused one, +23 MB mapped)."""
    if external or external_data.needs_external_data(quantized):
        with phase("writing the quantized model (external data)"):
            external_data.check_model(quantized)
            staged = external_data.stage_model(quantized, model_path)
        return staged.session_path, staged.files(), staged
    if large:
        with phase("writing the quantized model"):
            external_data.check_model(quantized)
            for_sessions = external_data.stage_model(quantized, model_path)
            try:
                inline = stage(model_path, lambda handle: write_inline(quantized, handle))
            except BaseException:
                for_sessions.discard()
                raise
        return for_sessions.session_path, {model_path: inline}, for_sessions
    external_data.read_lazy_weights(quantized)
    source = quantized.SerializeToString()
    external_data.check_model(quantized, source)
    return source, {model_path: source}, None


def verify_and_report(
    built: Built,
    float_model: FloatModel,
    model_path: Path,
    header: ReportHeader,
    feeds: Sequence[dict[str, np.ndarray]],
    files: dict[str, str],
    settings_sha256: str,
    data_sha256: str | None,
) -> Finished:
    """Stamp, stage, load and verify `built`, and build report.json. The caller commits the
    files (with whatever else the command writes) and discards the staging on failure."""
    quantized = built.model
    stamp_provenance(quantized, float_model, settings_sha256, data_sha256)
    unfused_only = unfused_only_reason(quantized)
    target = header.quantization.target
    placement = None
    if target == "tensorrt":
        placement = check_placement(
            quantized,
            explained_fp32(built.layout.plan, built.float_type),
            header.quantization.float_type,
        )
    engine_source = quantized.SerializeToString() if target == "tensorrt" else None
    # A BF16 file does not load on ORT's CPU provider: its FP32 emulation is what ORT checks.
    emulation = emulated(quantized).SerializeToString() if has_bf16(quantized) else None
    source, quant_files, staged = stage_quantized(
        quantized, model_path, float_model.over_limit, float_model.staged is not None
    )
    del quantized
    built.model = None
    built.drop_weight_values()
    release_freed_memory()  # the quantized proto, now in its staged file or bytes
    ort_source = emulation if emulation is not None else source
    finished = None
    try:
        with phase("verifying what ONNX Runtime runs"):
            verification = _verify(
                ort_source,
                model_path,
                built,
                header,
                feeds,
                float_model,
                unfused_only,
            )
        if emulation is not None:
            verification.summary["emulated"] = EMULATED
        verification.summary["runs_on"] = RUNS_ON[target]
        tensorrt = None
        if placement is not None:
            shapes = {name: tuple(array.shape) for name, array in feeds[0].items()}
            with phase("TensorRT: the placement check, and the engine where one can be built"):
                tensorrt = {"placement": placement, "engine": engine_block(engine_source, shapes)}
            del engine_source
            verification.warnings.extend(tensorrt_warnings(tensorrt))
        files = dict(files)
        if staged is not None and staged.data_path in quant_files:  # ship both files
            files["quantized_model_data"] = str(staged.data_path)
        if float_model.staged is not None and float_model.commit_staged:
            files["float_model_data"] = str(float_model.staged.data_path)
        elif float_model.staged is not None:  # over 2 GB, not asked for: not written
            files["float_model"] = None
        report = build_report(
            header,
            built.node_inputs,
            built.layout,
            built.activations,
            built.weights,
            files,
            built.cpu,
            verification.summary,
        )
        report["algorithms"] = built.algorithms
        if built.choice is not None:
            report["model_choice"] = built.choice
        report["size"] = _sizes(float_model, quant_files)
        report["float_type"] = built.float_type
        if tensorrt is not None:
            report["tensorrt"] = tensorrt
        report["int4_matmul"] = {
            "format": header.quantization.resolved_int4_format,
            "accuracy_level": built.nbits,
            "why": built.nbits_reason,
        }
        finished = Finished(
            quant_files, report, verification, source, staged, list(verification.warnings)
        )
        return finished
    finally:
        if finished is None and staged is not None:
            staged.discard()


def _file_bytes(files: dict[Path, bytes | Staged]) -> int:
    return sum(
        len(content) if isinstance(content, bytes) else content.path.stat().st_size
        for content in files.values()
    )


def _sizes(float_model: FloatModel, quant_files: dict[Path, bytes | Staged]) -> dict:
    """The quantized model's size against the user's model file and the prepared float model
    (they differ where preparation stored a tied table once that the export stored twice)."""
    quantized = _file_bytes(quant_files)
    if float_model.staged is not None:  # what its files hold, written or not (deferred)
        prepared = len(float_model.staged.skeleton) + float_model.staged.data_bytes
    elif float_model.float_file is not None:
        prepared = float_model.float_file.path.stat().st_size
    else:
        prepared = len(float_model.serialized or b"")
    sizes = {
        "source_model_bytes": float_model.source_bytes,
        "float_model_bytes": prepared,
        "quantized_model_bytes": quantized,
        "source_over_quantized": None,
        "float_over_quantized": prepared / quantized if quantized else None,
    }
    if float_model.source_bytes is not None and quantized:
        sizes["source_over_quantized"] = float_model.source_bytes / quantized
    return sizes


def _verify(
    source: bytes | Path,
    model_path: Path,
    built: Built,
    header: ReportHeader,
    feeds: Sequence[dict[str, np.ndarray]],
    float_model: FloatModel,
    unfused_only: str | None,
) -> Verification:
    """Load `source` as ORT's CPU provider will run it (unfused only for float8) and verify
    what runs; a model ORT cannot load fails here, named. The unfused QDQ run goes first and
    its outputs wait on disk, so that the two sessions are never alive together."""
    if unfused_only is not None:
        with _load_errors_named(source, model_path):
            return verify_unfused_only(
                source, built.layout.plan, feeds, VERIFY_THREADS, unfused_only
            )
    with _load_errors_named(source, model_path):
        reference = run_unfused(source, feeds, VERIFY_THREADS)
    too_big = _float_bytes(float_model) >= SPEED_CHECK_MAX_BYTES
    try:
        try:
            # Its memory arena only where the session is timed (the speed check): an LLM's
            # run grew it by its logits, which nothing reused.
            loaded = optimized_session(source, VERIFY_THREADS, arena=not too_big)
        except QtoolError as exc:
            if header.quantization.target == "ort-cpu":
                raise _load_error(exc, source, model_path) from None
            # ORT's CPU optimizer is not the target's runtime: a file it cannot load fused is
            # checked unfused, and the report and a warning say so.
            reference.close()
            why = f"ONNX Runtime's CPU graph optimizations cannot load this file ({exc}); "
            why += "qtool runs it unfused (the QDQ semantics)"
            with _load_errors_named(source, model_path):
                checked = verify_unfused_only(source, built.layout.plan, feeds, VERIFY_THREADS, why)
            checked.warnings.append(f"ONNX Runtime CPU check (not the target): {why}")
            return checked
        verification = verify(
            source,
            built.layout.plan,
            feeds,
            built.cpu,
            VERIFY_THREADS,
            target=header.quantization.target,
            float_model=None if too_big else float_model.session_source(),
            loaded=loaded,
            reference=reference,
        )
    finally:
        reference.close()
    if too_big and any(
        n.weight is not None and (n.precision == "int4" or n.activations == "float")
        for n in built.layout.plan.quantized()
    ):
        verification.summary["low_bit_speed"] = {"not_measured": SPEED_NOT_MEASURED}
    return verification


@contextmanager
def _load_errors_named(source: bytes | Path, model_path: Path) -> Iterator[None]:
    """A model ORT cannot load fails as one ModelError naming the output (not its temporary
    file); a batch it cannot run (DataError) is left as it is, named by its batch."""
    try:
        yield
    except DataError:
        raise
    except QtoolError as exc:
        raise _load_error(exc, source, model_path) from None


def _load_error(exc: QtoolError, source: bytes | Path, model_path: Path) -> ModelError:
    """ORT's load failure of `source`, naming the output rather than its temporary file."""
    message = str(exc)
    if isinstance(source, Path):
        message = message.replace(str(source), str(model_path))
    return ModelError(f"the quantized model does not load in ONNX Runtime: {message}")


def _float_bytes(float_model: FloatModel) -> int:
    """The float model's size as a session loads it: the staged skeleton and data file, the
    spilled file, or its bytes."""
    staged = float_model.staged
    if staged is not None:
        return len(staged.skeleton) + staged.data_bytes
    if float_model.serialized is not None:
        return len(float_model.serialized)
    return float_model.float_file.path.stat().st_size


def verify_feeds(data: BatchSource) -> list[dict[str, np.ndarray]]:
    """The first calibration samples, re-read (a stats file carries no inputs)."""
    limit = min(VERIFY_SAMPLES, data.max_samples or VERIFY_SAMPLES)
    return [b.inputs for b in data.batches(min(data.batch_size, limit), limit)]
