"""Low-bit (INT4, and INT8 for embedding tables) weight quantization in ONNX's blocked layout.

A weight is cut into blocks of `block_size` consecutive elements along one axis and every block
gets its own scale (and zero point when asymmetric). For a MatMul weight [K, N] the blocks run along
the reduction axis K (ONNX `axis=0`), the layout ONNX Runtime fuses from an opset-21
`DequantizeLinear(axis=0, block_size=B)` into `MatMulNBits` (see `matmul_nbits_blocker`). When B
does not divide K the last block is shorter: that is ONNX's own rule (the scale has ceil(K/B) rows
and the reference DequantizeLinear drops the tail of the repeated last row), and ORT fuses it too.

Integers are kept unpacked (int8 / uint8 numpy arrays in the weight's shape) until
`to_initializers`, which packs two 4-bit values per byte through onnx's own `numpy_helper` with
`ml_dtypes.int4` / `uint4` (low nibble first, as the ONNX spec says).

Scales:
- symmetric (int4, zero point 0, [-8, 7]): scale = max(-min/8, max/7) over the block, so the most
  negative value may use -8 and nothing clips; a block of zeros gets scale 1.
- asymmetric (uint4 with zero point, [0, 15]): the block range widened to include 0 (the zero
  point is an integer in [0, 15], so 0 is always representable), scale = range / 15.
- `mse`: the same range shrunk by each factor of `mse_grid`, keeping per block the factor with the
  least squared reconstruction error; the unshrunk range is always tried first and wins ties, so
  `mse` is never worse than `minmax` on any block. The search runs in the compiled kernel
  (`qtool.kernels.block_mse_search`, `device` "cpu" or "cuda"); `_mse_search_numpy` is its
  numpy specification, reproduced bit for bit.
Rounding is round-half-to-even in float32, the arithmetic DequantizeLinear inverts exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.errors import ModelError
from qtool.kernels import block_mse_search

__all__ = [
    "DEFAULT_MSE_GRID",
    "BlockwiseWeight",
    "block_scales",
    "dequantize",
    "dequantize_node",
    "dequantize_values",
    "gather_block_quantized_node",
    "matmul_nbits_blocker",
    "quantize_blockwise",
    "quantize_embedding",
    "quantize_per_channel",
    "quantize_values",
    "to_initializers",
    "transpose_blockwise",
]

# 1.0 first: the minmax range is a candidate of every search and wins ties.
DEFAULT_MSE_GRID: tuple[float, ...] = tuple(round(1.0 - 0.025 * i, 3) for i in range(21))
_MIN_SCALE = np.float32(1e-8)
_METHODS = ("minmax", "mse")


MS_DOMAIN = "com.microsoft"  # ORT's contrib operators (MatMulNBits, GatherBlockQuantized)


@dataclass(frozen=True)
class BlockwiseWeight:
    """Quantized weight in ONNX DequantizeLinear terms: y = (values - zero_point) * scale.

    `axis` and `block_size` mean what DequantizeLinear's attributes mean. Blocked (`block_size`
    set): blocks run along `axis` and `scale` has the weight's shape with that dimension replaced
    by ceil(dim / block_size). Per channel (`block_size` None): one scale per index along `axis`,
    `scale` is 1-D.
    """

    values: np.ndarray  # int8 (symmetric) or uint8 (asymmetric), the weight's shape
    scale: np.ndarray  # float32
    zero_point: np.ndarray | None  # uint8, scale's shape; None when symmetric
    bits: int
    axis: int
    block_size: int | None

    @property
    def symmetric(self) -> bool:
        return self.zero_point is None

    @property
    def onnx_type(self) -> int:
        """The ONNX element type of the packed integers (and of the zero point)."""
        if self.bits == 4:
            return onnx.TensorProto.INT4 if self.symmetric else onnx.TensorProto.UINT4
        return onnx.TensorProto.INT8 if self.symmetric else onnx.TensorProto.UINT8


def _qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if symmetric:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def _check_grid(method: str, mse_grid: Sequence[float]) -> tuple[float, ...]:
    if method not in _METHODS:
        raise ValueError(f"scale method must be one of {', '.join(_METHODS)}, got {method!r}")
    if method == "minmax":
        return (1.0,)
    grid = tuple(float(f) for f in mse_grid)
    if not grid or any(not 0.0 < f <= 1.0 for f in grid):
        raise ValueError(f"mse_grid factors must lie in (0, 1], got {grid}")
    return (1.0, *[f for f in grid if f != 1.0])


def _scales_for(
    low: np.ndarray, high: np.ndarray, bits: int, symmetric: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale (and zero point) of ranges [low, high] that contain 0, elementwise, float32."""
    qmin, qmax = _qrange(bits, symmetric)
    if symmetric:
        scale = np.maximum(low / np.float32(qmin), high / np.float32(qmax))
        zero = None
    else:
        scale = (high - low) / np.float32(qmax - qmin)
    scale = np.where(scale > 0, np.maximum(scale, _MIN_SCALE), np.float32(1.0)).astype(np.float32)
    if not symmetric:
        zero = np.clip(np.rint(-low / scale), qmin, qmax).astype(np.uint8)
    return scale, zero


