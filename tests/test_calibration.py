"""Streaming observers and range methods against direct numpy computations on the same data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qtool import kernels
from qtool.calibration import collect
from qtool.calibration.observers import HistogramObserver
from qtool.calibration.ranges import compute_range
from qtool.data.batches import Batch
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


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_entropy_keeps_a_distribution_that_sits_away_from_zero(sign, symmetric):
    """Like ocr_cls's squeeze-excitation convolution outputs (all in [-1.5, -0.6]): TensorRT's
    KL divergence falls towards 0 for thresholds below the bulk, which used to clip 99.98% of
    the values to one level. The range must keep (nearly) all of them."""
    rng = np.random.default_rng(8)
    values = (sign * rng.uniform(0.6, 1.5, 200_000)).astype(np.float32)
    stats = _stats_of(values)
    low, high = compute_range(stats, "entropy", symmetric=symmetric)
    inside = np.mean((values >= low) & (values <= high))
    assert inside >= 0.99, (low, high, inside)


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


def test_observer_statistics_are_identical_on_every_isa_and_thread_count():
    """The fused pass (speculative histogram, second pass only when the range grows) against the
    scalar kernels and numpy, over batches that grow the range, stay inside it and hold zeros."""
    rng = np.random.default_rng(7)
    chunks = [
        np.maximum(rng.standard_normal((16, 5000)) * s, 0).astype(np.float32)
        for s in (0.5, 0.4, 3.0, 2.9, 0.1)
    ]  # grow, inside, grow, inside, inside
    chunks[1][0, :7] = -0.0
    results = []
    try:
        for isa in kernels.supported_cpu_isas():
            kernels.set_cpu_isa(isa)
            for threads in (1, 2):
                kernels.set_cpu_threads(threads)
                results.append(_observe(chunks).result())
    finally:
        kernels.set_cpu_isa(None)
        kernels.set_cpu_threads(None)
    values = np.concatenate([c.ravel() for c in chunks])
    first = results[0]
    np.testing.assert_array_equal(first.counts, _numpy_histogram(values, first.half_range))
    for other in results[1:]:
        assert other.half_range == first.half_range
        np.testing.assert_array_equal(other.counts, first.counts)
        assert (other.minimum, other.maximum, other.samples) == (0.0, values.max(), 80)
        assert np.signbit(other.minimum)  # the -0.0s order below +0.0 everywhere


def test_signed_zero_minimum_does_not_depend_on_batch_order():
    a = np.array([0.0, 1.0], np.float32)
    b = np.array([-0.0, 2.0], np.float32)
    for order in ([a, b], [b, a]):
        stats = _observe(order).result()
        assert stats.minimum == 0.0 and np.signbit(stats.minimum)


def _tiny_model() -> onnx.ModelProto:
    """x -> MatMul(w) -> h -> Relu -> y, with h's type inferred (what calibration observes)."""
    w = numpy_helper.from_array(
        np.random.default_rng(8).standard_normal((6, 4)).astype(np.float32), "w"
    )
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


def test_collect_statistics_runs_ort_from_a_file_and_leaves_the_model_unchanged(monkeypatch):
    """...from a file (no model bytes held), without ORT threads spinning through the observers."""
    model = _tiny_model()
    before = model.SerializeToString()
    opened = []
    real = collect.create_session

    options = []

    def spy(source, **kwargs):
        opened.append(source)
        session = real(source, **kwargs)
        options.append(session.get_session_options())
        return session

    monkeypatch.setattr(collect, "create_session", spy)
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((5, 6)).astype(np.float32) for _ in range(3)]
    stats = collect.collect_statistics(
        model, ["x", "h"], [Batch({"x": x}, None) for x in xs], bins=BINS // 2, progress=False
    )
    assert len(opened) == 1 and isinstance(opened[0], Path)  # a path: no model bytes kept
    assert options[0].get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert not opened[0].exists()  # the temporary file is gone
    assert model.SerializeToString() == before
    weight = numpy_helper.to_array(model.graph.initializer[0])
    for s, values in zip(stats, (np.concatenate(xs), np.concatenate(xs) @ weight), strict=True):
        assert s.samples == 15
        assert s.minimum == pytest.approx(values.min(), rel=1e-6)
        assert s.maximum == pytest.approx(values.max(), rel=1e-6)
        assert s.counts.sum() == values.size


def test_extra_outputs_appended_to_a_serialized_copy_equal_a_fresh_serialization(tmp_path):
    """collect builds the calibration model from the staged float file plus a tail message
    (protobuf merges concatenated messages): it must parse to exactly what serializing the
    model with the outputs appended gives, and ORT must fetch the extra outputs from it."""
    model = _tiny_model()
    staged = tmp_path / "float.onnx"
    staged.write_bytes(model.SerializeToString())
    fresh, copied = tmp_path / "fresh.onnx", tmp_path / "copied.onnx"
    collect.save_with_extra_outputs(model, ["h", "x"], fresh)
    collect.save_with_extra_outputs(model, ["h", "x"], copied, serialized=staged)
    parsed = onnx.load(str(copied))
    assert parsed.SerializeToString() == fresh.read_bytes()
    assert [o.name for o in parsed.graph.output] == ["y", "h", "x"]
    x = np.random.default_rng(3).standard_normal((2, 6)).astype(np.float32)
    h, y = collect.create_session(copied).run(["h", "y"], {"x": x})
    weight = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(h, x @ weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y, np.maximum(h, 0))
