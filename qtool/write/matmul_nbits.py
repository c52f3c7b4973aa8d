"""INT4 MatMul/Gemm weights written as com.microsoft MatMulNBits, with the compute type chosen.

ORT runs a blocked 4-bit DequantizeLinear -> MatMul as MatMulNBits either way, but when it forms
the node from QDQ it takes the compute type ("accuracy level") from a *session* option whose
default is 4: activations quantized to int8 inside the kernel. On x86 without VNNI that path is
slower than plain fp32 compute (MiniLM, AMD EPYC AVX2: 0.68-0.77x FP32 at level 4, 0.97x at level
1), and a deployed application rarely sets the option. ORT's own INT4 tool writes MatMulNBits
nodes with the level as a node attribute, so its models run the fast path in a default session.
For `target: ort-cpu` qtool does the same (`quantization.int4_format: matmulnbits`, the default
there), and picks the level for `quantization.cpu`; `int4_format: qdq` keeps the portable
DequantizeLinear form that TensorRT and other runtimes read.

The node and its initializers are exactly what ORT 1.31's DQMatMulToMatMulNBits fusion produces
from our QDQ form (tests/test_matmul_nbits.py compares them byte for byte): B as uint8
[N, blocks, block_size/2] with two values per byte, low nibble first, signed values offset by 8;
scales flattened [N * blocks]; asymmetric zero points packed two per byte along the blocks of
each column, [N * ceil(blocks/2)]; no zero point for symmetric weights (MatMulNBits' default 8).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.ort.accuracy_level import ACCURACY_LEVELS
from qtool.ort.cpu import CpuFeatures
from qtool.plan.settings import QuantizationSpec
from qtool.write.int4 import MS_DOMAIN, BlockwiseWeight, matmul_nbits_blocker


def nbits_level(spec: QuantizationSpec, cpu: CpuFeatures) -> tuple[int | None, str]:
    """The accuracy level to write 4-bit MatMul weights with (None: keep them QDQ), and why."""
    if spec.resolved_int4_format != "matmulnbits":
        return None, f"int4_format {spec.resolved_int4_format}: DequantizeLinear -> MatMul"
    if spec.accuracy_level != "auto":
        level = int(spec.accuracy_level)
        return level, f"{ACCURACY_LEVELS[level]}: set by quantization.accuracy_level"
    return accuracy_level_for(cpu)


def accuracy_level_for(cpu: CpuFeatures) -> tuple[int, str]:
    """The MatMulNBits compute type that runs fastest on `cpu`, and why.

    Int8 compute (4) multiplies with VNNI / AMX dot products or ARM's dot-product instructions;
    without them MLAS emulates the int8 dot products and fp32 compute (1) is faster (measured on
    MiniLM, AMD EPYC AVX2: level 4 0.68-0.77x FP32, level 1 0.97x).
    """
    arm = cpu.arch in ("aarch64", "arm64")
    if cpu.vnni or (arm and "dotprod" in cpu.features):
        return 4, f"int8 compute: {cpu.label()} has int8 dot-product instructions"
    return 1, f"fp32 compute: {cpu.label()} has no int8 dot-product instructions"


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 along the last axis (even length) -> bytes, low nibble first."""
    pairs = values.reshape(*values.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def nbits_initializers(name: str, bw: BlockwiseWeight) -> list[onnx.TensorProto]:
    """`{name}_nbits` (B), `{name}_nbits_scale` and, asymmetric, `{name}_nbits_zero_point`."""
    k, n = bw.values.shape
    block = int(bw.block_size)
    blocks = -(-k // block)
    unsigned = bw.values.astype(np.int16)
    if bw.symmetric:
        unsigned = unsigned + 8
    padded = np.zeros((blocks * block, n), np.uint8)
    padded[:k] = unsigned.astype(np.uint8)
    # [K_padded, N] -> [N, blocks, block] -> two per byte
    columns = np.ascontiguousarray(padded.T).reshape(n, blocks, block)
    tensors = [
        numpy_helper.from_array(_pack_nibbles(columns), f"{name}_nbits"),
        numpy_helper.from_array(
            np.ascontiguousarray(bw.scale.astype(np.float32).T).reshape(-1), f"{name}_nbits_scale"
        ),
    ]
    if bw.zero_point is not None:
        zero = np.zeros((n, blocks + blocks % 2), np.uint8)
        zero[:, :blocks] = bw.zero_point.T
        tensors.append(
            numpy_helper.from_array(_pack_nibbles(zero).reshape(-1), f"{name}_nbits_zero_point")
        )
    return tensors


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def read_nbits_weight(node: onnx.NodeProto, initializers: dict[str, np.ndarray]) -> BlockwiseWeight:
    """The BlockwiseWeight ([K, N], DequantizeLinear terms) a MatMulNBits node holds: the
    inverse of `nbits_initializers`, for checks and tools that read written models."""
    attrs = {a.name: a.i for a in node.attribute}
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    if attrs.get("bits", 4) != 4:
        raise ValueError(f"MatMulNBits '{node.name}' holds {attrs['bits']}-bit weights, not 4")
    blocks = -(-k // block)
    packed = initializers[node.input[1]].reshape(n, blocks, block // 2)
    values = _unpack_nibbles(packed).reshape(n, blocks * block)[:, :k].T.astype(np.int16)
    scale = np.ascontiguousarray(initializers[node.input[2]].reshape(n, blocks).T)
    zero = None
    if len(node.input) > 3 and node.input[3]:
        zero_packed = initializers[node.input[3]].reshape(n, -1)
        zero = np.ascontiguousarray(_unpack_nibbles(zero_packed)[:, :blocks].T).astype(np.uint8)
        values_out = values.astype(np.uint8)
    else:
        values_out = (values - 8).astype(np.int8)
    return BlockwiseWeight(
        values=np.ascontiguousarray(values_out),
        scale=scale,
        zero_point=zero,
        bits=4,
        axis=0,
        block_size=block,
    )


def nbits_blocker(node: onnx.NodeProto, bw: BlockwiseWeight) -> str | None:
    """Why `node` (reading `bw` as input B) cannot become MatMulNBits, or None."""
    if bw.bits != 4:
        return "weight is not 4-bit"
    blocker = matmul_nbits_blocker(bw)
    if blocker is not None:
        return blocker
    if node.op_type == "MatMul":
        return None
    if node.op_type != "Gemm":
        return f"{node.op_type} is not MatMul or Gemm"
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("alpha", 1.0) != 1.0 or attrs.get("transA", 0) or attrs.get("transB", 0):
        return "Gemm has alpha != 1 or a transposed input"
    if len(node.input) > 2 and node.input[2] and attrs.get("beta", 1.0) != 1.0:
        return "Gemm has beta != 1"
    return None


def matmul_nbits_node(
    node: onnx.NodeProto,
    weight: str,
    bw: BlockwiseWeight,
    bias: str | None,
    accuracy_level: int,
) -> onnx.NodeProto:
    """MatMulNBits replacing `node` (MatMul, or Gemm without transposes), its name kept so the
    Plan and the runtime-truth check still find it; `bias` must be a [N] tensor or None."""
    k, n = bw.values.shape
    inputs = [node.input[0], f"{weight}_nbits", f"{weight}_nbits_scale"]
    inputs.append(f"{weight}_nbits_zero_point" if bw.zero_point is not None else "")
    if bias:
        inputs += ["", bias]  # g_idx unused
    while inputs and not inputs[-1]:
        inputs.pop()
    return helper.make_node(
        "MatMulNBits",
        inputs,
        list(node.output),
        name=node.name,
        domain=MS_DOMAIN,
        K=k,
        N=n,
        bits=4,
        block_size=int(bw.block_size),
        accuracy_level=accuracy_level,
    )
