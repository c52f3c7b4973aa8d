"""Where TensorRT's FP8 kernels gain nothing: weighted nodes an FP8 recipe leaves in the float type.

TensorRT runs an FP8 Q/DQ Conv or GEMM on its FP8 tensor-core kernels only where they beat its
FP16 ones; elsewhere FP8 costs accuracy (E4M3 keeps 3 mantissa bits) and buys no speed. NVIDIA's
own quantizer for TensorRT, ModelOpt (modelopt/onnx/quantization/graph_utils.py, 0.47:
`find_nodes_from_convs_to_exclude`, `find_nodes_from_matmul_to_exclude`), encodes the cases as
rules, and so does qtool, from the weight's shape alone (known before any data is read):

- Conv: 16 or fewer input channels per group or output channels (a depthwise Conv has 1 per
  group; the first Conv of an image model 1 or 3), or a filter of more than 32 elements (7x7);
- MatMul / Gemm with a constant weight: a reduction (K) or output (N) dimension under 16.

ModelOpt also leaves out GEMVs (an output row count of 1), which depends on the batch the engine
is built for, not on the file: qtool does not guess it. A MatMul between two activations
(attention) has no weight shape here and is always offered FP8, as ModelOpt offers it for the
sequence lengths qtool's examples calibrate with.
"""

from __future__ import annotations

import math

import onnx

from qtool.plan.graph import GraphIndex, int_attribute

# ModelOpt's _MIN_CHANNELS_FP8 (Conv: <= 16 excluded) and _MIN_MATMUL_DIM (GEMM: < 16 excluded).
MIN_CONV_CHANNELS = 16
MAX_CONV_FILTER = 32
MIN_GEMM_DIM = 16

_WHY = "TensorRT's FP8 kernels gain nothing over FP16 here ({what}; ModelOpt's rule): stays in "
_WHY += "the float type"


def _weight_dims(node: onnx.NodeProto, graph: GraphIndex) -> list[int] | None:
    name = node.input[1] if len(node.input) > 1 else ""
    init = graph.initializers.get(name)
    return None if init is None else list(init.dims)


def conv_declines_fp8(node: onnx.NodeProto, graph: GraphIndex) -> str | None:
    """Why TensorRT would not run this Conv on an FP8 kernel worth its error, or None."""
    dims = _weight_dims(node, graph)
    if dims is None or len(dims) < 3:
        return None  # no constant weight: the slot builder says why it stays float
    out_channels, in_channels = dims[0], dims[1]  # in_channels: per group, as stored
    if out_channels <= MIN_CONV_CHANNELS or in_channels <= MIN_CONV_CHANNELS:
        group = int_attribute(node, "group", 1)
        kind = "depthwise " if group > 1 and in_channels == 1 else ""
        what = f"{kind}Conv with C_in = {in_channels} per group, C_out = {out_channels}"
        return _WHY.format(what=f"{what}; one <= {MIN_CONV_CHANNELS}")
    size = math.prod(dims[2:])
    if size > MAX_CONV_FILTER:
        kernel = "x".join(str(d) for d in dims[2:])
        return _WHY.format(what=f"Conv filter {kernel} = {size} elements, > {MAX_CONV_FILTER}")
    return None


def gemm_declines_fp8(node: onnx.NodeProto, graph: GraphIndex) -> str | None:
    """Why TensorRT would not run this MatMul/Gemm with a constant weight on an FP8 kernel
    worth its error (K or N under 16), or None."""
    dims = _weight_dims(node, graph)
    if dims is None or len(dims) < 2:
        return None  # B is an activation (attention) or not 2-D: nothing known from the file
    trans_b = node.op_type == "Gemm" and bool(int_attribute(node, "transB", 0))
    k, n = (dims[-1], dims[-2]) if trans_b else (dims[-2], dims[-1])
    if k < MIN_GEMM_DIM or n < MIN_GEMM_DIM:
        return _WHY.format(what=f"{node.op_type} with K = {k}, N = {n}; under {MIN_GEMM_DIM}")
    return None
