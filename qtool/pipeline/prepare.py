"""The prepare stage: the user's model loaded, prepared, equalized when asked, frozen as the
float model every later stage reads, and planned.

Cross-layer equalization runs here, before calibration, because it changes the float model whose
ranges calibration measures (its rescaling is exact, so the float function is unchanged on the
data its own pass saw; through a Clip only there, see algorithms/cle.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qtool.algorithms.channel_ranges import channel_ranges
from qtool.algorithms.cle import equalize
from qtool.algorithms.spec import CleParams
from qtool.data.source import BatchSource
from qtool.model.memory import release_freed_memory
from qtool.model.spec import ModelSpec
from qtool.phases import phase
from qtool.pipeline import planning
from qtool.pipeline.float_model import FloatModel, freeze, load_prepared
from qtool.plan.layout import Layout
from qtool.plan.settings import QuantizationSpec


@dataclass
class Prepared:
    model: FloatModel
    layout: Layout
    # Cross-layer equalization's report entry, when the settings turn it on
    equalization: dict | None = None


def prepare(
    source: ModelSpec,
    quantization: QuantizationSpec,
    activation_method: str,
    data: BatchSource,
    float_path: Path,
    where: str,
    cle: CleParams | None = None,
    lazy_weights: bool = False,
) -> Prepared:
    """Load, export if needed, prepare, equalize (when asked), freeze and plan: nothing is
    written yet except the staging of a model over protobuf's limit.

    `lazy_weights`: a model staged as external data keeps its weights in the staged file
    (FloatModel.lazy), read one at a time by the stages that can (quantize without the search);
    else they are read back once the prepared proto is dropped."""
    min_opset = planning.min_opset(source.opset, quantization)
    model, source_sha, source_bytes = load_prepared(source, data.inputs, min_opset)
    equalization = _equalize(model, quantization, cle, data) if cle is not None else None
    frozen = freeze(model, float_path, source_sha, source_bytes)
    del model
    release_freed_memory()  # the prepared proto (a staged model's weights are in its file now)
    if not lazy_weights:
        frozen.materialize()
    try:
        layout = planning.plan(frozen.model, quantization, activation_method, where)
    except BaseException:
        frozen.discard()  # a model staged as external data leaves no temporary files
        raise
    return Prepared(frozen, layout, equalization)


def _equalize(model, quantization: QuantizationSpec, cle: CleParams, data: BatchSource) -> dict:
    with phase("cross-layer equalization"):  # before calibration: ranges of what is run
        # Pairs through Clip(0, 6) (when asked for) are bounded by per-channel maxima on
        # calibration data, bias absorption by the minima (one pass for both, unequalized).
        samples = cle.samples
        return equalize(
            model,
            quantization.per_channel,
            ranges=lambda tensors: channel_ranges(model, tensors, data.first_inputs(samples)),
            bias_absorption=cle.bias_absorption,
            through_clip=cle.through_clip,
        )
