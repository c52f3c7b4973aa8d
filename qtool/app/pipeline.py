"""The jobs behind the CLI commands: calibrate, quantize, evaluate, each from a validated recipe.

quantize is a thin sequence of stages (DESIGN.md): prepare -> plan -> calibrate -> ranges ->
weights for the deployment CPU -> write -> verify (what ORT really runs) -> report. Every stage
reads and writes the Plan inside the Layout. Both calibrate and quantize start from the same
prepared float model and layout, so the stats file records the prepared model's SHA-256 and
quantize refuses stats collected on another model instead of silently applying ranges to the
wrong tensors.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from qtool import __version__, distributed, kernels
from qtool.algorithms.bias_correction import apply_bias_correction
from qtool.algorithms.channel_ranges import channel_ranges
from qtool.algorithms.cle import equalize
from qtool.algorithms.smoothquant import apply_smoothquant, channel_observers
from qtool.calibration.channels import ChannelStats, channel_file_bytes, channels_path
from qtool.calibration.collect import collect
from qtool.calibration.data_digest import DataDigest
from qtool.calibration.hessian_file import hessian_file_bytes, load_hessians
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.merge import merge_across_processes
from qtool.calibration.observers import TensorStats
from qtool.calibration.stats_file import (
    ShardRecord,
    load_stats,
    stats_data_sha256,
    stats_file_bytes,
)
from qtool.config.recipe import Recipe
from qtool.data.batches import count_samples_hint, iter_batches
from qtool.distributed import Group, Shard
from qtool.errors import CalibrationError, ModelError, QtoolError
from qtool.io import Staged, commit_files, stage
from qtool.model import external_data, provenance
from qtool.model.load import load_model
from qtool.model.opset21 import TARGET_OPSET
from qtool.model.prepare import prepare_model, tensor_types
from qtool.ort.cpu import resolve_cpu
from qtool.phases import phase
from qtool.plan.layout import Layout, plan_layout
from qtool.report import build_report, report_bytes
from qtool.runtime.fusion import optimized_session
from qtool.runtime.verify import verify
from qtool.write.assemble import activation_parameters, bias_parameters, weight_parameters
from qtool.write.matmul_nbits import nbits_level
from qtool.write.qdq import write_qdq_model

if TYPE_CHECKING:
    from qtool.search.mixed import MixedOutcome


@dataclass
class PreparedModel:
    # None while a staged model's weights are left to the file: during calibration, after writing
    model: onnx.ModelProto | None
    serialized: bytes | None  # the float model file; None when it is staged as external data
    fingerprint: str
    layout: Layout
    source_sha256: str
    # Models over the protobuf limit: the float model written as external data, not committed.
    staged: external_data.StagedModel | None = None
    # Cross-layer equalization's report entry, when the recipe turns it on (done in prepare)
    equalization: dict | None = None
    # The float model file written ahead of the commit, so calibration need not hold its bytes.
    # It holds `serialized`, of which `model` is the parse: calibration copies it rather than
    # serializing `model` again, so nothing may change `model` before calibration.
    float_file: Staged | None = None

    def float_files(self, path: Path) -> dict[Path, bytes | Staged]:
        """The float model file(s) to commit at `path` (the path given to prepare)."""
        if self.staged is None:
            return {path: self.float_file if self.float_file is not None else self.serialized}
        if self.staged.path != path:
            raise ValueError(f"the float model was staged for {self.staged.path}, not {path}")
        return self.staged.files()

    def release(self, path: Path) -> onnx.ModelProto | None:
        """Hand the ModelProto to the caller and let go of the serialized bytes, staging them as
        the float model file for `path` first (written once, committed with the other outputs).
        An ONNX Runtime session holds the model as well: without this the process would hold it
        three times while calibrating (bert benchmark: 759 MB peak against the 557 MB of a bare
        session). `restore` reads both back."""
        serialized = self.serialized
        if self.staged is None and serialized is not None:
            if self.float_file is None:  # else staged by an earlier release of this run
                self.float_file = stage(path, lambda handle: handle.write(serialized))
            self.serialized = None
        model, self.model = self.model, None
        return model

    def restore(self) -> None:
        """Undo `release`: the bytes from the staged float model file, the proto parsed from
        them (the same bytes the fingerprint was computed from)."""
        if self.serialized is None and self.float_file is not None:
            self.serialized = self.float_file.path.read_bytes()
        if self.model is None and self.serialized is not None:
            self.model = onnx.load_from_string(self.serialized)

    def discard(self) -> None:
        """Remove the staged float model's temporary files (a run that fails before committing)."""
        if self.staged is not None:
            self.staged.discard()
        if self.float_file is not None:
            self.float_file.discard()


