"""Choose each weight's integer format for the CPU it will run on, so fused kernels never saturate.

On x86 without VNNI, ONNX Runtime's uint8 x int8 kernels (MLAS, `vpmaddubsw`) add each pair of
products along the reduction axis into a saturating 16-bit sum. Pairs are aligned: reduction
indices (0, 1), (2, 3), ... in the order the kernel walks the weight (measured on ORT 1.31: rows of
a [K, N] MatMul/Gemm weight; for Conv the im2col order, kernel positions outer and the group's
input channels inner; the depthwise kernel accumulates in 32 bits). An activation byte is at most
255, so a pair can only overflow when its two quantized weights of one sign add up to more than
128 (255 * 128 = 32640 fits, 255 * 129 does not). qtool checks this on the weights it writes:

- `s8`: full-range int8. Kept wherever no aligned pair can overflow, and everywhere on CPUs that
  do not saturate (VNNI, AMX, ARM).
- `s8-pairsafe`: int8 in which every aligned pair of one sign sums to at most 128. Per channel
  that could overflow, qtool tries scales from the full-range one up to the one that makes every
  pair fit (largest one-sign pair sum / 127), lowers the few pairs still over 128 by splitting the
  excess between their two values, and keeps the candidate with the least weight error. Channels
  that cannot overflow keep their full-range values.
- `s7`: 7-bit weights in [-63, 63] (ORT's `reduce_range`): safe in any order, one bit lost in every
  channel.
- `u8`: uint8 weights with zero point 128: the same values as `s8`, run by ORT's U8U8 kernels that
  widen to 16 bits before multiplying (no saturation, but slower on AVX2).

`auto` uses `s8-pairsafe` where overflow is possible: on the models we measured it keeps the U8S8
speed and loses the least accuracy (README: "Saturation on CPUs without VNNI").
"""

from __future__ import annotations

import math

import numpy as np

from qtool.ort.cpu import CpuFeatures
from qtool.plan.layout import WeightSlot
from qtool.plan.plan import WeightPlan
from qtool.write.params import WeightParams, quantize_weight
from qtool.write.sum_rounding import keep_channel_sums

FORMATS = ("s8", "s8-pairsafe", "s7", "u8")
_POLICY_FORMAT = {"auto": "s8-pairsafe", "pair-safe": "s8-pairsafe", "reduce-range": "s7"}
_POLICY_FORMAT["uint8-weights"] = "u8"
PAIR_LIMIT = 128  # largest one-sign pair sum of int8 weights that fits 16 bits against 255


def reduction_matrix(weight: np.ndarray, slot: WeightSlot) -> np.ndarray:
    """The weight as [output channels, K] in the order ORT's kernel sums along K."""
    if slot.reduction == "k-rows":  # [K, N]
        return weight.reshape(weight.shape[0], -1).T
    if slot.reduction == "k-cols":  # [N, K]
        return weight.reshape(weight.shape[0], -1)
    if slot.reduction == "conv":  # [M, C/g, *kernel] -> [M, *kernel, C/g]
        moved = np.moveaxis(weight, 1, -1)
        return moved.reshape(weight.shape[0], -1)
    raise ValueError(f"no 16-bit pair sums for reduction {slot.reduction!r}")


