"""Cross-layer equalization: exact on the float model, equal channel ranges, lower per-tensor
INT8 error on a depthwise chain built with badly mismatched channels, near misses reported."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qtool.algorithms.channel_ranges import channel_ranges
from qtool.algorithms.cle import _convs, _input_ranges, _output_ranges, equalize
from qtool.app.common import prepare
from qtool.config.recipe import load_recipe
from qtool.ort.sessions import create_session

CHANNELS = 8


def _chain(middle: str = "Relu", seed: int = 0, pad: bool = False) -> onnx.ModelProto:
    """Conv 3x3 (8 ch) -> act -> depthwise 3x3 -> Relu -> Conv 1x1, channels 3 decades apart.
    `pad`: the depthwise layer's padding done by a zero Pad node before it (TF "same" style)."""
    rng = np.random.default_rng(seed)
    spread = np.logspace(-1.5, 1.5, CHANNELS).astype(np.float32)
    w1 = rng.normal(size=(CHANNELS, 3, 3, 3)).astype(np.float32) * spread[:, None, None, None]
    b1 = rng.normal(size=CHANNELS).astype(np.float32) * spread
    dw = rng.normal(size=(CHANNELS, 1, 3, 3)).astype(np.float32) / spread[:, None, None, None]
    bdw = rng.normal(size=CHANNELS).astype(np.float32) * 0.1
    w3 = rng.normal(size=(4, CHANNELS, 1, 1)).astype(np.float32)
    b3 = np.zeros(4, np.float32)
    inits = [
        numpy_helper.from_array(a, n)
        for a, n in [(w1, "w1"), (b1, "b1"), (dw, "dw"), (bdw, "bdw"), (w3, "w3"), (b3, "b3")]
    ]
    if middle == "Clip":
        inits += [numpy_helper.from_array(np.float32(v), n) for v, n in [(0, "lo"), (6, "hi")]]
        act = helper.make_node("Clip", ["y1", "lo", "hi"], ["a1"], name="act1")
    else:
        act = helper.make_node(middle, ["y1"], ["a1"], name="act1")
    dw_input, dw_pads, padding = "a1", [1, 1, 1, 1], []
    if pad:
        inits.append(numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pp"))
        padding = [helper.make_node("Pad", ["a1", "pp"], ["p1"], name="pad", mode="constant")]
        dw_input, dw_pads = "p1", [0, 0, 0, 0]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="conv1", pads=[1, 1, 1, 1]),
        act,
        *padding,
        helper.make_node(
            "Conv", [dw_input, "dw", "bdw"], ["y2"], name="dw", pads=dw_pads, group=CHANNELS
        ),
        helper.make_node("Relu", ["y2"], ["a2"], name="act2"),
        helper.make_node("Conv", ["a2", "w3", "b3"], ["y"], name="conv3"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 10, 10])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4, 10, 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnx.shape_inference.infer_shapes(model)  # types of y1 etc.: the maxima pass reads them


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The model's float function as written (no graph rewrites)."""
    return create_session(model.SerializeToString(), optimize=False).run(None, {"x": x})[0]