@dataclass
class QuantizeResult:
    model_path: Path
    report_path: Path
    report: dict
    warnings: list[str] = field(default_factory=list)  # unfused nodes, fused-vs-unfused gaps


# Calibration samples the verify stage runs fused and unfused: a saturating kernel or a fusion
# that computes differently shows on any batch (digits without VNNI: 19 against 45 dB, the warning
# fires below 30), and the unfused QDQ run of a transformer is the stage's largest cost (bert
# benchmark: 0.35-0.5 of quantize's 3 CPU s above the inference floor at 8 samples).
VERIFY_SAMPLES = 4
VERIFY_THREADS = 1  # the fused-vs-unfused comparison is about numerics, not speed


def source_sha256(recipe: Recipe, onnx_digest: hashlib._Hash | None = None) -> str:
    """The model as the user gave it: the ONNX file, or the PyTorch factory and weights file.
    `onnx_digest`: the ONNX source's hash, fed by load_model as it read the file."""
    spec = recipe.model
    if spec.onnx is not None:
        if onnx_digest is not None:
            return onnx_digest.hexdigest()
        return provenance.sha256_model(spec.onnx)
    digest = hashlib.sha256(str(spec.pytorch).encode())
    if spec.weights is not None:
        digest.update(provenance.sha256_file(spec.weights).encode())
    return digest.hexdigest()


def prepare(recipe: Recipe) -> PreparedModel:
    """Load, export if needed, prepare, and plan the QDQ layout (nothing is written yet)."""
    min_opset = recipe.model.opset
    if recipe.quantization.may_need_opset21:
        min_opset = max(min_opset, TARGET_OPSET)
    onnx_digest = hashlib.sha256()
    loaded = load_model(recipe.model, recipe.inputs, onnx_digest)
    source = source_sha256(recipe, onnx_digest)
    with phase("preparing graph"):  # in place: a model over 2 GB must not be held twice
        model = prepare_model(loaded, min_opset=min_opset, copy=False)
    del loaded
    equalization = None
    cle = recipe.quantization.algorithm("cross_layer_equalization")
    if cle is not None:
        with phase("cross-layer equalization"):  # before calibration: ranges of what is run
            # Pairs through Clip(0, 6) (when asked for) are bounded by per-channel maxima on
            # calibration data, bias absorption by the minima (one pass for both, unequalized).
            samples = cle["samples"]
            equalization = equalize(
                model,
                recipe.quantization.per_channel,
                ranges=lambda tensors: channel_ranges(
                    model, tensors, _calibration_inputs(recipe, samples)
                ),
                bias_absorption=cle["bias_absorption"],
                through_clip=cle["through_clip"],
            )
    float_tensors = {
        name for name, (elem, _) in tensor_types(model).items() if elem == onnx.TensorProto.FLOAT
    }
    layout = plan_layout(
        model, recipe.quantization, float_tensors, recipe.calibration.method, str(recipe.path)
    )
    if not layout.quantized_nodes():
        raise ModelError(
            f"{recipe.path}: no node can be quantized with quantization.op_types "
            f"{list(recipe.quantization.op_types)} and the exclude list"
        )
    if external_data.needs_external_data(model):
        # Over protobuf's limit: staged as external data beside model.fp32.onnx (hashed while it
        # is written), and read back from there for the same reason the small path re-parses.
        with phase("writing the float model (external data)"):
            staged = external_data.stage_model(model, recipe.float_model_path)
            del model
            model = staged.load()
        return PreparedModel(model, None, staged.sha256, layout, source, staged, equalization)
    serialized = model.SerializeToString()
    fingerprint = hashlib.sha256(serialized).hexdigest()
    # Re-parsed from its bytes: the proto that preparation built holds on to the memory of every
    # intermediate copy (on the benchmark encoder 512 MB before calibration, 257 MB after this).
    model = onnx.load_from_string(serialized)
    return PreparedModel(model, serialized, fingerprint, layout, source, equalization=equalization)


