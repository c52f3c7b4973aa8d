"""Which models ONNX Runtime's CPU provider can run only unfused: those with float8 Q/DQ.

ORT's graph optimizations (ORT_ENABLE_ALL, and EXTENDED) fail to load a float8 QDQ model on the
CPU: the QDQ fusion turns DQ(float8) -> MatMul into MatMulIntegerToFloat, which takes no float8
input (INVALID_GRAPH), and QDQ propagation moves float8 tensors into ops with no float8 kernel
(a Flatten after an FP8 Conv). With ORT_DISABLE_ALL every DequantizeLinear, float op and
QuantizeLinear runs as written, which is the file's meaning (measured on ORT 1.31). FP8 files
are for TensorRT; on the CPU qtool runs them unfused, and says so wherever it would otherwise
show a fused number.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

FLOAT8_TYPES = frozenset(
    {
        TensorProto.FLOAT8E4M3FN,
        TensorProto.FLOAT8E4M3FNUZ,
        TensorProto.FLOAT8E5M2,
        TensorProto.FLOAT8E5M2FNUZ,
    }
)

UNFUSED_ONLY = (
    "the model has float8 Q/DQ, which ONNX Runtime's CPU provider runs only unfused "
    "(ORT_DISABLE_ALL: its QDQ fusion builds MatMulIntegerToFloat on float8, and its QDQ "
    "propagation moves float8 into ops without float8 kernels); there is no fused CPU variant, "
    "and the unfused run is what qtool measures"
)


def unfused_only_reason(model: onnx.ModelProto) -> str | None:
    """Why `model` can run on ORT's CPU provider only unfused, or None (structure only: the
    initializers' types, never their data)."""
    if any(init.data_type in FLOAT8_TYPES for init in model.graph.initializer):
        return UNFUSED_ONLY
    return None
