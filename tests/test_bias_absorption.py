"""Bias absorption after CLE: the float function is kept on the calibration data (real ORT
sessions), shifts go only where the activation and B's padding allow, the recipe key is checked."""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import pytest
import yaml
from onnx import helper, numpy_helper

from benchmarks.accuracy import parse_algorithm_sets, with_algorithms
from qtool.algorithms.channel_ranges import channel_ranges
from qtool.algorithms.cle import equalize
from qtool.algorithms.spec import Algorithms, BiasCorrectionParams, CleParams
from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError
from qtool.ort.sessions import create_session

CHANNELS = 8


def _pair(activation: str, second: str) -> onnx.ModelProto:
    """Conv 3x3 (8 channels, 3 decades apart in weight, half with a large positive bias, so
    their pre-activation minimum is above 0) -> activation -> B -> output.

    B: "pointwise" 1x1, "depthwise" 3x3 without padding, "padded" 3x3 with zero padding."""
    rng = np.random.default_rng(0)
    spread = np.logspace(-1.5, 1.5, CHANNELS)
    w1 = rng.normal(size=(CHANNELS, 3, 3, 3)) * 0.05 * spread[:, None, None, None]
    # even channels sit well above 0; odd ones straddle it (never shifted through Relu)
    b1 = np.where(np.arange(CHANNELS) % 2 == 0, 1.0, 0.0) * spread
    if activation == "Clip":
        # Channels by bias: 5.5 reaches the bound of 6 (never shifted), 2.5 and 3.0 stay inside
        # (0, 6) (shifted), -0.5 crosses 0 (not shifted). The inside ones have narrow A and wide
        # B weights, so equalizing them lowers the per-tensor weight noise and the pair is kept;
        # the others are balanced already.
        b1 = np.tile([5.5, 2.5, -0.5, 3.0], 2)
        inside = (b1 > 0) & (b1 < 5)
        w1 = rng.normal(size=(CHANNELS, 3, 3, 3)) * np.where(inside, 0.02, 0.1)[:, None, None, None]
        spread = 1.0 / np.where(inside, 3.0, np.where(b1 < 0, 0.3, 1.0))  # B's are divided by it
    inits = {"w1": w1, "b1": b1}
    attrs: dict = {}
    if second == "depthwise":
        inits["w2"] = rng.normal(size=(CHANNELS, 1, 3, 3)) / spread[:, None, None, None]
        attrs = {"group": CHANNELS}
    elif second == "padded":
        inits["w2"] = rng.normal(size=(4, CHANNELS, 3, 3)) / spread[None, :, None, None]
        attrs = {"pads": [1, 1, 1, 1]}
    else:
        inits["w2"] = rng.normal(size=(4, CHANNELS, 1, 1)) / spread[None, :, None, None]
    inits["b2"] = rng.normal(size=inits["w2"].shape[0]) * 0.1
    tensors = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()]
    if activation == "Clip":
        tensors += [numpy_helper.from_array(np.float32(v), n) for v, n in [(0, "lo"), (6, "hi")]]
        nodes = [helper.make_node("Clip", ["y1", "lo", "hi"], ["a1"], name="act")]
    elif activation == "Relu":
        nodes = [helper.make_node("Relu", ["y1"], ["a1"], name="act")]
    else:  # "none": A feeds B directly
        nodes = []
    b_input = "a1" if nodes else "y1"
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="A", pads=[1, 1, 1, 1]),
            *nodes,
            helper.make_node("Conv", [b_input, "w2", "b2"], ["y"], name="B", **attrs),
        ],
        "pair",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 10, 10])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        tensors,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnx.shape_inference.infer_shapes(model)


def _calibration() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(16, 3, 10, 10)).astype(np.float32)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The model's float function as written (no graph rewrites)."""
    return create_session(model.SerializeToString(), optimize=False).run(["y"], {"x": x})[0]