@dataclass
class Calibration:
    """Statistics (and GPTQ Hessians) of one calibration run and the files it produces, not yet
    written: calibrate commits them alone, quantize together with its own outputs."""

    stats: list[TensorStats]
    hessians: dict[str, HessianAccumulator]
    files: dict[Path, bytes | Staged]
    data_sha256: str | None
    primary: bool = True  # rank 0 (or the only process): the one that writes the files
    # SmoothQuant's per-channel statistics from this run (None: read from channels.npz)
    channels: dict[str, ChannelStats] | None = None


def run_calibration(
    recipe: Recipe,
    prepared: PreparedModel,
    progress: bool,
    shard: Shard | None = None,
    group: Group | None = None,
    reload: bool = True,
    release: bool = False,
) -> Calibration:
    """Calibrate on `shard` of the batches (all of them by default), split further across the
    ranks of `group` and merged exactly (calibration/merge.py) before anything is written.
    `reload`: whether a staged model's weights are read back afterwards (quantize needs them).
    `release`: let go of the float model while ORT runs (PreparedModel.release), for callers
    that discard the prepared model's staged files when they fail."""
    spec = recipe.calibration
    shard, group = shard or Shard(), group or Group()
    part = shard.part(group.rank, group.world)
    tensors = prepared.layout.stats_tensors()
    hessian_tensors = prepared.layout.hessian_tensors()
    observers = channel_observers(recipe, prepared.model, prepared.layout)
    stats: list[TensorStats] = []
    hessians: dict[str, HessianAccumulator] = {}
    if observers and not part.whole:
        # min/max per channel would merge exactly, but the row sample SmoothQuant searches alpha
        # on is chosen by each row's position in the whole stream, which no shard knows.
        raise CalibrationError(
            f"{recipe.path}: quantization.algorithms.smoothquant needs one calibration process "
            f"over all batches (got shard {part}{group.describe()}): its sampled rows cannot be "
            "merged across shards exactly; calibrate without --shard/torchrun"
        )
    digest = None
    if tensors or hessian_tensors or observers:  # weight-only round-to-nearest needs no data
        digest = DataDigest()
        batches = iter_batches(
            spec.data, recipe.inputs, spec.batch_size, spec.max_samples, recipe.seed
        )
        model_dir = None

        def source() -> onnx.ModelProto | None:
            return prepared.model

        if prepared.staged is not None:
            # ORT reads the weights from the staged float model: Python lets go of its copy
            # meanwhile (a model's worth of memory) and reads it back afterwards.
            model_dir = prepared.staged.session_path.parent
            prepared.model = None
            source = prepared.staged.structure
        elif release and group.primary:
            source = functools.partial(prepared.release, recipe.float_model_path)
        # called in the argument list: collect holds the only reference to a released model and
        # drops it once the session has read the model
        stats, hessians = collect(
            source(),
            tensors,
            digest.tap(part.select(batches, f"{recipe.path}: calibration{group.describe()}")),
            bins=spec.bins,
            hessian_tensors=hessian_tensors,
            device=kernels.default_device(),
            total_samples=part.samples(
                count_samples_hint(spec.data, spec.max_samples), spec.batch_size
            ),
            progress=progress and group.primary,
            model_dir=model_dir,
            channel_observers=observers,
            # after source(): a released model's bytes are in the staged float file by now
            serialized=None if prepared.float_file is None else prepared.float_file.path,
        )
        if prepared.staged is not None and reload:
            prepared.model = prepared.staged.load()
        elif prepared.staged is None:  # callers after calibrate read both (analyze: the bytes)
            prepared.restore()
        stats, hessians, digest = merge_across_processes(
            group, prepared.fingerprint, spec.bins, stats, hessians, digest
        )
    record = ShardRecord(
        shard.count, (shard.index,), spec.batch_size, spec.max_samples, recipe.seed
    )
    stats_bytes = stats_file_bytes(
        stats, prepared.fingerprint, spec.bins, data_digest=digest, shard=record
    )
    data_sha256 = None if digest is None else digest.hexdigest()
    files = {recipe.stats_path: stats_bytes, **prepared.float_files(recipe.float_model_path)}
    if hessian_tensors and group.primary:
        files[recipe.hessians_path] = hessian_file_bytes(
            hessians, prepared.fingerprint, data_sha256
        )
    channels = {observer.name: observer.result() for observer in observers}
    if observers:
        files[channels_path(recipe.stats_path)] = channel_file_bytes(
            channels, prepared.fingerprint, data_sha256
        )
    return Calibration(
        stats, hessians, files, data_sha256, group.primary, channels if observers else None
    )


