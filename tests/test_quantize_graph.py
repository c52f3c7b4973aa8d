"""The QDQ graph qtool writes: placement rules, parameters, and what ONNX Runtime fuses.

Models here are real torch exports quantized through the real pipeline (synthetic calibration
data, which the recipe asks for explicitly); fusion is read from the model ORT itself optimizes
and saves, so a placement that ORT cannot fuse fails the test.
"""

from __future__ import annotations

import collections
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from qtool.app.quantize import quantize
from qtool.config.recipe import load_recipe

RESNET_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, channels):
            super().__init__()
            self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(channels)
            self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
            self.bn2 = nn.BatchNorm2d(channels)

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + x)

    class TinyResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 16, 3, padding=1)
            self.block1 = Block(16)
            self.block2 = Block(16)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(16, 10)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            x = self.block2(self.block1(x))
            return self.fc(torch.flatten(self.pool(x), 1))

    def make_model():
        torch.manual_seed(0)
        model = TinyResNet()
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 1.5)
        return model
    """
)

ENCODER_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(64, 8)

        def forward(self, ids):
            return self.head(self.encoder(self.embed(ids)).mean(1))

    def make_model():
        torch.manual_seed(0)
        return Encoder()
    """
)


def _write_case(folder: Path, source: str, recipe: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(source)
    (folder / "recipe.yaml").write_text(textwrap.dedent(recipe))
    return folder / "recipe.yaml"


def _resnet_recipe(folder: Path, target: str = "ort-cpu", extra: str = "") -> Path:
    return _write_case(
        folder,
        RESNET_SOURCE,
        f"""
        model: {{pytorch: model.py:make_model}}
        inputs: {{image: [1, 3, 16, 16]}}
        calibration: {{data: {{synthetic: true, samples: 32}}, batch_size: 8, method: minmax}}
        quantization: {{target: {target}, op_types: [Conv, Gemm, Add, GlobalAveragePool]{extra}}}
        output: {{dir: out}}
        """,
    )


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    recipe = load_recipe(_resnet_recipe(tmp_path_factory.mktemp("resnet")))
    result = quantize(recipe, progress=False)
    return recipe, result


def _optimized(model_path: Path, tmp_path: Path) -> onnx.ModelProto:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(tmp_path / "optimized.onnx"))


def _by_output(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in model.graph.node for out in node.output}


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_every_quantized_conv_gemm_add_fuses_in_ort(resnet, tmp_path):
    recipe, result = resnet
    summary = result.report["summary"]["quantized_by_op_type"]
    optimized = _optimized(result.model_path, tmp_path)
    ops = collections.Counter(node.op_type for node in optimized.graph.node)
    assert ops["Conv"] == 0 and ops["Gemm"] == 0 and ops["Add"] == 0, ops
    assert ops["QLinearConv"] == summary["Conv"] == 5
    assert ops["QLinearAdd"] == summary["Add"] == 2
    assert ops["QGemm"] == summary["Gemm"] == 1
    assert ops["DequantizeLinear"] == 0, "a float island was left between int8 ops"


def test_weights_are_int8_per_channel_and_biases_int32_with_product_scale(resnet):
    _, result = resnet
    model = onnx.load(str(result.model_path))
    producers = _by_output(model)
    values = _initializers(model)
    formats = {n["name"]: n["weight"]["format"] for n in result.report["nodes"] if "weight" in n}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert convs
    for conv in convs:
        x_dq, w_dq, b_dq = (producers[name] for name in conv.input)
        assert {x_dq.op_type, w_dq.op_type, b_dq.op_type} == {"DequantizeLinear"}
        weight, w_scale, w_zero = (values[name] for name in w_dq.input)
        # Full range unless the weight format narrowed it for a CPU without VNNI (the report
        # says which; tests/test_weight_format.py checks the formats).
        fmt = formats[conv.name]
        assert weight.dtype == np.int8 and np.abs(weight).max() <= 127
        assert fmt != "s8" or np.abs(weight).max() == 127
        assert w_scale.shape == (weight.shape[0],) and not w_zero.any()
        assert onnx.helper.get_attribute_value(w_dq.attribute[0]) == 0
        x_scale = values[x_dq.input[1]]
        assert values[x_dq.input[2]].dtype == np.uint8 and x_scale.shape == ()
        bias, b_scale, _ = (values[name] for name in b_dq.input)
        assert bias.dtype == np.int32
        np.testing.assert_allclose(b_scale, x_scale * w_scale, rtol=1e-6)


def test_shape_ops_reuse_the_scale_of_their_input(resnet):
    _, result = resnet
    model = onnx.load(str(result.model_path))
    producers = _by_output(model)
    values = _initializers(model)
    checked = 0
    for node in model.graph.node:
        if node.op_type not in {"Flatten", "Reshape", "MaxPool"}:
            continue
        upstream = producers.get(node.input[0])
        assert upstream is not None and upstream.op_type == "DequantizeLinear"
        for quant in (n for n in model.graph.node if n.op_type == "QuantizeLinear"):
            if quant.input[0] == node.output[0]:
                assert values[quant.input[1]] == values[upstream.input[1]]
                assert values[quant.input[2]] == values[upstream.input[2]]
                checked += 1
    assert checked >= 1


