"""Variants of the recipe's plan: the recipe's overrides plus a few more, assembled cheaply.

A variant is exactly what a user would get by appending `overrides:` entries to the recipe, so
whatever the analysis (or the mixed-precision search) measures can be written back as overrides
and reproduced by `qtool quantize`. Every variant is planned on the same prepared model (only
plan_layout runs again, milliseconds), takes its ranges from the same statistics, and shares
quantized weights with the others through a cache keyed by (tensor, slot, weight plan), so a
variant costs the QDQ writer and an ONNX Runtime session, not a quantization of every weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import onnx

from qtool.algorithms.spec import Algorithms
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.observers import TensorStats
from qtool.ort.cpu import CpuFeatures
from qtool.pipeline import planning
from qtool.pipeline.build import BuildSettings, Built, build_quantized
from qtool.pipeline.float_model import FloatModel
from qtool.pipeline.param_cache import ParamCache
from qtool.pipeline.statistics import Statistics
from qtool.plan.layout import Layout
from qtool.plan.settings import (
    Override,
    WeightSettings,
    exact_pattern,
    with_overrides,
)

_BITS = {"int4": 4, "int8": 8, "fp8": 8}


def pin(names: str | Sequence[str], precision: str, where: str) -> Override:
    """The override a recipe entry `{nodes: [names], precision: precision}` reads as."""
    names = [names] if isinstance(names, str) else list(names)
    bits = _BITS.get(precision)
    return Override(
        where=where,
        nodes=tuple(exact_pattern(n) for n in names),
        precision=precision,
        weights=WeightSettings(bits=bits),
    )


def union_layout(layouts: Iterable[Layout]) -> Layout:
    """A layout whose statistics and Hessian tensors cover every given layout's (for one
    calibration pass that serves all variants); its plan is the first layout's."""
    layouts = list(layouts)
    union = Layout(plan=layouts[0].plan)
    for layout in layouts:
        for tensor, slot in layout.activations.items():
            union.activations.setdefault(tensor, slot)
        for weight, tensor in layout.gptq_inputs.items():
            union.gptq_inputs.setdefault(weight, tensor)
        for weight, tensor in layout.weight_inputs.items():
            union.weight_inputs.setdefault(weight, tensor)
        union.typed_tensors.extend(t for t in layout.typed_tensors if t not in union.typed_tensors)
    return union


class Assembler:
    """Builds QDQ models of plan variants from one float model, its statistics and Hessians,
    through the build stage with a parameter cache (a variant that plans a node as before
    reuses its parameters).

    `stats` and `hessians` may lack what some variant needs (a stats file collected for a
    weight-only plan has no activation ranges): `missing` says what, before `build` is called.
    """

    def __init__(
        self,
        settings: BuildSettings,
        model: onnx.ModelProto,
        stats: Mapping[str, TensorStats],
        hessians: Mapping[str, HessianAccumulator] | None = None,
        cpu: CpuFeatures | None = None,
    ) -> None:
        self.settings = settings
        self.model = model
        self.stats = dict(stats)
        self.hessians = dict(hessians or {})
        self.cpu = cpu if cpu is not None else settings.cpu()
        self.float_tensors = planning.float_tensors(model)
        self.cache = ParamCache()

    @property
    def weight_cache_hits(self) -> int:
        return self.cache.weight_hits

    def use_statistics(
        self, stats: Mapping[str, TensorStats], hessians: Mapping[str, HessianAccumulator]
    ) -> None:
        """Statistics for the builds to come (before any build: the caches depend on them)."""
        if not self.cache.empty:
            raise RuntimeError("statistics must be set before the first build")
        self.stats, self.hessians = dict(stats), dict(hessians)

    def layout(self, extra: Sequence[Override] = ()) -> Layout:
        """The plan and QDQ slots of the settings with `extra` overrides appended."""
        spec = with_overrides(self.settings.quantization, extra)
        return planning.plan(
            self.model,
            spec,
            self.settings.calibration.method,
            self.settings.where,
            self.float_tensors,
            require_quantized=False,
        )

    def missing(self, layout: Layout) -> str | None:
        """Why `layout` cannot be built from these statistics (the first gap), or None."""
        for tensor in layout.stats_tensors():
            if tensor not in self.stats:
                return f"the stats file has no statistics for tensor '{tensor}'"
        for tensor in layout.hessian_tensors():
            if tensor not in self.hessians:
                return f"no GPTQ Hessian for layer input '{tensor}'"
        return None

    def built(self, layout: Layout) -> Built:
        """`layout` through the build stage, without the settings' algorithms (the analysis
        measures the plan itself; see search/mixed.py for builds with them)."""
        settings = dataclasses.replace(self.settings, algorithms=Algorithms())
        model = FloatModel(self.model, None, "", "")
        statistics = Statistics(list(self.stats.values()), self.hessians, {}, None)
        return build_quantized(model, layout, statistics, settings, False, self.cache, self.cpu)

    def build(self, layout: Layout) -> onnx.ModelProto:
        """The QDQ model of `layout`."""
        return self.built(layout).model
