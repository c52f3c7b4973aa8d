"""Conv weights keep each output channel's sum through rounding (qtool/quantize/sum_rounding.py):
a zero-sum depthwise filter stays zero-sum, so a flat input does not leak through it."""

from __future__ import annotations

import numpy as np
import pytest

from qtool.ort.cpu import resolve_cpu
from qtool.plan.layout import WeightSlot
from qtool.plan.plan import WeightPlan
from qtool.write.params import quantize_weight
from qtool.write.sum_rounding import keep_channel_sums
from qtool.write.weight_format import choose_weight


def _edge_filters(channels: int = 64) -> np.ndarray:
    """Depthwise 3x3 filters with large taps that sum to (almost) zero, as BN folding leaves
    the edge detectors of EfficientNet-Lite's first depthwise layer."""
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(channels, 1, 3, 3)) * rng.uniform(0.5, 8, size=(channels, 1, 1, 1))
    return (weight - weight.mean(axis=(1, 2, 3), keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("axis", [0, None], ids=["per-channel", "per-tensor"])
def test_each_channel_sum_is_within_half_a_step_and_elements_within_one(axis) -> None:
    weight = _edge_filters()
    plain = quantize_weight(weight, axis)
    kept = keep_channel_sums(weight, plain)
    scale = np.asarray(plain.scale, np.float64).reshape(-1, 1, 1, 1) if axis == 0 else plain.scale
    sums = weight.astype(np.float64).sum(axis=(1, 2, 3))
    before = np.abs((plain.values * scale).sum(axis=(1, 2, 3)) - sums) / np.ravel(scale)
    after = np.abs((kept.values * scale).sum(axis=(1, 2, 3)) - sums) / np.ravel(scale)
    assert before.max() > 1.0  # round-to-nearest leaks: several steps on some channels
    assert after.max() <= 0.5 + 1e-6
    assert np.abs(kept.values * scale - weight).max() <= np.ravel(scale).max() * (1 + 1e-6)
    assert np.abs(kept.values.astype(int)).max() <= 127
    np.testing.assert_array_equal(kept.scale, plain.scale)  # only the rounding moved
    # a flat input's response: the leak is what changes, by far
    leak = lambda p: np.abs((p.values * scale).sum(axis=(1, 2, 3)) - sums).mean()  # noqa: E731
    assert leak(kept) < 0.25 * leak(plain)


def test_already_exact_sums_and_clipped_values_are_left_alone() -> None:
    weight = np.array([[[[1.0, -1.0], [0.5, -0.5]]]], np.float32)  # exact on the grid
    plain = quantize_weight(weight, 0)
    assert keep_channel_sums(weight, plain) is plain


def test_conv_weights_are_written_with_kept_sums_on_every_cpu() -> None:
    weight = _edge_filters(16)
    for cpu in ("avx2", "avx512-vnni"):
        params = choose_weight(
            weight, WeightSlot("w", 0, "depthwise", 16), WeightPlan("w"), resolve_cpu(cpu), "auto"
        )
        expected = keep_channel_sums(weight, quantize_weight(weight, 0))
        np.testing.assert_array_equal(params.values, expected.values)


def test_matmul_weights_keep_round_to_nearest() -> None:
    weight = np.random.default_rng(3).normal(size=(32, 16)).astype(np.float32)
    params = choose_weight(
        weight, WeightSlot("w", 1, "k-rows"), WeightPlan("w"), resolve_cpu("avx512-vnni"), "auto"
    )
    np.testing.assert_array_equal(params.values, quantize_weight(weight, 1).values)