def test_quantized_model_tracks_the_float_model(resnet):
    recipe, result = resnet
    rng = np.random.default_rng(1)
    image = rng.standard_normal((16, 3, 16, 16)).astype(np.float32)
    float_out = ort.InferenceSession(str(recipe.float_model_path)).run(None, {"image": image})[0]
    quant_out = ort.InferenceSession(str(result.model_path)).run(None, {"image": image})[0]
    cosine = (float_out * quant_out).sum() / np.linalg.norm(float_out) / np.linalg.norm(quant_out)
    assert cosine > 0.99
    assert not np.array_equal(float_out, quant_out)


def test_report_explains_every_node(resnet):
    recipe, result = resnet
    float_model = onnx.load(str(recipe.float_model_path))
    nodes = {n["name"]: n for n in result.report["nodes"]}
    assert set(nodes) == {node.name for node in float_model.graph.node}
    for entry in nodes.values():
        assert entry["precision"] in {"int8", "float"} and entry["reason"]
    relus = [n for n in nodes.values() if n["op_type"] == "Relu"]
    assert relus and all("folded" in n["reason"] for n in relus)


def test_tensorrt_target_uses_symmetric_int8_and_keeps_relu(tmp_path):
    recipe = load_recipe(_resnet_recipe(tmp_path, target="tensorrt"))
    result = quantize(recipe, progress=False)
    model = onnx.load(str(result.model_path))
    values = _initializers(model)
    zero_points = [values[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert zero_points and all(z.dtype == np.int8 and z == 0 for z in zero_points)
    assert any(n.op_type == "Relu" for n in model.graph.node)


def test_exclude_by_glob_keeps_layer_float(tmp_path):
    recipe = load_recipe(_resnet_recipe(tmp_path, extra=", exclude: ['/block2/*']"))
    result = quantize(recipe, progress=False)
    for node in result.report["nodes"]:
        if node["name"].startswith("/block2/") and node["op_type"] in {"Conv", "Add"}:
            assert node["precision"] == "float" and "/block2/*" in node["reason"]
    model = onnx.load(str(result.model_path))
    producers = _by_output(model)
    block2_convs = [
        n for n in model.graph.node if n.name.startswith("/block2/") and n.op_type == "Conv"
    ]
    assert block2_convs
    for conv in block2_convs:
        assert conv.input[1] in _initializers(model), "excluded weight must stay float"
        assert producers.get(conv.input[1]) is None


def test_transformer_matmuls_all_fuse(tmp_path):
    recipe_path = _write_case(
        tmp_path,
        ENCODER_SOURCE,
        """
        model: {pytorch: model.py:make_model}
        inputs: {ids: {shape: [1, 16], dtype: int64}}
        calibration: {data: {synthetic: true, samples: 32}, method: percentile, batch_size: 8}
        quantization: {op_types: [MatMul, Gemm]}
        output: {dir: out}
        """,
    )
    recipe = load_recipe(recipe_path)
    result = quantize(recipe, progress=False)
    summary = result.report["summary"]["quantized_by_op_type"]
    assert summary.get("MatMul", 0) >= 8
    optimized = _optimized(result.model_path, tmp_path)
    ops = collections.Counter(node.op_type for node in optimized.graph.node)
    assert ops["MatMul"] == 0 and ops["Gemm"] == 0, ops
    fused = ops["QLinearMatMul"] + ops["MatMulIntegerToFloat"] + ops["QGemm"]
    assert fused == summary.get("MatMul", 0) + summary.get("Gemm", 0)


def test_transformer_keeps_ort_skip_layer_norm_fusion(tmp_path):
    """The QDQ model carries the prepared model's shapes, so ORT still fuses Add + LayerNorm."""
    recipe_path = _write_case(
        tmp_path,
        ENCODER_SOURCE,
        """
        model: {pytorch: model.py:make_model}
        inputs: {ids: {shape: [1, 16], dtype: int64}}
        calibration: {data: {synthetic: true, samples: 8}, method: minmax, batch_size: 8}
        quantization: {op_types: [MatMul, Gemm]}
        output: {dir: out}
        """,
    )
    recipe = load_recipe(recipe_path)
    result = quantize(recipe, progress=False)
    (tmp_path / "f").mkdir()
    (tmp_path / "q").mkdir()
    float_ops = collections.Counter(
        n.op_type for n in _optimized(recipe.float_model_path, tmp_path / "f").graph.node
    )
    quant_ops = collections.Counter(
        n.op_type for n in _optimized(result.model_path, tmp_path / "q").graph.node
    )
    assert float_ops["SkipLayerNormalization"] > 0, float_ops
    assert quant_ops["SkipLayerNormalization"] == float_ops["SkipLayerNormalization"], quant_ops
    assert quant_ops["LayerNormalization"] == float_ops["LayerNormalization"]