def _per_tensor_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every Conv weight rounded to one symmetric INT8 grid for the whole tensor."""
    rounded = onnx.ModelProto()
    rounded.CopyFrom(model)
    for init in rounded.graph.initializer:
        if init.name in {"w1", "dw", "w3"}:
            w = numpy_helper.to_array(init)
            step = np.abs(w).max() / 127
            init.CopyFrom(
                numpy_helper.from_array((np.round(w / step) * step).astype(np.float32), init.name)
            )
    return rounded


def _input() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(2, 3, 10, 10)).astype(np.float32)


def test_the_float_function_is_unchanged_and_both_pairs_are_equalized():
    model, x = _chain(), _input()
    want = _run(model, x)
    entry = equalize(model, per_channel=False)
    got = _run(model, x)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    assert [(p["first"], p["second"]) for p in entry["pairs"]] == [("conv1", "dw"), ("dw", "conv3")]
    assert entry["pairs"][0]["depthwise"] == [False, True]
    assert all(p["range_spread_after"] < p["range_spread_before"] for p in entry["pairs"])
    # After the turns settle, each pair's channel ranges match (the middle layer is shared).
    convs = _convs(model)
    np.testing.assert_allclose(
        _output_ranges(convs["dw"]), _input_ranges(convs["conv3"]), rtol=1e-3
    )


def test_per_tensor_int8_error_drops_on_a_mismatched_depthwise_chain():
    x = _input()
    plain = _chain()
    want = _run(plain, x)
    equalized = _chain()
    equalize(equalized, per_channel=False)

    def error(model: onnx.ModelProto) -> float:
        return float(np.mean((_run(_per_tensor_int8(model), x) - want) ** 2))

    assert error(equalized) < 0.1 * error(plain)


@pytest.mark.parametrize(
    ("middle", "through_clip", "why"),
    [
        ("Clip", True, "needs calibration data"),
        ("Clip", False, "exact only on data like the calibration samples"),
        ("Sigmoid", True, "not scale-equivariant"),
    ],
)
def test_clip_and_other_activations_are_left_alone_with_the_reason(middle, through_clip, why):
    """A Clip(0, 6) pair has no rescaling exact on every input: skipped unless the recipe asks
    (and then it needs calibration data to bound the scales); Sigmoid is never equalized."""
    model = _chain(middle)
    before = {i.name: numpy_helper.to_array(i).copy() for i in model.graph.initializer}
    x = _calibration()

    def ranges(tensors: list[str]):
        return channel_ranges(_chain(middle), tensors, [{"x": x}])

    entry = equalize(
        model,
        per_channel=False,
        ranges=None if through_clip else ranges,
        through_clip=through_clip,
    )
    reasons = {(s["first"], s["second"]): s["why"] for s in entry["skipped"]}
    assert why in reasons[("conv1", "dw")]
    assert "warning" not in entry  # nothing was equalized through the Clip
    assert ("conv1", "dw") not in [(p["first"], p["second"]) for p in entry["pairs"]]
    after = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    np.testing.assert_array_equal(after["w1"], before["w1"])  # the Clip pair's first layer


def _calibration() -> np.ndarray:
    """Inputs large enough that conv1's widest channels pass 6 and its narrow ones never do."""
    return np.random.default_rng(2).normal(size=(16, 3, 10, 10)).astype(np.float32) * 2.0


def _equalize_on_data(model: onnx.ModelProto, x: np.ndarray, per_channel: bool = False) -> dict:
    reference = onnx.ModelProto()
    reference.CopyFrom(model)  # maxima of the unequalized model (equalize edits `model`)
    return equalize(
        model,
        per_channel=per_channel,
        ranges=lambda tensors: channel_ranges(reference, tensors, [{"x": x}]),
        through_clip=True,
    )


def test_relu6_pair_is_exact_on_the_calibration_data_and_clipping_channels_keep_scale_1():
    model, x = _chain("Clip"), _calibration()
    want = _run(model, x)
    maxima = channel_ranges(model, ["y1"], [{"x": x}]).maxima["y1"]
    reaching = maxima > 6.0
    assert reaching.any() and (~reaching).any()  # the test needs both kinds of channel
    w1 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w1")).copy()
    entry = _equalize_on_data(model, x)
    pair = next(p for p in entry["pairs"] if (p["first"], p["second"]) == ("conv1", "dw"))
    assert pair["activation"] == "Clip" and pair["clip_bound"] == 6.0
    assert "1 pair(s) through Clip" in entry["warning"] and "model.fp32.onnx" in entry["warning"]
    assert pair["channels"] == CHANNELS and pair["maxima_samples"] == len(x)
    assert pair["channels_left_unscaled"] == int(reaching.sum())
    assert pair["channels_clamped"] >= 1  # a narrow channel wanted more than 6 / max allows
    got = _run(model, x)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    after = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w1"))
    np.testing.assert_array_equal(after[reaching], w1[reaching])  # scale exactly 1
    assert not np.allclose(after[~reaching], w1[~reaching])
    # Each channel that did not reach the bound still does not: max / scale <= 6 (the Clip
    # input of the equalized model on the same data).
    new_maxima = channel_ranges(model, ["y1"], [{"x": x}]).maxima["y1"]
    assert np.all(new_maxima[~reaching] <= 6.0 * (1 + 1e-5))