def pair_extremes(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per channel, the largest sum of positive parts and of negative magnitudes over pairs."""
    channels, k = matrix.shape
    if k % 2:
        matrix = np.concatenate([matrix, np.zeros((channels, 1), matrix.dtype)], axis=1)
    pairs = matrix.reshape(channels, -1, 2).astype(np.float64)
    a, b = pairs[..., 0], pairs[..., 1]
    positive = (np.maximum(a, 0) + np.maximum(b, 0)).max(axis=1)
    negative = (np.maximum(-a, 0) + np.maximum(-b, 0)).max(axis=1)
    return positive, negative


def can_saturate(params: WeightParams, slot: WeightSlot) -> np.ndarray:
    """Per output channel (or one value for per-tensor weights): may a 16-bit pair sum overflow?"""
    values = params.values.astype(np.int32)
    if params.zero_point is not None:
        zero = params.zero_point_array().astype(np.int32)
        if params.axis is not None:
            zero = zero.reshape(_channel_shape(values, params.axis))
        values = values - zero
    positive, negative = pair_extremes(reduction_matrix(values, slot))
    unsafe = (positive > PAIR_LIMIT) | (negative > PAIR_LIMIT)
    return unsafe if slot.axis is not None else np.asarray([unsafe.any()])


_CANDIDATES = 9  # scales tried per channel between full range and "every pair fits"


def from_reduction_matrix(matrix: np.ndarray, shape: tuple[int, ...], slot: WeightSlot):
    """Inverse of `reduction_matrix`: back to the weight's own layout."""
    if slot.reduction == "k-rows":
        return matrix.T.reshape(shape)
    if slot.reduction == "k-cols":
        return matrix.reshape(shape)
    moved = matrix.reshape((shape[0], *shape[2:], shape[1]))
    return np.moveaxis(moved, -1, 1)


def _limit_pairs(pairs: np.ndarray) -> None:
    """In place on int16 pairs [C, K/2, 2]: lower every one-sign pair summing over PAIR_LIMIT.

    The excess is split between the two values (the larger gives up the odd unit), which costs
    the least squared error; only the few offending pairs are touched.
    """
    first_of_pair, second_of_pair = pairs[..., 0], pairs[..., 1]
    for sign in (1, -1):
        # Two strided adds: a reduction over a last axis of length 2 is ten times slower.
        sums = np.maximum(first_of_pair * sign, 0) + np.maximum(second_of_pair * sign, 0)
        rows, cols = np.nonzero(sums > PAIR_LIMIT)
        if rows.size == 0:
            continue
        pair = pairs[rows, cols] * sign  # both values have this sign, each at most 127
        excess = pair.sum(axis=1) - PAIR_LIMIT
        first = np.where(pair[:, 0] >= pair[:, 1], (excess + 1) // 2, excess // 2)
        pair[:, 0] -= first
        pair[:, 1] -= excess - first
        pairs[rows, cols] = pair * sign


# Elements of the reduction matrix searched at once: the search holds a few float32/int16 copies
# of a chunk, so peak memory stays a few MB above the weight itself however large it is.
_CHUNK_ELEMENTS = 1 << 20


def _chunks(rows: np.ndarray, k: int) -> list[np.ndarray]:
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    return [rows[i : i + step] for i in range(0, rows.size, step)]


def _candidate_q(sub: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int16 values of `sub` at per-row `scale` with every overflowing pair lowered, and each
    row's squared error."""
    q = np.clip(np.rint(sub / scale[:, None]), -127, 127).astype(np.int16)
    _limit_pairs(q.reshape(q.shape[0], -1, 2))
    diff = q * scale[:, None] - sub
    return q, np.einsum("ij,ij->i", diff, diff, dtype=np.float64)


def _padded_rows(matrix: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    sub = np.zeros((rows.size, k + k % 2), np.float32)  # padded to whole pairs
    sub[:, :k] = matrix[rows]
    return sub


def _pairsafe(
    weight: np.ndarray, slot: WeightSlot, full: WeightParams, unsafe: np.ndarray
) -> WeightParams:
    """int8 values with no overflowing pair and the least weight error per channel (see top).

    Scales between full range and "every pair fits" are tried (_CANDIDATES of them). Per-channel
    weights search only the channels that could overflow, chunk by chunk; a per-tensor weight
    shares one scale, so its candidates' errors are summed over all chunks first and the values
    are computed once more at the winner.
    """
    matrix = reduction_matrix(weight, slot)  # a view where the layout allows
    channels, k = matrix.shape
    full_scale = np.broadcast_to(np.asarray(full.scale, np.float32), (channels,))
    values = np.array(reduction_matrix(full.values, slot), np.int8)
    scales = np.array(full_scale, np.float32)
    steps = np.linspace(0.0, 1.0, _CANDIDATES, dtype=np.float32)
    if slot.axis is not None:
        for rows in _chunks(np.nonzero(unsafe)[0], k):
            sub = _padded_rows(matrix, rows, k)
            positive, negative = pair_extremes(sub)
            fits = (np.maximum(positive, negative) / 127.0).astype(np.float32)
            base = full_scale[rows]
            best_q = np.zeros(sub.shape, np.int16)
            best_scale = base.copy()
            best_error = np.full(rows.size, np.inf)
            for t in steps:
                scale = base + t * np.maximum(fits - base, np.float32(0.0))
                q, error = _candidate_q(sub, scale)
                better = error < best_error
                best_q[better] = q[better]
                best_scale[better] = scale[better]
                best_error[better] = error[better]
            values[rows] = best_q[:, :k].astype(np.int8)
            scales[rows] = best_scale
        values = from_reduction_matrix(values, weight.shape, slot)
        return WeightParams(np.ascontiguousarray(values), scales, slot.axis)
    every = _chunks(np.arange(channels), k)
    fits_all = np.float32(0.0)
    for rows in every:
        positive, negative = pair_extremes(_padded_rows(matrix, rows, k))
        fits_all = max(fits_all, np.float32(np.maximum(positive, negative).max() / 127.0))
    base = np.float32(full_scale[0])
    candidates = [base + t * max(fits_all - base, np.float32(0.0)) for t in steps]
    errors = np.zeros(len(candidates))
    for rows in every:
        sub = _padded_rows(matrix, rows, k)
        for index, scale in enumerate(candidates):
            errors[index] += _candidate_q(sub, np.full(rows.size, scale, np.float32))[1].sum()
    best = candidates[int(np.argmin(errors))]  # first minimum: ties keep the wider range
    for rows in every:
        q, _ = _candidate_q(_padded_rows(matrix, rows, k), np.full(rows.size, best, np.float32))
        values[rows] = q[:, :k].astype(np.int8)
    values = from_reduction_matrix(values, weight.shape, slot)
    return WeightParams(values, np.asarray(best, np.float32), None)


def _channel_shape(weight: np.ndarray, axis: int) -> list[int]:
    shape = [1] * weight.ndim
    shape[axis] = -1
    return shape


def _rescale(weight: np.ndarray, slot: WeightSlot, bound: np.ndarray, limit: int) -> WeightParams:
    """Symmetric int weights with scale = bound / limit (per channel along slot.axis, or one)."""
    bound = np.asarray(bound, np.float32)
    scale = np.where(bound > 0, bound / np.float32(limit), np.float32(1.0)).astype(np.float32)
    if slot.axis is None:
        values = np.clip(np.round(weight / scale), -limit, limit).astype(np.int8)
        return WeightParams(values, np.asarray(scale, np.float32), None)
    shaped = scale.reshape(_channel_shape(weight, slot.axis))
    values = np.clip(np.round(weight / shaped), -limit, limit).astype(np.int8)
    return WeightParams(values, scale, slot.axis)


def _as_uint8(params: WeightParams) -> WeightParams:
    values = (params.values.astype(np.int16) + 128).astype(np.uint8)
    zero = np.full(np.shape(params.scale), 128, dtype=np.uint8)
    return WeightParams(values, params.scale, params.axis, zero)


def choose_weight(
    weight: np.ndarray,
    slot: WeightSlot,
    plan: WeightPlan,
    cpu: CpuFeatures,
    policy: str,
    device: str = "cpu",
) -> WeightParams:
    """Quantize one weight in the format its CPU needs; record the format and why in `plan`."""
    weight = np.asarray(weight, dtype=np.float32)
    full = quantize_weight(weight, slot.axis, device)
    if slot.reduction in ("conv", "depthwise"):  # filters keep their sums (sum_rounding.py)
        full = keep_channel_sums(weight, full)
    if not cpu.u8s8_saturates:
        plan.format, plan.reason = "s8", f"int8 full range: {_cpu_name(cpu)} does not saturate"
        return full
    if slot.reduction == "depthwise":
        plan.format = "s8"
        plan.reason = "int8 full range: ORT's depthwise kernel accumulates in 32 bits"
        return full
    unsafe = can_saturate(full, slot)
    if policy == "ignore" or not unsafe.any():
        plan.format = "s8"
        plan.reason = (
            "int8 full range: no aligned weight pair can overflow a 16-bit sum"
            if not unsafe.any()
            else f"int8 full range (quantization.saturation: ignore): {int(unsafe.sum())} "
            f"channel(s) may saturate on {_cpu_name(cpu)}"
        )
        return full
    fmt = _POLICY_FORMAT[policy]
    plan.format = fmt
    where = f"{int(unsafe.sum())} of {unsafe.size} channel(s) could overflow 16-bit pair sums"
    if fmt == "u8":
        plan.reason = f"uint8 weights, the int8 values + 128 (U8U8 kernels, no saturation): {where}"
        return _as_uint8(full)
    if fmt == "s7":
        bound = np.asarray(full.scale, np.float32) * np.float32(127.0)
        result = _rescale(weight, slot, bound, 63)
        plan.reason = f"7-bit weights (reduce range): {where}"
    else:
        result = _pairsafe(weight, slot, full, unsafe)
        plan.reason = f"int8 with pair sums limited to 128 on the channels that need it: {where}"
    ratio = np.asarray(result.scale, np.float64) / np.asarray(full.scale, np.float64)
    before, after = reduction_matrix(full.values, slot), reduction_matrix(result.values, slot)
    plan.channels_changed = int(np.count_nonzero(np.any(before != after, axis=1)))
    plan.bits_lost_max = round(float(math.log2(max(float(ratio.max()), 1.0))), 3)
    return result


def _cpu_name(cpu: CpuFeatures) -> str:
    return "this CPU" if cpu.source.startswith("this machine") else "the recipe's CPU"


# Largest magnitude of the signed values each int8 format stores (u8: the s8 values + 128).
FORMAT_LIMITS = {"s8": 127, "s8-pairsafe": 127, "s7": 63, "u8": 127}


def keeps_pair_limit(slot: WeightSlot, plan: WeightPlan, cpu: CpuFeatures, policy: str) -> bool:
    """Must values chosen for this weight after `choose_weight` (AdaRound's roundings) keep every
    aligned one-sign pair sum within PAIR_LIMIT? Yes wherever the CPU saturates and the format
    is int8 run by the U8S8 kernels (full range included: it was kept because no pair could
    overflow, and moving a value by one step could change that), unless the recipe says ignore."""
    return (
        cpu.u8s8_saturates
        and slot.reduction not in ("depthwise", "gather")
        and policy != "ignore"
        and plan.format in ("s8", "s8-pairsafe")
    )


def restore_pair_limit(
    values: np.ndarray, fallback: np.ndarray, priority: np.ndarray, slot: WeightSlot
) -> tuple[np.ndarray, int]:
    """Signed int values (the weight's shape) with every aligned one-sign pair sum lowered to at
    most PAIR_LIMIT by moving values to `fallback`, lowest `priority` first; and how many moved.

    `fallback` must itself satisfy the limit and lie within one step of `values`, closer to zero
    (AdaRound: the choice of smaller magnitude), so each offending pair is over by at most 2 and
    two rounds always suffice.
    """
    shape = values.shape
    matrices = [reduction_matrix(np.asarray(a), slot) for a in (values, fallback, priority)]
    channels, k = matrices[0].shape
    padded = []
    for matrix, fill in zip(matrices, (0, 0, np.inf), strict=True):
        out = np.full((channels, k + k % 2), fill, dtype=np.float64)
        out[:, :k] = matrix
        padded.append(out.reshape(channels, -1, 2))
    pairs, safe, order = padded
    moved = 0
    for sign in (1, -1):
        for _ in range(2):
            a, b = pairs[..., 0], pairs[..., 1]
            over = np.maximum(a * sign, 0) + np.maximum(b * sign, 0) > PAIR_LIMIT
            if not over.any():
                break
            movable_a = over & (a != safe[..., 0]) & (a * sign > 0)
            movable_b = over & (b != safe[..., 1]) & (b * sign > 0)
            take_a = movable_a & (~movable_b | (order[..., 0] <= order[..., 1]))
            take_b = movable_b & ~take_a
            pairs[..., 0] = np.where(take_a, safe[..., 0], a)
            pairs[..., 1] = np.where(take_b, safe[..., 1], b)
            moved += int(take_a.sum() + take_b.sum())
        a, b = pairs[..., 0], pairs[..., 1]
        if (np.maximum(a * sign, 0) + np.maximum(b * sign, 0) > PAIR_LIMIT).any():
            raise ValueError("restore_pair_limit: the fallback values exceed the pair limit")
    limited = pairs.reshape(channels, -1)[:, :k].astype(np.int32)
    return from_reduction_matrix(limited, shape, slot), moved
