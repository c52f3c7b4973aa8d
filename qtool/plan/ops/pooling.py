"""Average pooling (GlobalAveragePool, AveragePool): input and output quantized.

Averaging creates new values, so unlike MaxPool (passthrough.py) the output needs its own range;
ORT fuses DQ -> pool -> Q into QLinearGlobalAveragePool / QLinearAveragePool (com.microsoft).
"""

from __future__ import annotations

from qtool.plan.ops.forms import activation_entries
from qtool.plan.ops.registry import OpRule, OrtFusion


def _pool(op_type: str) -> OpRule:
    kernels = (f"QLinear{op_type}",)
    return OpRule(
        op_type=op_type,
        family="pooling",
        quantizable=True,
        output_quantized=True,
        ort=OrtFusion(kernels=kernels),
        entries=activation_entries(op_type, kernels),
    )


GLOBAL_AVERAGE_POOL = _pool("GlobalAveragePool")
AVERAGE_POOL = _pool("AveragePool")

RULES = (GLOBAL_AVERAGE_POOL, AVERAGE_POOL)