def calibrate(
    recipe: Recipe, prepared: PreparedModel, progress: bool = True, shard: Shard | None = None
) -> list[TensorStats]:
    """Stream the calibration set (or `shard` of it) through the model, across the processes
    torchrun started when it did; write (rank 0) and return the statistics."""
    try:
        run = run_calibration(
            recipe, prepared, progress, shard, distributed.current(), reload=False, release=True
        )
        if run.primary:
            commit_files(run.files)
            prepared.float_file = None  # renamed into place: a later run stages its own
    finally:
        prepared.discard()  # staged files: renamed into place by the commit, or removed here
    return run.stats


def _hessians_for(prepared: PreparedModel, stats_path: Path) -> dict[str, HessianAccumulator]:
    """The GPTQ Hessians the calibration run wrote beside `stats_path`, when the plan needs any."""
    needed = prepared.layout.hessian_tensors()
    if not needed:
        return {}
    path = stats_path.parent / "hessians.npz"
    if not path.is_file():
        raise CalibrationError(
            f"{path}: not found; weights with method gptq need the Hessians that `qtool "
            "calibrate` writes with this recipe (re-run it)"
        )
    hessians = load_hessians(path, prepared.fingerprint)
    missing = [name for name in needed if name not in hessians]
    if missing:
        raise CalibrationError(
            f"{path}: has no Hessian for layer input '{missing[0]}' ({len(missing)} missing; "
            "re-run `qtool calibrate` with this recipe)"
        )
    return hessians


def statistics(
    recipe: Recipe,
    prepared: PreparedModel,
    stats_path: Path | None,
    progress: bool,
    group: Group | None = None,
) -> tuple[Calibration, Path]:
    """This run's statistics: from a new calibration run (its files not written yet; split
    across the ranks of `group` and merged exactly), or read from `stats_path` (no files to
    write; every rank reads the same file)."""
    if stats_path is None:
        calibration = run_calibration(recipe, prepared, progress, group=group, release=True)
        return calibration, recipe.stats_path
    stats, fingerprint = load_stats(stats_path)
    if fingerprint != prepared.fingerprint:
        raise CalibrationError(
            f"{stats_path}: collected on a different model than {recipe.path} describes "
            "(re-run `qtool calibrate`)"
        )
    hessians = _hessians_for(prepared, stats_path)
    run = Calibration(list(stats.values()), hessians, {}, stats_data_sha256(stats_path))
    return run, stats_path


def quantize(
    recipe: Recipe, stats_path: Path | None = None, progress: bool = True, auto: bool = False
) -> QuantizeResult:
    """Ranges from statistics (calibrating first when no stats file is given) -> QDQ model.

    `auto` (or a `mixed_precision:` section) runs the mixed-precision stage first: it chooses
    every node's precision and hands on the recipe with that plan as overrides."""
    distributed.require_single_process("qtool quantize")
    prepared = prepare(recipe)
    try:
        mixed = None
        if auto or recipe.mixed_precision is not None:
            from qtool.search.mixed import search_stage  # it imports this module's stages

            recipe, prepared, stats_path, mixed = search_stage(
                recipe, prepared, stats_path, progress
            )
        return _quantize(recipe, prepared, stats_path, progress, mixed)
    finally:
        prepared.discard()  # staged files: renamed into place by the commit, or removed here


