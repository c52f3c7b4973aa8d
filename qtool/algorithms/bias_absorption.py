"""Bias absorption after cross-layer equalization (Nagel et al. 2019, section 4.1.1), with
per-channel minima measured on calibration data instead of ones derived from BatchNorm.

For an equalized pair A -> act -> B, moving c_i out of A's output channel i and into B keeps the
float function when act is shift-equivariant on the values the channel takes: act(y - c) =
act(y) - c. B then reads its input minus c in channel i, and adds back what c contributed to each
of its outputs: B's bias grows by sum over the filter taps of W_B[:, i] * c_i (depthwise B: its
channel i alone). That sum is what B computes from a constant input only where every tap reads a
real value: a zero-padded border would read 0 where the original read c_i, so a B with padding
(its own `pads`, a SAME `auto_pad` on a kernel wider than 1, or a zero Pad node between) is
skipped with that reason. Pointwise B, the depthwise -> project pairs of MobileNet and
EfficientNet, qualifies.

Per activation, with y_i A's output channel i after the equalization scale:
- Relu (and Clip(0, inf)): Relu(y - c) = Relu(y) - c exactly when y >= c, so c_i = max(0, min_i)
  over the calibration samples. What it buys: the tensor after the Relu, which is what is
  quantized, narrows from [0, max_i] to [0, max_i - c_i] in that channel.
- Clip(0, hi): as Relu, and also y <= hi (else the shifted channel would clip at hi + c instead
  of hi): only channels that never reach the bound on the calibration data (the ones cle.py may
  scale) are shifted, by c_i = max(0, min_i) <= min_i.
- none: every shift is exact for every input; c_i = (min_i + max_i) / 2 centres each channel on
  0. The tensor between A and B is quantized per tensor with 0 in its range, so its width is at
  least the widest channel's span; centring reaches that (channels that all sat above 0 with
  different offsets no longer stretch one another's range) for asymmetric and symmetric grids.

Guarantee: the absorbed model equals the equalized one (to float rounding) on every input whose
channel minima at those activations stay at or above the ones measured (and, for Clip, maxima at
or below), in particular on those calibration samples; elsewhere a shifted Relu channel outputs
at least c_i where the original gave less (it is cut at c_i instead of 0). The report gives per
pair how many channels moved, by how much, and A's output range before and after.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from qtool.algorithms.conv_pairs import ConvPair, EqualizedConv


def padding_reason(pair: ConvPair) -> str | None:
    """Why B would read zeros that stood for A's shifted values (None: it reads none)."""
    if pair.pad:
        return "a zero Pad between the activation and B reads the shifted values as 0"
    attrs = {a.name: helper.get_attribute_value(a) for a in pair.second.attribute}
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad.startswith("SAME"):
        kernel = attrs.get("kernel_shape")
        if kernel is None or any(k != 1 for k in kernel):
            return f"B pads its input (auto_pad {auto_pad}): the border reads 0, not the shift"
    if any(p != 0 for p in attrs.get("pads", [])):
        return "B pads its input with zeros: the border would read 0, not the shift"
    return None


def shifts(
    activation: str, bound: float | None, low: np.ndarray, high: np.ndarray, reaching: np.ndarray
) -> np.ndarray:
    """c_i per channel for A's output range [low, high] (after the equalization scale) on the
    calibration data; `reaching`: channels that reach a Clip's upper bound there (never moved)."""
    if activation == "none":
        return (low + high) / 2.0
    shift = np.maximum(low, 0.0)
    if activation == "Clip" and bound is not None:
        shift = np.where(reaching, 0.0, shift)
    return shift


def output_range(
    activation: str, bound: float | None, low: np.ndarray, high: np.ndarray
) -> list[float]:
    """The per-tensor range of the activation's output on the data, 0 included (what the
    asymmetric activation grid has to cover between A and B)."""
    if activation == "none":
        return [float(min(0.0, low.min())), float(max(0.0, high.max()))]
    top = float(max(0.0, high.max()))
    return [0.0, top if bound is None else min(top, bound)]


def absorb(
    pair: ConvPair,
    first: EqualizedConv,
    second: EqualizedConv,
    low: np.ndarray,
    high: np.ndarray,
    scale: np.ndarray,
) -> dict:
    """Move the shifts of one equalized pair from A's bias into B's, in place; the report entry.

    `low`, `high`: per-channel min and max of A's output on calibration data, measured before
    equalization; `scale`: the cumulative equalization scale of A's output channels (A's
    output is divided by it), so the range now is [low, high] / scale."""
    why = padding_reason(pair)
    if why is None and (first.bias is None or second.bias is None):
        why = "A or B has no bias to move the shift through"
    if why is not None:
        return {"skipped": why}
    reaching = high > (np.inf if pair.bound is None else pair.bound)  # scale 1 (cle.py)
    low, high = low / scale, high / scale
    shift = shifts(pair.activation, pair.bound, low, high, reaching)
    before = output_range(pair.activation, pair.bound, low, high)
    after = output_range(pair.activation, pair.bound, low - shift, high - shift)
    assert first.bias is not None and second.bias is not None
    first.bias -= shift
    if second.depthwise:
        second.bias += second.weight.reshape(second.weight.shape[0], -1).sum(axis=1) * shift
    else:
        second.bias += second.weight.sum(axis=(2, 3)) @ shift
    moved = shift != 0.0
    return {
        "channels_absorbed": int(moved.sum()),
        "channels": int(shift.size),
        "amount_sum": float(np.abs(shift).sum()),
        "amount_max": float(np.abs(shift).max()) if shift.size else 0.0,
        "output_range_before": before,
        "output_range_after": after,
    }
