"""How each planned weight is stored, as a function QAT's fake quantization calls on the
parameter it trains: the same functions the PTQ writer calls, so the trained model and the
exported one store every weight the same way."""

from __future__ import annotations

import numpy as np
import onnx
import torch

from qtool.errors import ModelError
from qtool.ort.cpu import CpuFeatures
from qtool.plan.layout import Layout
from qtool.qat.mapping import WeightTie
from qtool.write.assemble import integer_kernel_weights
from qtool.write.int4 import BlockwiseWeight
from qtool.write.low_bit import quantize_low_bit
from qtool.write.qdq import nbits_readers
from qtool.write.weight_format import choose_weight


def weight_stores(
    layout: Layout, saturation: str, cpu: CpuFeatures, device: str, ties: dict[str, WeightTie]
) -> dict:
    """Parameter name -> (its float value -> the writer's stored form, transposed?), per weight
    the same function weight_parameters calls. A transposed tie stores the parameter's
    transpose, the initializer's layout, and reads it back transposed."""
    integer = integer_kernel_weights(layout)
    plans = layout.plan.weight_plans()
    stores = {}
    for name, slot in layout.weights.items():
        plan, tie = plans[name], ties[name]
        if name in integer:

            def store(w, slot=slot, plan=plan, flip=tie.transposed):
                w = np.ascontiguousarray(w.T) if flip else w
                return choose_weight(w, slot, plan, cpu, saturation, device)
        else:

            def store(w, slot=slot, plan=plan, flip=tie.transposed):
                return quantize_low_bit(np.ascontiguousarray(w.T) if flip else w, slot, plan)

        stores[tie.parameter] = (store, slot.transposed != tie.transposed)
    return stores


# MatMulNBits' accuracy level that quantizes the kernel's float input to int8 (ORT 1.31)
INT8_COMPUTE_LEVEL = 4


def int8_compute_inputs(
    model: onnx.ModelProto,
    layout: Layout,
    stores: dict,
    ties: dict[str, WeightTie],
    net: torch.nn.Module,
    level: int | None,
) -> dict[str, int]:
    """Module path -> block size of every 4-bit weight the writer will emit as MatMulNBits with
    int8 compute: the module's input must be fake-quantized as the kernel quantizes it, or the
    deployed model is not the one that trained (measured: 1.07 output steps apart, digits-like
    rows model, AVX-512 VNNI). Level 1 (fp32 compute) and QDQ-format weights need nothing."""
    if level != INT8_COMPUTE_LEVEL:
        return {}
    plans = layout.plan.weight_plans()
    low_bit = {}
    for name, tie in ties.items():
        if plans[name].bits != 4:
            continue
        store, _ = stores[tie.parameter]
        stored = store(net.get_parameter(tie.parameter).detach().cpu().numpy())
        if isinstance(stored, BlockwiseWeight):
            low_bit[name] = stored
    transposed = {name for name, slot in layout.weights.items() if slot.transposed}
    inputs = {}
    for name, node in sorted(nbits_readers(model.graph, low_bit, transposed).items()):
        path = ties[name].parameter.rpartition(".")[0]
        if not isinstance(net.get_submodule(path), torch.nn.Linear):
            raise ModelError(
                f"node '{node}': its 4-bit weight is written as MatMulNBits with int8 compute, "
                f"which quantizes the node's input; qtool qat emulates that only for nn.Linear, "
                f"and '{path}' is {type(net.get_submodule(path)).__name__} (set "
                "quantization.accuracy_level: 1 for fp32 compute)"
            )
        inputs[path] = int(low_bit[name].block_size)
    return inputs
