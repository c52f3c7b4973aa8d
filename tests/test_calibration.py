"""Streaming observers and range methods against direct numpy computations on the same data."""

from __future__ import annotations

import numpy as np
import pytest

from qtool.calibration.observers import HistogramObserver
from qtool.calibration.ranges import compute_range
from qtool.errors import CalibrationError

BINS = 4096  # signed bins over [-R, R]


def _observe(chunks: list[np.ndarray]) -> HistogramObserver:
    observer = HistogramObserver("t", BINS)
    for chunk in chunks:
        observer.update(chunk)
    return observer


def _numpy_histogram(values: np.ndarray, half_range: float) -> np.ndarray:
    edges = np.linspace(-half_range, half_range, BINS + 1)
    counts, _ = np.histogram(values.astype(np.float64), bins=edges)
    return counts


def test_growing_range_equals_one_pass_histogram_at_final_range():
    rng = np.random.default_rng(0)
    # Magnitudes grow batch by batch, forcing several range doublings (incl. from all-zero data).
    chunks = [np.zeros((3, 5), np.float32)] + [
        (rng.standard_normal((8, 50)) * scale).astype(np.float32) for scale in (0.01, 0.3, 2, 9)
    ]
    stats = _observe(chunks).result()
    values = np.concatenate([c.ravel() for c in chunks])
    bound = np.abs(values).max()
    assert stats.half_range > bound >= stats.half_range / 2
    assert np.log2(stats.half_range).is_integer()
    np.testing.assert_array_equal(stats.counts, _numpy_histogram(values, stats.half_range))
    assert stats.minimum == values.min() and stats.maximum == values.max()


def test_statistics_do_not_depend_on_batching_or_order():
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((64, 30)) * rng.uniform(0.1, 5, (64, 1))).astype(np.float32)
    whole = _observe([data]).result()
    ones = _observe([data[i : i + 1] for i in range(64)]).result()
    reversed_order = _observe([data[i : i + 1] for i in reversed(range(64))]).result()
    for other in (ones, reversed_order):
        assert other.half_range == whole.half_range
        np.testing.assert_array_equal(other.counts, whole.counts)
        assert (other.minimum, other.maximum) == (whole.minimum, whole.maximum)


def test_nan_in_a_tensor_is_an_error_naming_it():
    observer = HistogramObserver("layer3/out", BINS)
    with pytest.raises(CalibrationError, match="layer3/out"):
        observer.update(np.array([1.0, np.nan], np.float32))


def _stats_of(values: np.ndarray):
    return _observe([values.astype(np.float32)]).result()


def test_minmax_ranges():
    values = np.array([-1.5, 0.25, 3.0], np.float32)
    stats = _stats_of(values)
    assert compute_range(stats, "minmax", symmetric=False) == (-1.5, 3.0)
    assert compute_range(stats, "minmax", symmetric=True) == (-3.0, 3.0)
    positive = _stats_of(np.array([0.5, 2.0], np.float32))
    assert compute_range(positive, "minmax", symmetric=False) == (0.0, 2.0)


def test_percentile_matches_numpy_within_one_bin():
    rng = np.random.default_rng(2)
    values = rng.standard_normal(200_000).astype(np.float32)
    stats = _stats_of(values)
    low, high = compute_range(stats, "percentile", symmetric=False, percentile=99.9)
    width = stats.bin_width
    assert abs(high - np.percentile(values, 99.9)) <= width
    assert abs(low - np.percentile(values, 0.1)) <= width
    _, sym_high = compute_range(stats, "percentile", symmetric=True, percentile=99.9)
    assert abs(sym_high - np.percentile(np.abs(values), 99.9)) <= width


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_clipping_methods_cut_rare_outliers(method):
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.standard_normal(100_000), [60.0, -55.0]]).astype(np.float32)
    stats = _stats_of(values)
    low, high = compute_range(stats, method, symmetric=True)
    assert low == -high
    assert 2.5 < high < 20.0, (method, high)


@pytest.mark.parametrize("method", ["entropy", "mse"])
def test_relu_outputs_keep_their_bulk(method):
    """Half the values are exact zeros (a Relu output): the range must still cover the bulk of
    the positive values, not collapse onto the zero spike."""
    rng = np.random.default_rng(4)
    values = np.maximum(rng.standard_normal(200_000), 0.0).astype(np.float32)
    stats = _stats_of(values)
    low, high = compute_range(stats, method, symmetric=False)
    positive = values[values > 0]
    assert low == 0.0
    assert np.percentile(positive, 99) < high <= values.max()


def _fake_quant_mse(values: np.ndarray, threshold: float) -> float:
    step = threshold / 127.0
    quantized = np.clip(np.round(values / step), -127, 127) * step
    return float(np.mean((values - quantized) ** 2))


def test_mse_threshold_is_near_the_brute_force_optimum():
    rng = np.random.default_rng(5)
    values = rng.laplace(size=100_000).astype(np.float32)
    stats = _stats_of(values)
    _, high = compute_range(stats, "mse", symmetric=True)
    bound = float(np.abs(values).max())
    grid = np.linspace(bound / 20, bound, 400)
    errors = [_fake_quant_mse(values, t) for t in grid]
    best = min(errors)
    assert _fake_quant_mse(values, high) <= best * 1.05
    assert high < bound  # on a heavy tail the optimum clips


@pytest.mark.parametrize("method", ["entropy", "percentile", "mse"])
def test_a_maximum_on_a_bin_edge_is_not_clipped_away(method):
    """Digits-like pixels k/16: the maximum 1.0 is a bin edge, and its bin must be searched."""
    rng = np.random.default_rng(6)
    values = (rng.integers(0, 17, 100_000) / 16).astype(np.float32)
    stats = _stats_of(values)
    assert (1.0 / stats.bin_width).is_integer()
    low, high = compute_range(stats, method, symmetric=False)
    assert low == 0.0 and high == pytest.approx(1.0, abs=0.01)  # not 15/16: the top level kept
