"""Round a convolution's weights so each output channel keeps its sum (its answer to a flat input).

Round-to-nearest makes every weight's error independent, so a filter's sum, what it answers to
a locally constant input, moves by a random walk of K errors: about step * sqrt(K / 12). Filters
that BatchNorm folding leaves large but nearly zero-sum (the edge and difference detectors of a
depthwise 3x3 / 5x5 layer: taps of +-8 summing to 0.02) then leak the input's local level into
their output, and after a ReLU6 layer that input is non-negative with a large mean, so the leak
is a brightness-dependent offset that the next layers amplify. On EfficientNet-Lite0 this alone
cost the first depthwise layer's output 7 dB (examples/effnet_lite/README.md).

Here the rounding of a few weights per output channel is flipped, those whose residual is closest
to one half in the needed direction, until the channel's integer sum is the nearest integer to
its float sum / scale. A flipped weight's error grows from |r| (just under 0.5 step) to 1 - |r|
(just over): the element-wise error hardly changes while the channel's sum error falls from
~sqrt(K / 12) steps to at most 0.5. The scales are not touched, so the format, the range and
every fused kernel are what round-to-nearest gives; values at the int8 limit are never flipped
outwards.
"""

from __future__ import annotations

import numpy as np

from qtool.write.params import WeightParams


def keep_channel_sums(weight: np.ndarray, params: WeightParams, limit: int = 127) -> WeightParams:
    """`params` (symmetric int8 of `weight`, per channel along axis 0 or per tensor) with each
    output channel's (axis 0) integer sum the nearest integer to the float one."""
    if params.zero_point is not None or params.axis not in (0, None) or weight.ndim < 2:
        return params
    rows = weight.shape[0]
    scale = np.asarray(params.scale, np.float64)
    scale = scale.reshape(-1, 1) if params.axis == 0 else np.full((rows, 1), float(scale))
    exact = np.asarray(weight, np.float64).reshape(rows, -1) / scale
    values = params.values.astype(np.int64).reshape(rows, -1)
    need = np.rint(exact.sum(axis=1) - values.sum(axis=1)).astype(np.int64)  # +k: add k ones
    if not need.any():
        return params
    residual = exact - values  # in [-0.5, 0.5] where not clipped
    direction = np.sign(need)[:, None]
    # Flip first the weights whose residual points furthest in the needed direction; never
    # past the limit, and never one whose flip would not reduce the channel's sum error.
    key = -residual * direction
    blocked = (values * direction >= limit) | (residual * direction <= 0)
    key = np.where(blocked, np.inf, key)
    flip = _first_in_stable_order(key, np.abs(need)) & ~blocked
    adjusted = values + flip * direction
    result = adjusted.reshape(params.values.shape).astype(params.values.dtype)
    return WeightParams(result, params.scale, params.axis, params.zero_point)


def _first_in_stable_order(key: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Mask of each row's `counts[i]` smallest keys, ties going to the lower index: what the
    first counts[i] entries of a stable argsort select, without sorting whole rows (a ResNet
    3x3 layer has rows of 4608 weights and needs a handful; the sort took a second per model)."""
    rows, width = key.shape
    most = int(min(counts.max(), width))
    if most == 0:
        return np.zeros(key.shape, dtype=bool)
    # the `most` smallest keys of each row, sorted: row i's threshold is its counts[i]-th
    smallest = np.sort(np.partition(key, most - 1, axis=1)[:, :most], axis=1)
    wanted = np.minimum(counts, width)
    active = wanted > 0
    threshold = smallest[np.arange(rows), np.maximum(wanted, 1) - 1][:, None]
    below = key < threshold
    # ties at the threshold: the lowest indices, as many as are still wanted
    remaining = wanted[:, None] - below.sum(axis=1, keepdims=True)
    at = key == threshold
    mask = below | (at & (np.cumsum(at, axis=1) <= remaining))
    mask &= active[:, None]
    return mask
