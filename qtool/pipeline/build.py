"""The build stage: from the float model, its plan and its statistics to the quantized model.

The order, fixed and documented (docs/architecture.md): SmoothQuant (a float-model transform
that needs the calibration pass's per-channel statistics, so it runs after calibration and
re-plans the smoothed graph) -> AWQ (the same for weight-only layers, from the calibration
Hessians) -> activation ranges -> weights in the deployment CPU's format (with GPTQ, MSE or
scale estimation where the plan and the algorithms ask) -> AdaRound (learns each int8 weight's
rounding on the ranges above) -> int32 biases -> write the QDQ model -> bias correction
(measures each layer's mean output shift of the model as written). Cross-layer equalization is
the one algorithm before calibration (app/, pipeline.float_model): it changes the float model
whose ranges calibration measures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import numpy as np
import onnx

from qtool import kernels
from qtool.algorithms.awq import apply_awq
from qtool.algorithms.bias_correction import apply_bias_correction
from qtool.algorithms.int8_fallback import apply_fallback
from qtool.algorithms.smoothquant import apply_smoothquant
from qtool.algorithms.spec import Algorithms, GptqParams
from qtool.calibration.channels import channels_path, load_channels
from qtool.calibration.spec import CalibrationSpec
from qtool.data.source import BatchSource
from qtool.errors import CalibrationError
from qtool.model.scratch_weights import ScratchWeights
from qtool.ort.cpu import CpuFeatures, resolve_cpu
from qtool.phases import phase
from qtool.pipeline import planning
from qtool.pipeline.float_model import FloatModel
from qtool.pipeline.param_cache import ParamCache
from qtool.pipeline.statistics import Statistics
from qtool.pipeline.tuning import TuningScore
from qtool.plan.layout import Layout
from qtool.plan.settings import Override, QuantizationSpec, with_overrides
from qtool.write.assemble import activation_parameters, bias_parameters, weight_parameters
from qtool.write.float_type import type_model
from qtool.write.low_bit import LowBitOptions
from qtool.write.matmul_nbits import nbits_level
from qtool.write.params import ActivationParams
from qtool.write.qdq import write_qdq_model
from qtool.write.scale_estimation import ScaleSearch
from qtool.write.typed_plan import (
    largest_magnitudes,
    needs_typing,
    record_typing,
    requested_types,
)


@dataclass(frozen=True)
class BuildSettings:
    """What the build stage reads of the user's settings: the plan's settings (target, CPU,
    saturation, algorithms), how ranges are derived, the calibration samples the algorithms take
    a second look at (`data`, the rows they fit on) and the tuning rows their choices are scored
    on (`tuning`; qtool/pipeline/tuning.py). `compare_minmax` and `score`: the model-level rule
    (qtool/pipeline/keep.py)."""

    quantization: QuantizationSpec
    calibration: CalibrationSpec
    data: BatchSource
    seed: int
    where: str  # the settings' source (the recipe file), for errors
    algorithms: Algorithms = field(default_factory=Algorithms)
    tuning: BatchSource | None = None
    compare_minmax: bool = False
    score: TuningScore = field(default_factory=TuningScore)

    def cpu(self) -> CpuFeatures:
        return resolve_cpu(self.quantization.cpu)

    def replan(self, model: onnx.ModelProto, extra: Sequence[Override] = ()) -> Layout:
        """The plan stage on `model`, with `extra` overrides after the recipe's (they win)."""
        spec = with_overrides(self.quantization, extra)
        return planning.plan(model, spec, self.calibration.method, self.where)


@dataclass
class Built:
    """The quantized model and everything the report says about how it was made."""

    model: onnx.ModelProto
    layout: Layout
    activations: dict[str, ActivationParams]
    weights: dict
    node_inputs: dict[str, list[str]]
    cpu: CpuFeatures
    nbits: int | None
    nbits_reason: str
    algorithms: dict = field(default_factory=dict)
    # The typing pass's summary (write/float_type.py), when the model has a low float type.
    float_type: dict | None = None
    # The model-level comparison with plain min-max (qtool/pipeline/keep.py), when it ran
    choice: dict | None = None
    # The file that float weights an algorithm rewrote are read from (AWQ on a lazy model):
    # `model` may keep some as lazy weights, whose bytes are copied when it is staged.
    scratch: ScratchWeights | None = None

    def drop_weight_values(self) -> None:
        """Let go of the quantized weights' integers once the model holds them: the report reads
        only their dtype and shape, and on a decoder they are a quarter of its float size, held
        through verification's two sessions. Each becomes a zero-strided view of its shape (new
        objects: a ParamCache that shares the old ones keeps them whole)."""
        self.weights = {
            name: replace(
                weight, values=np.broadcast_to(weight.values.dtype.type(0), weight.values.shape)
            )
            for name, weight in self.weights.items()
        }