def quantize_values(
    x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, bits: int
) -> np.ndarray:
    """Round x to the integer grid of (scale, zero point), broadcasting; int8 or uint8."""
    symmetric = zero_point is None
    qmin, qmax = _qrange(bits, symmetric)
    q = np.rint(np.asarray(x, np.float32) / scale)
    if not symmetric:
        q = q + zero_point.astype(np.float32)
    return np.clip(q, qmin, qmax).astype(np.int8 if symmetric else np.uint8)


def dequantize_values(
    q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None
) -> np.ndarray:
    """(q - zero point) * scale in float32, broadcasting: what DequantizeLinear computes."""
    q = q.astype(np.float32)
    if zero_point is not None:
        q = q - zero_point.astype(np.float32)
    return (q * scale).astype(np.float32)


def _block_range(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[min, max] over each block's rows, widened to contain 0; float32 [nb, M] each."""
    low = np.minimum(blocks.min(axis=1), 0).astype(np.float32)
    high = np.maximum(blocks.max(axis=1), 0).astype(np.float32)
    return low, high


def _signed_scales(low: np.ndarray, high: np.ndarray, bits: int) -> np.ndarray:
    """Symmetric scales that put each block's largest-magnitude value on qmin (-8 for 4 bits),
    negative when that value is positive: all 16 levels serve the wider side, as ONNX Runtime's
    own round-to-nearest INT4 quantizer does (DequantizeLinear and MatMulNBits take any sign)."""
    qmin, _ = _qrange(bits, True)
    scale = np.where(high > -low, high / np.float32(qmin), low / np.float32(qmin))
    magnitude = np.abs(scale)
    sign = np.where(scale < 0, np.float32(-1.0), np.float32(1.0))
    return np.where(
        magnitude > 0, sign * np.maximum(magnitude, _MIN_SCALE), np.float32(1.0)
    ).astype(np.float32)


# The block quantizers (_quantize_columns) work on this many weight elements at a time: the
# signed-scale choice's float64 error terms of a whole lm_head (2048 x 32000) took 2.6 GB at once,
# a 262144 x 640 embedding table's float temporaries 2.7 GB; every step is per (block, column),
# so column chunks give the same bytes.
_CHUNK_ELEMENTS = 1 << 22


def _prefer_signed(
    blocks: np.ndarray, values: np.ndarray, scale: np.ndarray, bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the signed-scale grid where it reconstructs strictly better than `scale`'s."""
    low, high = _block_range(blocks)
    signed = _signed_scales(low, high, bits)
    signed_values = quantize_values(blocks, signed[:, None, :], None, bits)
    # `values` are `scale`'s grid already: each grid is rounded once and its error read from it.
    better = _values_error(blocks, signed_values, signed) < _values_error(blocks, values, scale)
    scale = np.where(better, signed, scale)
    return np.where(better[:, None, :], signed_values, values), scale


def _quantize_blocks(
    blocks: np.ndarray,
    bits: int,
    symmetric: bool,
    grid: tuple[float, ...],
    device: str = "cpu",
    signed_scales: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks [nb, B, M] (padding rows must be zeros) -> values, scale [nb, M], zero point.

    Zero padding never changes a block's range (the range always contains 0) and reconstructs
    exactly (0 maps to the zero point), so a short last block is searched on its real rows only.
    The `mse` search (more than one factor) runs in the compiled kernel (`qtool.kernels.
    block_mse_search`, on `device`), which reproduces `_mse_search_numpy` bit for bit and is
    what makes per-block searching affordable on large weights.

    `signed_scales` (symmetric only): afterwards each block takes the signed-scale grid of
    `_signed_scales` where that reconstructs better, so the result is never worse than either.
    The kernel makes that choice in the same pass (`_prefer_signed` is its numpy reference, bit
    for bit): in numpy it was a third of a 2 GB decoder's INT4 quantize time.
    """
    signed = signed_scales and symmetric
    if len(grid) == 1 and not signed:
        low, high = _block_range(blocks)
        scale, zero = _scales_for(low, high, bits, symmetric)
        values = quantize_values(
            blocks, scale[:, None, :], None if zero is None else zero[:, None, :], bits
        )
        return values, scale, zero
    qmin, qmax = _qrange(bits, symmetric)
    n_blocks, block_len, columns = blocks.shape
    found = block_mse_search(
        blocks.reshape(n_blocks * block_len, columns),
        block_len,
        np.asarray(grid, np.float32),
        qmin=qmin,
        qmax=qmax,
        symmetric=symmetric,
        signed_scales=signed,
        device=device,
    )
    return found.values.reshape(blocks.shape), found.scale, found.zero_point


def _mse_search_numpy(
    blocks: np.ndarray, bits: int, symmetric: bool, grid: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """The numpy reference of the `mse` search: values, scale, zero point, chosen grid index.

    Kept next to the kernel as its specification (tests and benchmarks/kernels.py compare them):
    every step is one float32 numpy operation, the squared errors are summed in float64 in row
    order (`np.add.accumulate` is sequential by definition, unlike `sum`'s pairwise order), so
    the kernel can reproduce each block's error, and therefore its choice, exactly.
    """
    low, high = _block_range(blocks)
    best_scale, best_zero = _scales_for(low, high, bits, symmetric)
    best_index = np.zeros(best_scale.shape, np.int32)
    if len(grid) > 1:
        best_err = _block_error(blocks, best_scale, best_zero, bits)
        for index, factor in enumerate(grid[1:], start=1):
            f = np.float32(factor)
            scale, zero = _scales_for(low * f, high * f, bits, symmetric)
            err = _block_error(blocks, scale, zero, bits)
            better = err < best_err  # strict: earlier (wider) candidates win ties
            best_err = np.where(better, err, best_err)
            best_scale = np.where(better, scale, best_scale)
            best_index = np.where(better, np.int32(index), best_index)
            if zero is not None:
                best_zero = np.where(better, zero, best_zero)
    values = quantize_values(
        blocks, best_scale[:, None, :], None if best_zero is None else best_zero[:, None, :], bits
    )
    return values, best_scale, best_zero, best_index


def _block_error(
    blocks: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int
) -> np.ndarray:
    """Sum over each block's rows of the squared float32 reconstruction error, float64 [nb, M]."""
    s = scale[:, None, :]
    z = None if zero is None else zero[:, None, :]
    return _values_error(blocks, quantize_values(blocks, s, z, bits), scale, zero)


def _values_error(
    blocks: np.ndarray, values: np.ndarray, scale: np.ndarray, zero: np.ndarray | None = None
) -> np.ndarray:
    """`_block_error` of values already rounded to (scale, zero): float64 [nb, M].

    The squares of float32 differences are exact in float64 and are added row by row in order,
    the order `np.add.accumulate` defines (which the compiled MSE search reproduces), without
    holding a float64 copy of the whole block array."""
    diff = dequantize_values(values, scale[:, None, :], None if zero is None else zero[:, None, :])
    diff -= blocks
    total = np.zeros((blocks.shape[0], blocks.shape[2]), np.float64)
    for row in range(blocks.shape[1]):
        term = diff[:, row, :].astype(np.float64)
        term *= term
        total += term
    return total


def block_scales(
    rows: np.ndarray,
    *,
    bits: int = 4,
    symmetric: bool = True,
    method: str = "minmax",
    mse_grid: Sequence[float] = DEFAULT_MSE_GRID,
    device: str = "cpu",
) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale [M] (and zero point [M]) of one block given as its rows [R, M].

    The building block GPTQ needs: it fixes a block's grid when the block starts, from weights
    that earlier error feedback has already changed.
    """
    grid = _check_grid(method, mse_grid)
    rows = np.asarray(rows, np.float32)
    _, scale, zero = _quantize_blocks(rows[None], bits, symmetric, grid, device)
    return scale[0], None if zero is None else zero[0]


def _check_weight(weight: np.ndarray, name: str) -> np.ndarray:
    weight = np.asarray(weight, dtype=np.float32)
    if weight.ndim == 0 or weight.size == 0:
        raise ModelError(f"weight {name!r} is empty or a scalar; nothing to quantize")
    if not np.all(np.isfinite(weight)):
        raise ModelError(f"weight {name!r} contains NaN or Inf")
    return weight


def _quantize_columns(
    flat: np.ndarray,
    n_blocks: int,
    block_size: int,
    bits: int,
    symmetric: bool,
    grid: tuple[float, ...],
    device: str,
    signed_scales: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """_quantize_blocks of `flat` [length, columns] (blocks along the rows), a few columns at a
    time: every step is per (block, column), so the bytes are the same as in one go, and the
    float temporaries stay one chunk (a 262144 x 640 embedding table quantized whole took four
    float32 copies of itself, 2.7 GB, at once)."""
    length, columns = flat.shape
    rows = n_blocks * block_size
    step = max(1, _CHUNK_ELEMENTS // rows)
    values = scale = zero = None
    for start in range(0, columns, step):
        stop = min(start + step, columns)
        padded = np.zeros((rows, stop - start), np.float32)  # zero rows pad the last block
        padded[:length] = flat[:, start:stop]
        part_values, part_scale, part_zero = _quantize_blocks(
            padded.reshape(n_blocks, block_size, -1), bits, symmetric, grid, device, signed_scales
        )
        if values is None:
            values = np.empty((rows, columns), part_values.dtype)
            scale = np.empty((n_blocks, columns), part_scale.dtype)
            if part_zero is not None:
                zero = np.empty((n_blocks, columns), part_zero.dtype)
        values[:, start:stop] = part_values.reshape(rows, -1)
        scale[:, start:stop] = part_scale
        if zero is not None:
            zero[:, start:stop] = part_zero
    return values, scale, zero


def quantize_blockwise(
    weight: np.ndarray,
    *,
    bits: int = 4,
    block_size: int = 32,
    symmetric: bool = True,
    method: str = "minmax",
    mse_grid: Sequence[float] = DEFAULT_MSE_GRID,
    axis: int = 0,
    name: str = "weight",
    device: str = "cpu",
    signed_scales: bool = False,
) -> BlockwiseWeight:
    """Blocked quantization along `axis` (0: a MatMul weight [K, N], blocks along K).

    Raises ModelError when the weight holds NaN/Inf (naming it), ValueError on bad arguments.
    """
    weight = _check_weight(weight, name)
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    grid = _check_grid(method, mse_grid)
    _qrange(bits, symmetric)
    axis = axis % weight.ndim
    moved = np.moveaxis(weight, axis, 0)
    length = moved.shape[0]
    flat = moved.reshape(length, -1)
    n_blocks = -(-length // block_size)
    values, scale, zero = _quantize_columns(
        flat, n_blocks, block_size, bits, symmetric, grid, device, signed_scales
    )
    values = values[:length]

    def restore(a: np.ndarray, first: int) -> np.ndarray:
        return np.ascontiguousarray(np.moveaxis(a.reshape(first, *moved.shape[1:]), 0, axis))

    return BlockwiseWeight(
        values=restore(values, length),
        scale=restore(scale, n_blocks),
        zero_point=None if zero is None else restore(zero, n_blocks),
        bits=bits,
        axis=axis,
        block_size=block_size,
    )


def quantize_per_channel(
    weight: np.ndarray,
    *,
    bits: int = 4,
    symmetric: bool = True,
    method: str = "minmax",
    mse_grid: Sequence[float] = DEFAULT_MSE_GRID,
    axis: int = 0,
    name: str = "weight",
    device: str = "cpu",
    signed_scales: bool = False,
) -> BlockwiseWeight:
    """One scale per index along `axis` (0: a Conv weight's output channels), no blocks.

    ONNX Runtime has no INT4 Conv kernel: such a Conv runs on the dequantized float weight, so
    this shrinks the file, not the compute.
    """
    weight = _check_weight(weight, name)
    grid = _check_grid(method, mse_grid)
    _qrange(bits, symmetric)
    axis = axis % weight.ndim
    moved = np.moveaxis(weight, axis, 0)
    channels = moved.shape[0]
    # [C, R] -> one block of R rows per channel column: [R, C]
    flat = moved.reshape(channels, -1).T
    values, scale, zero = _quantize_columns(
        flat, 1, flat.shape[0], bits, symmetric, grid, device, signed_scales
    )
    values = np.moveaxis(values.T.reshape(moved.shape), 0, axis)
    return BlockwiseWeight(
        values=np.ascontiguousarray(values),
        scale=scale[0],
        zero_point=None if zero is None else zero[0],
        bits=bits,
        axis=axis,
        block_size=None,
    )


def quantize_embedding(
    table: np.ndarray,
    *,
    bits: int = 4,
    block_size: int | None = 32,
    symmetric: bool = True,
    method: str = "minmax",
    mse_grid: Sequence[float] = DEFAULT_MSE_GRID,
    name: str = "embedding",
    device: str = "cpu",
) -> BlockwiseWeight:
    """A Gather table [V, D]: blocks of `block_size` along D (axis 1), or one scale per row
    (`block_size` None: per channel along axis 0).

    ONNX Runtime (1.31) does not fuse DequantizeLinear -> Gather: in QDQ form the whole table is
    dequantized every run. Its fused op is com.microsoft GatherBlockQuantized, written directly
    with `gather_block_quantized_node` (blocked along D only).
    """
    table = np.asarray(table)
    if table.ndim != 2:
        raise ModelError(f"embedding table {name!r} must be 2-D [V, D], got shape {table.shape}")
    if block_size is None:
        return quantize_per_channel(
            table,
            bits=bits,
            symmetric=symmetric,
            method=method,
            mse_grid=mse_grid,
            axis=0,
            name=name,
            device=device,
        )
    return quantize_blockwise(
        table,
        bits=bits,
        block_size=block_size,
        symmetric=symmetric,
        method=method,
        mse_grid=mse_grid,
        axis=1,
        name=name,
        device=device,
    )


def transpose_blockwise(bw: BlockwiseWeight) -> BlockwiseWeight:
    """The same quantized 2-D weight transposed: values, scales and zero points swap axes, and
    the blocks (or channels) run along the other axis."""
    if bw.values.ndim != 2:
        raise ValueError(f"only 2-D weights transpose, got shape {bw.values.shape}")

    def swap(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.T) if a.ndim == 2 else a

    return BlockwiseWeight(
        values=swap(bw.values),
        scale=swap(np.asarray(bw.scale)),
        zero_point=None if bw.zero_point is None else swap(np.asarray(bw.zero_point)),
        bits=bw.bits,
        axis=1 - bw.axis,
        block_size=bw.block_size,
    )


def _expanded(param: np.ndarray, bw: BlockwiseWeight) -> np.ndarray:
    """Scale or zero point broadcast to the weight's shape (ONNX's blocked/per-axis rule)."""
    shape = bw.values.shape
    if bw.block_size is None:
        dims = [1] * len(shape)
        dims[bw.axis] = shape[bw.axis]
        return param.reshape(dims)
    repeated = np.repeat(param, bw.block_size, axis=bw.axis)
    return np.take(repeated, np.arange(shape[bw.axis]), axis=bw.axis)


def dequantize(bw: BlockwiseWeight) -> np.ndarray:
    """The float32 weight DequantizeLinear reconstructs: the numpy reference."""
    zero = None if bw.zero_point is None else _expanded(bw.zero_point, bw)
    return dequantize_values(bw.values, _expanded(bw.scale, bw), zero)


def _packed(values: np.ndarray, bits: int, symmetric: bool) -> np.ndarray:
    if bits == 8:
        return values
    return values.astype(ml_dtypes.int4 if symmetric else ml_dtypes.uint4)


def to_initializers(name: str, bw: BlockwiseWeight) -> list[onnx.TensorProto]:
    """`{name}_quantized` (int4/uint4 packed two per byte, or int8/uint8), `{name}_scale`
    (float32) and, when asymmetric, `{name}_zero_point` (the quantized type, packed too).

    Symmetric weights carry no zero point: ONNX's default is 0 and ORT's MatMulNBits fusion
    accepts it absent.
    """
    tensors = [
        numpy_helper.from_array(_packed(bw.values, bw.bits, bw.symmetric), f"{name}_quantized"),
        numpy_helper.from_array(bw.scale.astype(np.float32), f"{name}_scale"),
    ]
    if bw.zero_point is not None:
        zero = _packed(bw.zero_point, bw.bits, symmetric=False)
        tensors.append(numpy_helper.from_array(zero, f"{name}_zero_point"))
    return tensors


def dequantize_node(name: str, bw: BlockwiseWeight, output: str | None = None) -> onnx.NodeProto:
    """The DequantizeLinear reading `to_initializers(name, bw)`; blocked ones need opset 21.

    Output defaults to `{name}_dequantized`, the node is `{name}_DequantizeLinear` (the QDQ
    writer's naming).
    """
    inputs = [f"{name}_quantized", f"{name}_scale"]
    if bw.zero_point is not None:
        inputs.append(f"{name}_zero_point")
    attrs: dict[str, int] = {"axis": bw.axis}
    if bw.block_size is not None:
        attrs["block_size"] = bw.block_size
    return helper.make_node(
        "DequantizeLinear",
        inputs,
        [output or f"{name}_dequantized"],
        name=f"{name}_DequantizeLinear",
        **attrs,
    )


def _power_of_two_at_least_16(b: int) -> bool:
    return b >= 16 and b & (b - 1) == 0


def matmul_nbits_blocker(bw: BlockwiseWeight) -> str | None:
    """Why ONNX Runtime will not fuse DequantizeLinear(bw) -> MatMul into MatMulNBits, or None.

    The weight-side conditions of ORT's DQMatMulToMatMulNBits selector (checked against ORT 1.31):
    a 2-D 4- or 8-bit constant weight, blocked along axis 0 with a power-of-two block of at least
    16, float scales of shape [ceil(K/B), N] (zero point, if any, the same shape). Graph-side
    conditions are the writer's: the DequantizeLinear feeds only input B of one MatMul (or of a
    Gemm with alpha=1, transA=transB=0, beta=1 and a bias of shape [N]), the model is opset >= 21,
    the session optimisation level is at least EXTENDED.
    """
    if bw.values.ndim != 2:
        return f"weight is {bw.values.ndim}-D, MatMulNBits needs a 2-D [K, N] weight"
    if bw.block_size is None:
        return "weight is per channel, MatMulNBits fusion here needs blocks along K"
    if bw.axis != 0:
        return f"blocks run along axis {bw.axis}, MatMulNBits needs axis 0 (K)"
    if not _power_of_two_at_least_16(bw.block_size):
        return f"block size {bw.block_size} is not a power of two >= 16"
    return None


def gather_block_quantized_node(
    name: str,
    bw: BlockwiseWeight,
    indices: str,
    output: str,
    *,
    gather_axis: int = 0,
) -> onnx.NodeProto:
    """com.microsoft GatherBlockQuantized over `to_initializers(name, bw)` (ORT-only, fused).

    ORT's CPU kernel takes int4/uint4 data (zero point optional, same 4-bit type), or uint8 with
    `bits=8`; blocks along the last axis, block size a power of two >= 16. A symmetric int8 table
    has no form there: quantize it asymmetric (uint8) instead. The model must import
    com.microsoft opset 1.
    """
    if bw.block_size is None or bw.axis != bw.values.ndim - 1:
        raise ValueError("GatherBlockQuantized needs blocks along the table's last axis")
    if not _power_of_two_at_least_16(bw.block_size):
        raise ValueError(
            f"GatherBlockQuantized needs a power-of-two block >= 16, got {bw.block_size}"
        )
    if bw.bits == 8 and bw.symmetric:
        raise ValueError("GatherBlockQuantized has no int8 form: quantize 8-bit tables asymmetric")
    inputs = [f"{name}_quantized", indices, f"{name}_scale"]
    if bw.zero_point is not None:
        inputs.append(f"{name}_zero_point")
    attrs = {"gather_axis": gather_axis, "quantize_axis": bw.axis, "block_size": bw.block_size}
    if bw.bits == 8:
        attrs["bits"] = 8
    return helper.make_node(
        "GatherBlockQuantized",
        inputs,
        [output],
        name=f"{name}_GatherBlockQuantized",
        domain=MS_DOMAIN,
        **attrs,
    )