def _quantize(
    recipe: Recipe,
    prepared: PreparedModel,
    stats_path: Path | None,
    progress: bool,
    mixed: MixedOutcome | None = None,
) -> QuantizeResult:
    model_path = recipe.quant_model_path if mixed is None else mixed.model_path
    calibration, stats_path = statistics(recipe, prepared, stats_path, progress)
    # SmoothQuant: the smoothed model and layout, stats for its smoothed inputs (report entry)
    smoothing = None
    if recipe.quantization.algorithm("smoothquant") is not None:
        with phase("SmoothQuant"):  # alpha search per layer input, then the smoothed model
            prepared, calibration, smoothing = apply_smoothquant(
                recipe, prepared, calibration, stats_path
            )
    stats = {s.name: s for s in calibration.stats}
    layout, model = prepared.layout, prepared.model
    device = kernels.default_device()
    cpu = resolve_cpu(recipe.quantization.cpu)
    symmetric = recipe.quantization.symmetric_activations
    activations = activation_parameters(layout, stats, recipe.calibration, symmetric, device)
    weights = weight_parameters(
        model, layout, recipe.quantization, cpu, device, calibration.hessians
    )
    target = recipe.quantization.target
    nbits, nbits_reason = nbits_level(recipe.quantization, cpu)

    def write(float_model: onnx.ModelProto, chosen: dict) -> onnx.ModelProto:
        """`float_model` as QDQ with the weights `chosen` and the int32 biases they imply: the
        candidates AdaRound and bias correction compare (one of them changes the weights, the
        other the float biases)."""
        chosen_biases = bias_parameters(float_model, layout, activations, chosen)
        return write_qdq_model(
            float_model, layout, activations, chosen, chosen_biases, target, nbits
        )

    rounding = None
    adaround = recipe.quantization.algorithm("adaround")
    if adaround is not None:  # before the biases and bias correction: they see its weights
        # imported here: it needs torch, which ONNX-only runs never load
        from qtool.algorithms.adaround_apply import BATCH as ADAROUND_BATCH
        from qtool.algorithms.adaround_apply import apply_adaround

        weights, rounding = apply_adaround(
            model,
            layout,
            activations,
            weights,
            cpu,
            recipe.quantization.saturation,
            lambda: _calibration_inputs(recipe, adaround["samples"], ADAROUND_BATCH),
            adaround,
            recipe.seed,
            progress,
            f"{recipe.path}: quantization.algorithms.adaround",
            functools.partial(write, model),
        )
    biases = bias_parameters(model, layout, activations, weights)
    correction = recipe.quantization.algorithm("bias_correction")
    if prepared.staged is not None and correction is None and smoothing is None:
        # The float weights being replaced are read no more (the writer drops them): read back
        # only the rest from the staged file, so the float model is not held while writing.
        # (Not after SmoothQuant: the staged file holds the unsmoothed model.)
        prepared.model = model = None  # dropped before the read: never held twice
        prepared.model = model = prepared.staged.load(skip=set(weights) | set(biases))

    # checked once, on the bytes that are written (onnx.checker would serialize it again)
    quantized = write_qdq_model(
        model, layout, activations, weights, biases, target, nbits, check=False
    )
    algorithms = {}
    if prepared.equalization is not None:
        algorithms["cross_layer_equalization"] = prepared.equalization
    if smoothing is not None:
        algorithms["smoothquant"] = smoothing
    if rounding is not None:
        algorithms["adaround"] = rounding
    if correction is not None:
        with phase("bias correction"):
            quantized, algorithms["bias_correction"] = apply_bias_correction(
                model,
                quantized,
                layout.quantized_nodes(),
                lambda float_model: write(float_model, weights),
                lambda: _calibration_inputs(recipe, correction["samples"]),
            )
    node_inputs = {node.name: list(node.input) for node in model.graph.node}
    if prepared.staged is not None:  # its float weights are on disk, staged: no longer needed
        prepared.model = model = None
    stamp_provenance(quantized, recipe, prepared, calibration)
    staged = None
    try:
        source: bytes | Path
        # External data when the float model has it too: ORT sessions then map the weights
        # from the file instead of each copying the serialized model.
        if prepared.staged is not None or external_data.needs_external_data(quantized):
            with phase("writing the quantized model (external data)"):
                external_data.check_model(quantized)
                staged = external_data.stage_model(quantized, model_path)
            del quantized
            source, quant_files = staged.session_path, staged.files()
        else:
            source = quantized.SerializeToString()
            external_data.check_model(quantized, source)
            quant_files = {model_path: source}
        try:  # the session verify runs: a model ORT cannot load fails here, named
            loaded = optimized_session(source, VERIFY_THREADS)
        except QtoolError as exc:
            message = str(exc)
            if isinstance(source, Path):  # name the output, not its temporary file
                message = message.replace(str(source), str(model_path))
            raise ModelError(
                f"the quantized model does not load in ONNX Runtime: {message}"
            ) from None
        float_source = prepared.serialized
        if prepared.staged is not None:
            float_source = prepared.staged.session_path
        with phase("verifying what ONNX Runtime runs"):
            verification = verify(
                source,
                layout.plan,
                verify_feeds(recipe),
                cpu,
                VERIFY_THREADS,
                target=recipe.quantization.target,
                float_model=float_source,
                loaded=loaded,
            )
            del loaded
        files = {
            "float_model": str(recipe.float_model_path),
            "quantized_model": str(model_path),
            "stats": str(stats_path),
        }
        if staged is not None:  # ship both files: the .onnx alone has no weights
            files["quantized_model_data"] = str(staged.data_path)
        if prepared.staged is not None:
            files["float_model_data"] = str(prepared.staged.data_path)
        report = build_report(
            recipe, node_inputs, layout, activations, weights, files, cpu, verification.summary
        )
        report["algorithms"] = algorithms
        report["int4_matmul"] = {
            "format": recipe.quantization.resolved_int4_format,
            "accuracy_level": nbits,
            "why": nbits_reason,
        }
        if mixed is not None:
            report["mixed_precision"] = mixed.block
        commit_files(
            {
                **calibration.files,
                **quant_files,
                **prepared.float_files(recipe.float_model_path),
                recipe.report_path: report_bytes(report),
                **(mixed.files if mixed is not None else {}),
            }
        )
    finally:
        if staged is not None:
            staged.discard()
    warnings = list(verification.warnings)
    if prepared.equalization is not None and "warning" in prepared.equalization:
        warnings.append(prepared.equalization["warning"])
    return QuantizeResult(model_path, recipe.report_path, report, warnings)


