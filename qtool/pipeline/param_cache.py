"""Quantization parameters computed once per float model and statistics, reused across the
many variants of one plan that the sensitivity analysis and the mixed-precision search build.

A weight's stored form depends on its slot, its WeightPlan fields and the activations of the
nodes that read it, nothing else; an activation's range only on its statistics tensor. So a
variant that plans a node as before reuses its parameters bit for bit, and the build stage is
the same function with or without this cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import onnx

from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.observers import TensorStats
from qtool.calibration.spec import CalibrationSpec
from qtool.ort.cpu import CpuFeatures
from qtool.plan.layout import Layout
from qtool.plan.settings import QuantizationSpec
from qtool.write.assemble import activation_parameters, weight_parameters
from qtool.write.int4 import BlockwiseWeight
from qtool.write.params import ActivationParams, WeightParams


class ParamCache:
    def __init__(self) -> None:
        # by (stats tensor, pair type): an int8 and an fp8 pair on one tensor differ
        self._activations: dict[tuple[str, str], ActivationParams] = {}
        # (tensor, slot, plan fields, activations of its nodes) -> (params, plan fields after)
        self._weights: dict[tuple, tuple[WeightParams | BlockwiseWeight, dict]] = {}
        self.weight_hits = 0

    @property
    def empty(self) -> bool:
        return not self._activations and not self._weights

    def activations(
        self,
        layout: Layout,
        stats: Mapping[str, TensorStats],
        calibration: CalibrationSpec,
        symmetric: bool,
        device: str,
    ) -> dict[str, ActivationParams]:
        todo = {
            key: slot
            for key, slot in layout.activations.items()
            if (slot.stats_tensor, slot.dtype) not in self._activations
        }
        if todo:
            computed = activation_parameters(
                Layout(activations=todo), dict(stats), calibration, symmetric, device
            )
            for key, params in computed.items():
                self._activations[(todo[key].stats_tensor, todo[key].dtype)] = params
        return {
            key: self._activations[(slot.stats_tensor, slot.dtype)]
            for key, slot in layout.activations.items()
        }

    def weights(
        self,
        model: onnx.ModelProto,
        layout: Layout,
        spec: QuantizationSpec,
        cpu: CpuFeatures,
        device: str,
        hessians: Mapping[str, HessianAccumulator],
    ) -> dict[str, WeightParams | BlockwiseWeight]:
        plans = layout.plan.weight_plans()
        keys = {name: _weight_key(layout, name) for name in layout.weights}
        todo = {
            name: slot for name, slot in layout.weights.items() if keys[name] not in self._weights
        }
        self.weight_hits += len(layout.weights) - len(todo)
        if todo:
            # The build stage's own function, run on the weights not seen before; it records
            # the format it chose in each WeightPlan, which the cache keeps for later variants.
            partial = Layout(
                plan=layout.plan,
                weights=todo,
                gptq_inputs=layout.gptq_inputs,
                weight_inputs=layout.weight_inputs,
            )
            computed = weight_parameters(model, partial, spec, cpu, device, dict(hessians))
            for name, params in computed.items():
                self._weights[keys[name]] = (params, dataclasses.asdict(plans[name]))
        result = {}
        for name in layout.weights:
            params, recorded = self._weights[keys[name]]
            for field, value in recorded.items():
                setattr(plans[name], field, value)
            result[name] = params
        return result


def _weight_key(layout: Layout, name: str) -> tuple:
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
