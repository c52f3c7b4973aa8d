"""Model tensors that disagree with themselves name the tensor (issue 21, item 4, model part).

Two cases from the issue: a MatMul weight of shape [64, 0] failed as `channel_minmax: empty
tensor (shape (64, 0))`, naming a kernel; an initializer whose dims claim 10**53 elements over
16 bytes failed inside shape inference, naming a node output. Both now say which node and
tensor of the user's model is wrong, and how, in one line, exit 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import ModelError
from qtool.model.external_data import raw_nbytes
from qtool.model.load import check_initializers


def _matmul_model(weight: onnx.TensorProto, k: int = 64) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", weight.name], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _recipe(folder: Path, model: onnx.ModelProto, k: int = 64) -> Path:
    onnx.save(model, folder / "model.onnx")
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, k]},
        "calibration": {"data": {"synthetic": True, "samples": 8}, "method": "minmax"},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _one_line(result) -> str:
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    return line


def test_empty_matmul_weight_names_node_and_weight(tmp_path: Path, cli) -> None:
    weight = numpy_helper.from_array(np.zeros((64, 0), np.float32), "w_empty")
    recipe = _recipe(tmp_path, _matmul_model(weight))
    line = _one_line(cli("quantize", recipe, "-o", tmp_path / "out", "--no-progress"))
    assert "node 'mm' (MatMul)" in line and "weight 'w_empty'" in line, line
    assert "[64, 0]" in line and "no values" in line and "channel_minmax" not in line, line


def _claiming(dims: list[int], data: bytes = b"\0" * 16) -> onnx.TensorProto:
    tensor = TensorProto()
    tensor.name, tensor.data_type = "w_big", TensorProto.FLOAT
    tensor.dims.extend(dims)
    tensor.raw_data = data
    return tensor


@pytest.mark.parametrize(
    "dims", [[10**18, 10**18, 10**17], [64, 10**18], [64, 8]], ids=["1e53", "6.4e19", "512"]
)
def test_initializer_dims_that_disagree_with_its_data(tmp_path: Path, cli, dims) -> None:
    recipe = _recipe(tmp_path, _matmul_model(_claiming(dims)))
    line = _one_line(cli("calibrate", recipe, "-o", tmp_path / "out", "--no-progress"))
    assert str(tmp_path / "model.onnx") in line and "initializer 'w_big'" in line, line
    assert f"dims {dims}" in line and "holds 16 bytes of data" in line, line
    assert "cannot be inferred" not in line


def test_typed_data_count_is_checked() -> None:
    tensor = helper.make_tensor("w", TensorProto.FLOAT, [4, 8], [0.0] * 32)
    del tensor.float_data[3:]
    with pytest.raises(ModelError, match=r"'w' has dims \[4, 8\] .* holds 3 values in float_data"):
        check_initializers(_matmul_model(tensor, 4), "m.onnx")


def test_negative_dim_is_refused() -> None:
    tensor = helper.make_tensor("w", TensorProto.FLOAT, [4, 8], [0.0] * 32)
    tensor.dims[1] = -8
    with pytest.raises(ModelError, match=r"m\.onnx: initializer 'w' has a negative dimension"):
        check_initializers(_matmul_model(tensor, 4), "m.onnx")


def test_consistent_initializers_pass() -> None:
    weights = [
        numpy_helper.from_array(np.ones((4, 8), np.float32), "raw"),
        helper.make_tensor("typed", TensorProto.FLOAT, [4, 8], [0.0] * 32),
        helper.make_tensor("int4", TensorProto.INT4, [3], [1, -2, 3]),
        numpy_helper.from_array(np.zeros((0, 8), np.float32), "empty"),
    ]
    for weight in weights:
        check_initializers(_matmul_model(weight, 4), "m.onnx")


def test_raw_nbytes_does_not_wrap() -> None:
    assert raw_nbytes(_claiming([64, 10**18])) == 64 * 10**18 * 4
    assert raw_nbytes(_claiming([10**18, 10**18, 10**17])) == 4 * 10**53
