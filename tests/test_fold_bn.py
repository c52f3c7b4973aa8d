"""BatchNormalization folding: exact in ONNX Runtime for every producer, and what it buys.

A graph with BN left between a Conv and its QuantizeLinear runs that Conv in float in ORT; the
end-to-end test checks, from ORT's own optimised graph (via the report's runtime truth), that a
BN-left export quantizes into fused QLinearConv after preparation.
"""

from __future__ import annotations

import textwrap
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from qtool.model.prepare import prepare_model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _bn_model(op: str, weight: np.ndarray, x_shape: list[int], bias: bool, **attrs):
    rng = np.random.default_rng(0)
    channels = {
        "Conv": weight.shape[0],
        "ConvTranspose": weight.shape[1] * attrs.get("group", 1),
        "Gemm": weight.shape[0] if attrs.get("transB") else weight.shape[1],
        "MatMul": weight.shape[1],
    }[op]
    inits = [numpy_helper.from_array(weight.astype(np.float32), "w")]
    inputs = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b"))
        inputs.append("b")
    params = {
        "gamma": rng.uniform(0.5, 2.0, channels),
        "beta": rng.standard_normal(channels),
        "mean": rng.standard_normal(channels),
        "var": rng.uniform(0.1, 2.0, channels),
    }
    inits += [numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()]
    nodes = [
        helper.make_node(op, inputs, ["y0"], name="producer", **attrs),
        helper.make_node(
            "BatchNormalization", ["y0", "gamma", "beta", "mean", "var"], ["y"], epsilon=1e-3
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


_RNG = np.random.default_rng(1)
CASES = {
    "conv": ("Conv", _RNG.standard_normal((8, 3, 3, 3)), [2, 3, 9, 9], {}),
    "conv-no-bias": ("Conv", _RNG.standard_normal((8, 3, 3, 3)), [2, 3, 9, 9], {"bias": False}),
    "depthwise": ("Conv", _RNG.standard_normal((6, 1, 3, 3)), [2, 6, 9, 9], {"group": 6}),
    "group-conv": ("Conv", _RNG.standard_normal((8, 2, 3, 3)), [2, 4, 9, 9], {"group": 2}),
    "conv-transpose": (
        "ConvTranspose",
        _RNG.standard_normal((4, 3, 3, 3)),
        [2, 4, 5, 5],
        {"group": 2},
    ),
    "gemm": ("Gemm", _RNG.standard_normal((16, 8)), [4, 16], {"alpha": 0.5, "beta": 2.0}),
    "gemm-transB": ("Gemm", _RNG.standard_normal((8, 16)), [4, 16], {"transB": 1}),
    # A bias-free Linear + BatchNorm1d: even the default TorchScript export keeps this BN.
    "matmul": ("MatMul", _RNG.standard_normal((16, 8)), [4, 16], {"bias": False}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_folding_is_exact_and_removes_every_batch_norm(case: str) -> None:
    op, weight, x_shape, attrs = CASES[case]
    attrs = dict(attrs)
    bias = attrs.pop("bias", True)
    model = _bn_model(op, weight, x_shape, bias, **attrs)
    prepared = prepare_model(model)
    assert not any(n.op_type == "BatchNormalization" for n in prepared.graph.node)
    assert [n.op_type for n in prepared.graph.node] == ["Gemm" if op == "MatMul" else op]
    assert prepared.graph.node[0].name == "producer"
    x = np.random.default_rng(2).standard_normal(x_shape).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-4, atol=1e-4)


def test_batch_norm_after_a_shared_output_is_left_alone() -> None:
    model = _bn_model("Conv", np.ones((4, 3, 1, 1)), [1, 3, 4, 4], True)
    model.graph.output.append(helper.make_tensor_value_info("y0", TensorProto.FLOAT, None))
    prepared = prepare_model(model)
    assert any(n.op_type == "BatchNormalization" for n in prepared.graph.node)


def test_batch_norm_after_a_3d_matmul_is_left_alone() -> None:
    # [B, C, K] @ [K, N] normalises the last axis; BatchNormalization normalises axis 1. With
    # C == N the shapes would line up, the math would not.
    model = _bn_model("MatMul", np.ones((6, 4)), [2, 4, 6], False)
    prepared = prepare_model(model)
    assert [n.op_type for n in prepared.graph.node] == ["MatMul", "BatchNormalization"]


def test_chained_batch_norms_fold_into_one_conv() -> None:
    model = _bn_model("Conv", _RNG.standard_normal((4, 3, 3, 3)), [1, 3, 6, 6], False)
    rng = np.random.default_rng(4)
    second = {"g2": rng.uniform(0.5, 2.0, 4), "b2": rng.standard_normal(4)}
    second |= {"m2": rng.standard_normal(4), "v2": rng.uniform(0.1, 2.0, 4)}
    model.graph.initializer.extend(
        numpy_helper.from_array(v.astype(np.float32), k) for k, v in second.items()
    )
    model.graph.node[1].output[0] = "y1"
    model.graph.node.append(
        helper.make_node("BatchNormalization", ["y1", "g2", "b2", "m2", "v2"], ["y"])
    )
    prepared = prepare_model(model)
    assert [n.op_type for n in prepared.graph.node] == ["Conv"]
    x = np.random.default_rng(5).standard_normal((1, 3, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-4, atol=1e-4)


BN_LEFT_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def make_model():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
        )
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        return model.eval()
    """
)


def test_bn_left_export_quantizes_into_fused_convs(tmp_path) -> None:
    from qtool.app.quantize import quantize
    from qtool.config.recipe import load_recipe

    namespace: dict = {}
    exec(BN_LEFT_SOURCE, namespace)  # noqa: S102 - the model source the test defines above
    module = namespace["make_model"]()
    path = tmp_path / "bn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (torch.randn(2, 3, 8, 8),),
            str(path),
            input_names=["x"],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            dynamo=True,
            optimize=False,
            verbose=False,
        )
    exported = onnx.load(str(path))
    assert sum(n.op_type == "BatchNormalization" for n in exported.graph.node) == 2
    (tmp_path / "recipe.yaml").write_text(
        "model: {onnx: bn.onnx}\ninputs: {x: [1, 3, 8, 8]}\n"
        "calibration: {data: {synthetic: true, samples: 16}, method: minmax}\n"
        "output: {dir: out}\n"
    )
    recipe = load_recipe(tmp_path / "recipe.yaml")
    result = quantize(recipe, progress=False)
    convs = [n for n in result.report["nodes"] if n["op_type"] == "Conv"]
    assert len(convs) == 2
    assert all(n["runtime"]["status"] == "fused" for n in convs), convs
    assert all(n["runtime"]["runs_as"] == "QLinearConv" for n in convs)
    assert not any(n["op_type"] == "BatchNormalization" for n in result.report["nodes"])
    x = np.random.default_rng(3).standard_normal((4, 3, 8, 8)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    float_model = onnx.load(str(recipe.float_model_path))
    np.testing.assert_allclose(_run(float_model, x), expected, rtol=1e-4, atol=1e-4)


BN1D_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def make_model():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4),
        )
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
        return model.eval()
    """
)


def test_default_torch_export_of_linear_batchnorm1d_quantizes_into_qgemm(tmp_path) -> None:
    """qtool's own TorchScript export (constant folding on) keeps MatMul -> BatchNormalization."""
    from qtool.app.quantize import quantize
    from qtool.config.recipe import load_recipe
    from qtool.model.load import load_model

    (tmp_path / "model.py").write_text(BN1D_SOURCE)
    (tmp_path / "recipe.yaml").write_text(
        "model: {pytorch: model.py:make_model}\ninputs: {x: [1, 16]}\n"
        "calibration: {data: {synthetic: true, samples: 16}, method: minmax}\n"
        "quantization: {op_types: [Gemm, MatMul]}\noutput: {dir: out}\n"
    )
    recipe = load_recipe(tmp_path / "recipe.yaml")
    exported = load_model(recipe.model, recipe.inputs)
    assert [n.op_type for n in exported.graph.node][:2] == ["MatMul", "BatchNormalization"]
    result = quantize(recipe, progress=False)
    nodes = result.report["nodes"]
    assert not any(n["op_type"] == "BatchNormalization" for n in nodes)
    gemms = [n for n in nodes if n["op_type"] == "Gemm"]
    assert len(gemms) == 2 and all(n["precision"] == "int8" for n in gemms)
    assert all(n["runtime"]["runs_as"] == "QGemm" for n in gemms), gemms
    x = np.random.default_rng(6).standard_normal((5, 16)).astype(np.float32)
    namespace: dict = {}
    exec(BN1D_SOURCE, namespace)  # noqa: S102 - the model source the test defines above
    with torch.no_grad():
        expected = namespace["make_model"]()(torch.from_numpy(x)).numpy()
    float_model = onnx.load(str(recipe.float_model_path))
    np.testing.assert_allclose(_run(float_model, x), expected, rtol=1e-4, atol=1e-4)