def test_relu6_equalization_is_not_exact_without_the_clamp():
    """Why the data pass is needed: the unclamped CLE scales (the ones a Relu allows) put into
    the Clip(0, 6) chain change its float function on the same data."""
    x = _calibration()
    clipped = _chain("Clip")
    want = _run(clipped, x)
    relu = _chain("Relu")
    equalize(relu, per_channel=False)
    scaled = {i.name: i for i in relu.graph.initializer}
    for index, init in enumerate(clipped.graph.initializer):
        if init.name in scaled:
            clipped.graph.initializer[index].CopyFrom(scaled[init.name])
    assert np.max(np.abs(_run(clipped, x) - want)) > 1e-2 * np.max(np.abs(want))


def test_a_zero_pad_between_the_activation_and_the_second_layer_is_passed():
    for middle in ("Relu", "Clip"):
        model, x = _chain(middle, pad=True), _calibration()
        want = _run(model, x)
        entry = _equalize_on_data(model, x)
        pair = next(p for p in entry["pairs"] if (p["first"], p["second"]) == ("conv1", "dw"))
        assert pair["zero_pad_between"] is True
        assert np.max(np.abs(_run(model, x) - want)) <= 1e-5 * np.max(np.abs(want))


def test_a_tensor_read_twice_is_not_rescaled():
    model = _chain()
    model.graph.output.append(helper.make_tensor_value_info("a1", onnx.TensorProto.FLOAT, None))
    entry = equalize(model, per_channel=False)
    assert ("conv1", "dw") not in [(p["first"], p["second"]) for p in entry["pairs"]]


def test_digits_with_cle_reports_its_pair_and_keeps_accuracy(digits_dir, cli, tmp_path):
    recipe = digits_dir / "cle.yaml"
    recipe.write_text(
        "base: recipe.yaml\nquantization:\n  per_channel: false\n"
        "  algorithms: {cross_layer_equalization: {bias_absorption: true}}\n"
    )
    out = tmp_path / "cle"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "report.json").read_text())["algorithms"]
    pairs = entry["cross_layer_equalization"]["pairs"]
    assert [(p["first"], p["second"]) for p in pairs] == [("/conv1/Conv", "/conv2/Conv")]
    assert pairs[0]["weight_noise_after"] < pairs[0]["weight_noise_before"]
    # conv2 is a 3x3 with zero padding: its border would read 0 where a shifted channel was
    assert entry["cross_layer_equalization"]["bias_absorption"] is True
    assert "pads its input" in pairs[0]["bias_absorption"]["skipped"]
    # The float model written is the equalized one: calibration ran on what is quantized.
    written = {
        i.name: numpy_helper.to_array(i)
        for i in onnx.load(out / "model.fp32.onnx").graph.initializer
    }
    plain = prepare(load_recipe(digits_dir / "recipe.yaml", output_dir=tmp_path / "plain"))
    unequalized = {i.name: numpy_helper.to_array(i) for i in plain.model.model.graph.initializer}
    conv1 = next(n for n in plain.model.model.graph.node if n.name == "/conv1/Conv")
    assert not np.allclose(written[conv1.input[1]], unequalized[conv1.input[1]])
    assert (
        prepare(load_recipe(recipe, output_dir=tmp_path / "again")).model.fingerprint
        != plain.model.fingerprint
    )