def build_quantized(
    float_model: FloatModel,
    layout: Layout,
    statistics: Statistics,
    settings: BuildSettings,
    progress: bool,
    cache: ParamCache | None = None,
    cpu: CpuFeatures | None = None,
) -> Built:
    """The quantized model of `layout`, the algorithms of `settings` applied in the documented
    order. Deterministic: the same inputs give the same bytes, so a plan verified by the
    mixed-precision search and the model written for it are one and the same.

    `cache`: parameters of earlier builds of the same float model and statistics (the variants
    of one plan); only without algorithms, which change the float model or the weights."""
    spec = settings.quantization
    stats = statistics.by_name()
    hessians = statistics.hessians
    if float_model.lazy and _reads_whole_model(settings, layout):
        float_model.materialize()
    model = float_model.model
    algorithms: dict = {}
    smoothquant = settings.algorithms.smoothquant
    if smoothquant is not None:
        with phase("SmoothQuant"):  # alpha scored per layer input on tuning rows, then smoothed
            channels, source = _channels(statistics, float_model)
            smoothed = apply_smoothquant(
                model,
                layout,
                smoothquant,
                channels,
                stats,
                hessians,
                spec.symmetric_activations,
                settings.replan,
                source,
                tuning_inputs(settings, "smoothquant"),
            )
        model, layout = smoothed.model, smoothed.layout
        stats, hessians = smoothed.stats, smoothed.hessians
        algorithms["smoothquant"] = smoothed.entry
    scratch = None
    awq = settings.algorithms.awq
    if awq is not None:
        with phase("AWQ"):  # alpha search per weight-only layer input, then the scaled model
            scaled = apply_awq(model, layout, awq, hessians, settings.replan)
        model, layout, hessians = scaled.model, scaled.layout, scaled.hessians
        scratch = scaled.scratch
        algorithms["awq"] = scaled.entry
    fallback = settings.algorithms.int8_fallback
    if fallback is not None:
        with phase("INT8 fallback"):  # which 4-bit layers keep 8 bits, ranked on the Hessians
            fell = apply_fallback(
                model, layout, fallback, hessians, lambda extra: settings.replan(model, extra)
            )
        layout = fell.layout
        algorithms["int8_fallback"] = fell.entry
    device = kernels.default_device()
    cpu = cpu if cpu is not None else settings.cpu()
    symmetric = spec.symmetric_activations
    if cache is None:
        activations = activation_parameters(layout, stats, settings.calibration, symmetric, device)
        options = low_bit_options(settings.algorithms)
        if settings.algorithms.scale_estimation is not None:
            algorithms["scale_estimation"] = dataclasses.asdict(
                settings.algorithms.scale_estimation
            )
        if settings.algorithms.gptq is not None:
            algorithms["gptq"] = dataclasses.asdict(settings.algorithms.gptq)
        # GPTQ and scale estimation take minutes on an LLM: a phase line says where the time went
        slow = options.scale_search is not None or bool(layout.gptq_inputs)
        with phase("quantizing weights against the Hessians") if slow else nullcontext():
            weights = weight_parameters(model, layout, spec, cpu, device, hessians, options)
    else:
        if settings.algorithms:
            raise ValueError("cached parameters are for builds without algorithms")
        activations = cache.activations(layout, stats, settings.calibration, symmetric, device)
        weights = cache.weights(model, layout, spec, cpu, device, hessians)
    nbits, nbits_reason = nbits_level(spec, cpu)

    def write(float_graph: onnx.ModelProto, chosen: dict) -> onnx.ModelProto:
        """`float_graph` as QDQ with the weights `chosen` and the int32 biases they imply: the
        candidates AdaRound and bias correction compare (one of them changes the weights, the
        other the float biases)."""
        chosen_biases = bias_parameters(float_graph, layout, activations, chosen)
        return write_qdq_model(
            float_graph, layout, activations, chosen, chosen_biases, spec.target, nbits
        )

    adaround = settings.algorithms.adaround
    if adaround is not None:  # before the biases and bias correction: they see its weights
        # imported here: it needs torch, which ONNX-only runs never load
        from qtool.algorithms.adaround_apply import BATCH as ADAROUND_BATCH
        from qtool.algorithms.adaround_apply import apply_adaround

        weights, algorithms["adaround"] = apply_adaround(
            model,
            layout,
            activations,
            weights,
            cpu,
            spec.saturation,
            lambda: settings.data.first_inputs(adaround.samples, ADAROUND_BATCH),
            tuning_inputs(settings, "adaround", ADAROUND_BATCH),
            adaround,
            settings.seed,
            progress,
            f"{settings.where}: quantization.algorithms.adaround",
            lambda chosen: write(model, chosen),
        )
    biases = bias_parameters(model, layout, activations, weights)
    correction = settings.algorithms.bias_correction
    changed = smoothquant is not None or awq is not None  # the staged file is the unchanged model
    lazy = float_model.lazy  # the writer copies the lazy weights it keeps from the staged file
    if float_model.staged is not None and correction is None and not changed and not lazy:
        # The float weights being replaced are read no more (the writer drops them): read back
        # only the rest from the staged file, so the float model is not held while writing.
        # (Not after SmoothQuant or AWQ: the staged file holds the model they changed.)
        float_model.model = model = None  # dropped before the read: never held twice
        float_model.model = model = float_model.staged.load(skip=set(weights) | set(biases))

    # checked once, on the bytes that are written (onnx.checker would serialize it again)
    quantized = write_qdq_model(
        model, layout, activations, weights, biases, spec.target, nbits, check=False
    )
    if correction is not None:
        with phase("bias correction"):
            quantized, algorithms["bias_correction"] = apply_bias_correction(
                model,
                quantized,
                layout.quantized_nodes(),
                lambda float_graph: write(float_graph, weights),
                lambda: settings.data.first_inputs(correction.samples),
                tuning_inputs(settings, "bias_correction"),
            )
    node_inputs = {node.name: list(node.input) for node in model.graph.node}
    float_type = None
    asked, default = requested_types(layout.plan, spec.float_precision)
    if needs_typing(asked, default):  # last: every step above measured the FP32 QDQ model
        with phase(f"typing the float part ({spec.float_type})"):
            node_io = {n.name: (list(n.input), list(n.output)) for n in model.graph.node}
            typed = type_model(
                quantized,
                asked,
                default,
                node_io,
                largest_magnitudes(stats, layout.typed_tensors),
                keep_io=spec.float_io == "keep",
            )
        quantized = typed.model
        record_typing(layout.plan, typed)
        float_type = typed.summary(spec.float_type, spec.float_io)
    if float_model.staged is not None:  # its float weights are on disk, staged: no longer needed
        float_model.model = None
    return Built(
        quantized,
        layout,
        activations,
        weights,
        node_inputs,
        cpu,
        nbits,
        nbits_reason,
        algorithms,
        float_type,
        scratch=scratch,
    )


