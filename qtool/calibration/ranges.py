"""Range methods: turn one tensor's statistics into the [low, high] its quantizer will cover.

Symmetric (int8, TensorRT) ranges search a threshold T on the histogram of |x| with 128 levels and
return [-T, T]. Asymmetric (uint8, ORT CPU) ranges search a non-negative tensor's positive half
with all 256 levels (after Relu every level is useful), and for signed tensors clip each side at
the searched T (entropy, MSE) or at the two tail percentiles (percentile). Every range contains 0,
as the QDQ zero point requires.
"""

from __future__ import annotations

import numpy as np

from qtool import kernels
from qtool.calibration.observers import TensorStats
from qtool.errors import CalibrationError


def one_sided_histogram(stats: TensorStats) -> tuple[np.ndarray, float]:
    """The histogram of |x| over [0, R], trimmed to the data's extent, and its bin width (the
    FP8 range search, calibration/fp8_range.py, reads it as the symmetric int8 search does)."""
    return _one_sided(stats, absolute=True)


def _one_sided(stats: TensorStats, absolute: bool) -> tuple[np.ndarray, float]:
    """Histogram over [0, R] (of |x|, or of the positive half), trimmed to the data's extent."""
    half = len(stats.counts) // 2
    positive = stats.counts[half:]
    hist = positive + stats.counts[:half][::-1] if absolute else positive.copy()
    width = stats.bin_width
    extent = max(abs(stats.minimum), abs(stats.maximum)) if absolute else max(stats.maximum, 0.0)
    # The bin holding the extreme value itself: floor + 1, not ceil, since a maximum sitting
    # exactly on a bin edge (1.0 for [0, 1] pixels) lands in the bin that starts there.
    used = int(np.floor(extent / width)) + 1 if extent > 0 else 1
    used = min(used, half)
    return hist[:used].astype(np.int64), width


# The KL search never clips more than this share of the histogram's mass (see _kl_threshold).
KL_MAX_CLIPPED_PERCENT = 1.0


def _kl_threshold(hist: np.ndarray, levels: int, device: str) -> int:
    """TensorRT's KL threshold, searched only among thresholds that keep the bulk of the tensor.

    TensorRT's divergence compares P (the candidate's bins, every clipped value piled into its
    last bin) with Q (the candidate's in-range bins quantized, normalised over their own mass).
    When most of the mass lies above a candidate, P is one spike that Q reproduces exactly, so
    the divergence falls towards 0 and the search clips the bulk of the tensor to one value. It
    happens wherever a distribution sits away from zero: on the ocr_cls MobileNetV3 the
    squeeze-excitation convolutions' outputs (1x1 maps, all in [-1.5, -0.6]) were clipped at
    -0.64, 99.98% of their values, and top-1 fell from 94% to 82%. Candidates are therefore
    limited to those clipping at most KL_MAX_CLIPPED_PERCENT of the mass; on the bell- and
    Relu-shaped tensors the search was designed for, the KL minimum clips far less (<0.6% on
    every ocr_cls tensor) and is unchanged.
    """
    if len(hist) <= levels:
        return len(hist)
    floor = kernels.percentile_bin(hist, 100.0 - KL_MAX_CLIPPED_PERCENT)
    first = max(int(np.ceil(floor)), levels) - levels  # index of candidate i = levels + first
    divergences = kernels.kl_divergences(hist, num_levels=levels, device=device)
    return levels + first + int(np.argmin(divergences[first:]))


def _search(method: str, hist: np.ndarray, levels: int, percentile: float, device: str) -> float:
    """Threshold in bins for one-sided `hist` with `levels` quantization levels."""
    if hist.sum() == 0:
        return float(len(hist))
    if method == "entropy":
        # Exact zeros (everything a Relu clamped) pile into bin 0 and quantize without error, but
        # the KL search would spend its levels on that spike and pick a far too small threshold;
        # like NVIDIA's pytorch-quantization, give bin 0 the count of its neighbour instead.
        flattened = hist.copy()
        if len(flattened) > 1:
            flattened[0] = flattened[1]
        return float(_kl_threshold(flattened, levels, device))
    if method == "percentile":
        return float(kernels.percentile_bin(hist, percentile))
    if method == "mse":
        return float(kernels.mse_threshold_bins(hist, num_steps=levels - 1, device=device))
    raise CalibrationError(f"unknown range method {method!r}")


def compute_range(
    stats: TensorStats,
    method: str,
    symmetric: bool,
    percentile: float = 99.99,
    device: str = "cpu",
) -> tuple[float, float]:
    """[low, high] for one activation tensor; low <= 0 <= high."""
    low, high = min(stats.minimum, 0.0), max(stats.maximum, 0.0)
    if method == "percentile" and percentile >= 100.0:
        method = "minmax"  # the 100th percentile is the extreme value itself
    if method == "minmax":
        if symmetric:
            bound = max(-low, high)
            return -bound, bound
        return low, high
    if symmetric:
        hist, width = _one_sided(stats, absolute=True)
        threshold = min(_search(method, hist, 128, percentile, device) * width, max(-low, high))
        return -threshold, threshold
    if stats.minimum >= 0.0:
        hist, width = _one_sided(stats, absolute=False)
        return 0.0, min(_search(method, hist, 256, percentile, device) * width, high)
    if method == "percentile":
        width = stats.bin_width
        lower = -stats.half_range + kernels.percentile_bin(stats.counts, 100.0 - percentile) * width
        upper = -stats.half_range + kernels.percentile_bin(stats.counts, percentile) * width
        return max(min(lower, 0.0), low), min(max(upper, 0.0), high)
    hist, width = _one_sided(stats, absolute=True)
    threshold = _search(method, hist, 128, percentile, device) * width
    return max(low, -threshold), min(high, threshold)