def stamp_provenance(
    quantized: onnx.ModelProto, recipe: Recipe, prepared: PreparedModel, calibration: Calibration
) -> None:
    """Record in `quantized` what it was made from, so `evaluate` can refuse a foreign FP32."""
    provenance.stamp(
        quantized,
        {
            provenance.VERSION: __version__,
            provenance.FLOAT_MODEL_SHA256: prepared.fingerprint,
            provenance.SOURCE_MODEL_SHA256: prepared.source_sha256,
            provenance.RECIPE_SHA256: provenance.sha256_file(recipe.path),
            provenance.CALIBRATION_DATA_SHA256: calibration.data_sha256 or "none",
        },
    )


def _calibration_inputs(
    recipe: Recipe, samples: int, batch_size: int | None = None
) -> Iterator[dict]:
    """The first `samples` calibration inputs, read afresh (for a pass after calibration), in
    the recipe's batch size or `batch_size`."""
    spec = recipe.calibration
    limit = min(samples, spec.max_samples or samples)
    size = batch_size or spec.batch_size
    batches = iter_batches(spec.data, recipe.inputs, size, limit, recipe.seed)
    return (batch.inputs for batch in batches)


def verify_feeds(recipe: Recipe) -> list[dict]:
    """The first calibration samples, re-read (a stats file carries no inputs)."""
    spec = recipe.calibration
    limit = min(VERIFY_SAMPLES, spec.max_samples or VERIFY_SAMPLES)
    batch = min(spec.batch_size, limit)
    return [b.inputs for b in iter_batches(spec.data, recipe.inputs, batch, limit, recipe.seed)]