def tuning_inputs(
    settings: BuildSettings, who: str, batch_size: int | None = None
) -> Callable[[], Iterator[dict[str, np.ndarray]]]:
    """The tuning rows' inputs, read afresh per call: what `who` scores its choices on."""
    source = settings.tuning
    if source is None:
        raise CalibrationError(
            f"{settings.where}: quantization.algorithms.{who} scores its choices on tuning rows, "
            "and the build was given none"
        )
    return lambda: (batch.inputs for batch in source.batches(batch_size))


def low_bit_options(algorithms: Algorithms) -> LowBitOptions:
    """The Hessian weight methods' settings from the recipe's algorithms (GPTQ's defaults,
    no scale search, when they are not listed)."""
    gptq = algorithms.gptq if algorithms.gptq is not None else GptqParams()
    search = algorithms.scale_estimation
    return LowBitOptions(
        act_order=gptq.act_order,
        damp=gptq.damp,
        scale_search=None
        if search is None
        else ScaleSearch(search.steps, search.min_factor, search.refine),
    )


def _reads_whole_model(settings: BuildSettings, layout: Layout) -> bool:
    """Whether a step of the build reads or rewrites the float model beyond the weights it
    quantizes (a lazy model's weights are read in first): the algorithms, the float typing
    pass, and TensorRT's engine check (it builds from the model's bytes)."""
    spec = settings.quantization
    asked, default = requested_types(layout.plan, spec.float_precision)
    rewrites = set(settings.algorithms.names()) - _READ_WEIGHT_BY_WEIGHT
    return bool(rewrites) or needs_typing(asked, default) or spec.target == "tensorrt"


# Algorithms that read a lazy model's weights one at a time (external_data.tensor_array) and
# replace only those they change: the 4-bit LLM presets build from the staged file (AWQ's
# scaled weights are the only float weights held; the float model was read in whole before,
# and AWQ's copy of it on top: SmolLM2-135M 540 MB each).
_READ_WEIGHT_BY_WEIGHT = frozenset({"awq", "int8_fallback", "scale_estimation", "gptq"})


def _channels(statistics: Statistics, float_model: FloatModel) -> tuple[dict, str]:
    """SmoothQuant's per-channel statistics, from this run's pass or from channels.npz beside
    the stats file the run read; and that file's name, for errors."""
    if statistics.path is None:
        raise CalibrationError("SmoothQuant needs per-channel statistics and none were collected")
    path = channels_path(statistics.path)
    if statistics.channels is not None:
        return statistics.channels, str(path)
    return load_channels(path, float_model.fingerprint, statistics.data_sha256), str(path)