def _equalize(model: onnx.ModelProto, x: np.ndarray, absorb: bool) -> dict:
    reference = onnx.ModelProto()
    reference.CopyFrom(model)  # ranges of the unequalized model (equalize edits `model`)
    return equalize(
        model,
        per_channel=False,
        ranges=lambda tensors: channel_ranges(reference, tensors, [{"x": x}]),
        bias_absorption=absorb,
        through_clip=True,
    )


def _array(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


def _exact(got: np.ndarray, want: np.ndarray) -> bool:
    return float(np.max(np.abs(got - want))) <= 1e-5 * float(np.max(np.abs(want)))


@pytest.mark.parametrize("second", ["pointwise", "depthwise"])
def test_relu_pair_is_exact_on_the_calibration_data_and_narrows_the_relu_output(second):
    model, x = _pair("Relu", second), _calibration()
    want = _run(model, x)
    minima = channel_ranges(model, ["y1"], [{"x": x}]).minima["y1"]
    assert (minima > 0).any() and (minima <= 0).any()  # the test needs both kinds of channel
    equalized = onnx.ModelProto()
    equalized.CopyFrom(model)
    _equalize(equalized, x, absorb=False)
    entry = _equalize(model, x, absorb=True)
    assert entry["bias_absorption"] is True
    (pair,) = entry["pairs"]
    absorbed = pair["bias_absorption"]
    assert absorbed["channels_absorbed"] == int((minima > 0).sum())
    assert absorbed["channels"] == CHANNELS and absorbed["samples"] == len(x)
    assert absorbed["output_range_after"][1] < absorbed["output_range_before"][1]
    assert _exact(_run(model, x), want)
    # The shift left the weights alone and moved exactly the positive-minimum channels' biases.
    np.testing.assert_array_equal(_array(model, "w1"), _array(equalized, "w1"))
    moved = _array(model, "b1") != _array(equalized, "b1")
    np.testing.assert_array_equal(moved, minima > 0)
    # After the shift each moved channel's minimum on the same data is 0: Relu cuts nothing new.
    after = channel_ranges(model, ["y1"], [{"x": x}]).minima["y1"]
    np.testing.assert_allclose(after[minima > 0], 0.0, atol=1e-5)

    # ... and what the Relu passes on (the tensor that is quantized) is narrower.
    def top(m: onnx.ModelProto) -> float:
        return float(channel_ranges(m, ["a1"], [{"x": x}]).maxima["a1"].max())

    assert top(model) < top(equalized)


def test_padded_second_layer_is_skipped_with_the_reason():
    x = _calibration()
    plain, absorbed = _pair("Relu", "padded"), _pair("Relu", "padded")
    _equalize(plain, x, absorb=False)
    entry = _equalize(absorbed, x, absorb=True)
    (pair,) = entry["pairs"]
    assert "pads its input with zeros" in pair["bias_absorption"]["skipped"]
    for name in ("b1", "b2"):
        np.testing.assert_array_equal(_array(absorbed, name), _array(plain, name))


def test_relu6_channels_that_reach_the_bound_are_not_shifted():
    model, x = _pair("Clip", "pointwise"), _calibration()
    want = _run(model, x)
    ranges = channel_ranges(model, ["y1"], [{"x": x}])
    low, high = ranges.minima["y1"], ranges.maxima["y1"]
    reaching = high > 6.0
    shiftable = ~reaching & (low > 0)
    assert (reaching & (low > 0)).any() and shiftable.any()  # both kinds are needed
    equalized = onnx.ModelProto()
    equalized.CopyFrom(model)
    _equalize(equalized, x, absorb=False)
    entry = _equalize(model, x, absorb=True)
    (pair,) = entry["pairs"]
    assert pair["activation"] == "Clip"
    assert pair["bias_absorption"]["channels_absorbed"] == int(shiftable.sum())
    assert _exact(_run(model, x), want)
    moved = _array(model, "b1") != _array(equalized, "b1")
    np.testing.assert_array_equal(moved, shiftable)
    # Without the bound check the same shift through a clipping channel changes the function.
    broken = onnx.ModelProto()
    broken.CopyFrom(equalized)
    bias = _array(equalized, "b1").copy()
    channel = int(np.flatnonzero(reaching & (low > 0))[0])
    bias[channel] -= low[channel]  # scale 1 there: the measured minimum is the equalized one
    w2 = _array(equalized, "w2")
    b2 = _array(equalized, "b2") + w2[:, channel, 0, 0] * low[channel]
    for name, value in (("b1", bias), ("b2", b2)):
        index = next(i for i, t in enumerate(broken.graph.initializer) if t.name == name)
        broken.graph.initializer[index].CopyFrom(
            numpy_helper.from_array(value.astype(np.float32), name)
        )
    assert not _exact(_run(broken, x), want)


def test_no_activation_centres_each_channel_and_is_exact_for_any_input():
    model, x = _pair("none", "pointwise"), _calibration()
    other = np.random.default_rng(5).normal(size=(4, 3, 10, 10)).astype(np.float32) * 3.0
    want, want_other = _run(model, x), _run(model, other)
    entry = _equalize(model, x, absorb=True)
    (pair,) = entry["pairs"]
    assert pair["activation"] == "none"
    assert pair["bias_absorption"]["channels_absorbed"] == CHANNELS
    before, after = (
        pair["bias_absorption"]["output_range_before"],
        pair["bias_absorption"]["output_range_after"],
    )
    assert after[1] - after[0] < before[1] - before[0]
    assert _exact(_run(model, x), want)
    assert _exact(_run(model, other), want_other)  # a linear link: exact off the data too
    ranges = channel_ranges(model, ["y1"], [{"x": x}])
    np.testing.assert_allclose(ranges.minima["y1"], -ranges.maxima["y1"], atol=1e-4)


def test_without_calibration_data_nothing_is_absorbed():
    model = _pair("Relu", "pointwise")
    before = _array(model, "b2").copy()
    entry = equalize(model, per_channel=False, bias_absorption=True)
    (pair,) = entry["pairs"]
    assert "needs calibration data" in pair["bias_absorption"]["skipped"]
    assert np.allclose(_array(model, "b2"), before)


def _recipe(tmp_path, params) -> object:
    (tmp_path / "model.onnx").write_bytes(b"only its existence is checked here")
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, 3, 10, 10]},
        "calibration": {"data": {"synthetic": True}},
        "quantization": {"algorithms": {"cross_layer_equalization": params}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_the_recipe_parameter_defaults_to_off_and_rejects_non_booleans(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, {"samples": 64}))
    assert recipe.algorithms.cross_layer_equalization == CleParams(
        samples=64, bias_absorption=False, through_clip=False
    )
    on = load_recipe(_recipe(tmp_path, {"bias_absorption": True}))
    assert on.algorithms.cross_layer_equalization.bias_absorption is True
    with pytest.raises(RecipeError) as caught:
        load_recipe(_recipe(tmp_path, {"bias_absorption": "yes please"}))
    message = str(caught.value)
    key = "quantization.algorithms.cross_layer_equalization.bias_absorption"
    assert f" {key}: must be true or false, got " in message, message
    assert "\n" not in message


def test_the_benchmark_spells_the_parameter_in_brackets(tmp_path):
    sets = parse_algorithm_sets(
        "cross_layer_equalization[bias_absorption=true]+bias_correction,none"
    )
    assert sets == [("cross_layer_equalization[bias_absorption=true]", "bias_correction"), ()]
    recipe = with_algorithms(load_recipe(_recipe(tmp_path, {})), sets[0])
    assert recipe.algorithms == Algorithms(
        cross_layer_equalization=CleParams(samples=512, bias_absorption=True, through_clip=False),
        bias_correction=BiasCorrectionParams(samples=256),
    )
    with pytest.raises(argparse.ArgumentTypeError, match="bias_absorption: must be true or"):
        parse_algorithm_sets("cross_layer_equalization[bias_absorption=7]")
