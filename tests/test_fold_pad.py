"""Zero Pad -> Conv (TensorFlow "same" padding as its own node) folds into the Conv's pads
exactly; any other Pad stays."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qtool.model.prepare import prepare_model
from qtool.ort.sessions import create_session


def _model(pads: list[int], mode: str = "constant", value: float | None = 0.0) -> onnx.ModelProto:
    """x [1, 3, 9, 9] -> Relu -> Pad -> Conv 3x3 stride 2 (pads [1, 0, 1, 0] of its own)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array(pads, np.int64), "pads"),
    ]
    pad_inputs = ["r", "pads"]
    if value is not None:
        inits.append(numpy_helper.from_array(np.array(value, np.float32), "value"))
        pad_inputs.append("value")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Pad", pad_inputs, ["p"], name="pad", mode=mode),
        helper.make_node("Conv", ["p", "w"], ["y"], name="conv", strides=[2, 2], pads=[1, 0, 1, 0]),
    ]
    graph = helper.make_graph(
        nodes,
        "pad_conv",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 9, 9])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The model's float function as written (no graph rewrites)."""
    return create_session(model.SerializeToString(), optimize=False).run(None, {"x": x})[0]


@pytest.mark.parametrize("value", [0.0, None])
def test_a_zero_spatial_pad_folds_into_the_conv_exactly(value) -> None:
    model = _model([0, 0, 0, 1, 0, 0, 1, 2], value=value)  # asymmetric, as TF "same" pads
    x = np.random.default_rng(1).normal(size=(1, 3, 9, 9)).astype(np.float32)
    prepared = prepare_model(model)
    assert [n.op_type for n in prepared.graph.node] == ["Relu", "Conv"]
    conv = prepared.graph.node[1]
    assert conv.input[0] == "r"
    pads = next(helper.get_attribute_value(a) for a in conv.attribute if a.name == "pads")
    assert list(pads) == [1, 1, 2, 2]  # own [1, 0, 1, 0] + Pad's begins (0, 1), ends (1, 2)
    np.testing.assert_array_equal(_run(prepared, x), _run(model, x))


@pytest.mark.parametrize(
    ("pads", "mode", "value"),
    [
        ([0, 0, 1, 1, 0, 0, 1, 1], "constant", 1.0),  # not zero
        ([0, 1, 1, 1, 0, 0, 1, 1], "constant", 0.0),  # pads a channel
        ([0, 0, 1, 1, 0, 0, 1, 1], "reflect", None),  # not constant
        ([0, 0, -1, 0, 0, 0, 0, 0], "constant", 0.0),  # crops
    ],
)
def test_other_pads_are_kept(pads, mode, value) -> None:
    prepared = prepare_model(_model(pads, mode, value))
    assert [n.op_type for n in prepared.graph.node] == ["Relu", "Pad", "Conv"]
