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

from qtool import kernels
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.observers import TensorStats
from qtool.config.recipe import Recipe
from qtool.model.prepare import tensor_types
from qtool.ort.cpu import CpuFeatures, resolve_cpu
from qtool.plan.layout import Layout, plan_layout
from qtool.plan.settings import Override, QuantizationSpec, WeightSettings
from qtool.write.assemble import activation_parameters, bias_parameters, weight_parameters
from qtool.write.int4 import BlockwiseWeight
from qtool.write.matmul_nbits import nbits_level
from qtool.write.params import ActivationParams, WeightParams
from qtool.write.qdq import write_qdq_model

_GLOB_CHARS = "*?["
_BITS = {"int4": 4, "int8": 8}


def exact_pattern(name: str) -> str:
    """A `nodes:` pattern that matches the node called `name` and no other.

    Node names are matched as globs; a name holding glob characters gets each one bracketed
    (`a[*]b` matches only 'a*b'), any other name is its own pattern (read as an exact name).
    """
    if not any(c in name for c in _GLOB_CHARS):
        return name
    return "".join(f"[{c}]" if c in _GLOB_CHARS else c for c in name)


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


def with_overrides(spec: QuantizationSpec, extra: Iterable[Override]) -> QuantizationSpec:
    """`spec` with `extra` applied after its own overrides (so they win)."""
    return dataclasses.replace(spec, overrides=tuple(spec.overrides) + tuple(extra))


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
    return union


class Assembler:
    """Builds QDQ models of plan variants from one prepared model, its statistics and Hessians.

    `stats` and `hessians` may lack what some variant needs (a stats file collected for a
    weight-only plan has no activation ranges): `missing` says what, before `build` is called.
    """

    def __init__(
        self,
        recipe: Recipe,
        model: onnx.ModelProto,
        stats: Mapping[str, TensorStats],
        hessians: Mapping[str, HessianAccumulator] | None = None,
        cpu: CpuFeatures | None = None,
        device: str | None = None,
    ) -> None:
        self.recipe = recipe
        self.model = model
        self.stats = dict(stats)
        self.hessians = dict(hessians or {})
        self.cpu = cpu if cpu is not None else resolve_cpu(recipe.quantization.cpu)
        self.device = device if device is not None else kernels.default_device()
        self.float_tensors = {
            name
            for name, (elem, _) in tensor_types(model).items()
            if elem == onnx.TensorProto.FLOAT
        }
        self._activations: dict[str, ActivationParams] = {}  # by stats tensor
        # (tensor, slot, plan fields, activations of its nodes) -> (params, plan fields after)
        self._weights: dict[tuple, tuple[WeightParams | BlockwiseWeight, dict]] = {}
        self.weight_cache_hits = 0

    def use_statistics(
        self, stats: Mapping[str, TensorStats], hessians: Mapping[str, HessianAccumulator]
    ) -> None:
        """Statistics for the builds to come (before any build: the caches depend on them)."""
        if self._activations or self._weights:
            raise RuntimeError("statistics must be set before the first build")
        self.stats, self.hessians = dict(stats), dict(hessians)

    def layout(self, extra: Sequence[Override] = ()) -> Layout:
        """The plan and QDQ slots of the recipe with `extra` overrides appended."""
        spec = with_overrides(self.recipe.quantization, extra)
        return plan_layout(
            self.model,
            spec,
            self.float_tensors,
            self.recipe.calibration.method,
            str(self.recipe.path),
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

    def build(self, layout: Layout) -> onnx.ModelProto:
        """The QDQ model of `layout` (the writer's checked output)."""
        activations = self._activation_params(layout)
        weights = self._weight_params(layout)
        biases = bias_parameters(self.model, layout, activations, weights)
        spec = self.recipe.quantization
        nbits, _ = nbits_level(spec, self.cpu)
        return write_qdq_model(self.model, layout, activations, weights, biases, spec.target, nbits)

    def _activation_params(self, layout: Layout) -> dict[str, ActivationParams]:
        todo = {
            tensor: slot
            for tensor, slot in layout.activations.items()
            if slot.stats_tensor not in self._activations
        }
        if todo:
            computed = activation_parameters(
                Layout(activations=todo),
                self.stats,
                self.recipe.calibration,
                self.recipe.quantization.symmetric_activations,
                self.device,
            )
            for tensor, params in computed.items():
                self._activations[todo[tensor].stats_tensor] = params
        return {
            tensor: self._activations[slot.stats_tensor]
            for tensor, slot in layout.activations.items()
        }

    def _weight_key(self, layout: Layout, name: str) -> tuple:
        plan = layout.plan.weight_plans()[name]
        users = tuple(
            sorted(
                node.activations
                for node in layout.plan
                if node.weight is not None and node.weight.tensor == name
            )
        )
        fields = tuple(sorted(dataclasses.asdict(plan).items()))
        return (name, layout.weights[name], fields, users)

    def _weight_params(self, layout: Layout) -> dict[str, WeightParams | BlockwiseWeight]:
        plans = layout.plan.weight_plans()
        keys = {name: self._weight_key(layout, name) for name in layout.weights}
        todo = {
            name: slot for name, slot in layout.weights.items() if keys[name] not in self._weights
        }
        self.weight_cache_hits += len(layout.weights) - len(todo)
        if todo:
            # The pipeline's own stage, run on the weights not seen before; it records the
            # format it chose in each WeightPlan, which the cache keeps for later variants.
            partial = Layout(plan=layout.plan, weights=todo, gptq_inputs=layout.gptq_inputs)
            computed = weight_parameters(
                self.model, partial, self.recipe.quantization, self.cpu, self.device, self.hessians
            )
            for name, params in computed.items():
                self._weights[keys[name]] = (params, dataclasses.asdict(plans[name]))
        result = {}
        for name in layout.weights:
            params, recorded = self._weights[keys[name]]
            for field, value in recorded.items():
                setattr(plans[name], field, value)
            result[name] = params
        return result
