"""Graph preparation on real torch exports: equivalence in ONNX Runtime, and the graph properties
the quantizer relies on (no Identity/Constant/foldable chains, 2-D Gemm only, typed tensors).

Models are exported with the TorchScript exporter (`dynamo=False`): its graphs keep module-path
node names ('/conv1/Conv') and carry the Identity aliases, Constant nodes and Shape->Gather->Concat
->Reshape chains that preparation must remove. One test covers the default dynamo exporter too.
"""

from __future__ import annotations

import io
import warnings
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from qtool.app.quantize import quantize
from qtool.config.recipe import load_recipe
from qtool.errors import ModelError
from qtool.model.prepare import prepare_model, tensor_types

# Ops whose outputs are never folded even from constant inputs (they change numerics/semantics).
_UNFOLDABLE = {"QuantizeLinear", "DequantizeLinear", "RandomNormal", "RandomUniform"}


class _Cnn(nn.Module):
    """Conv/BN/ReLU features, a dynamic-looking flatten and a hand-written linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        # x @ W.T + b written out: exports as Transpose(weight) -> MatMul -> Add, the 2-D pattern
        # that must become a Gemm.
        self.head_weight = nn.Parameter(torch.randn(10, 32) * 0.1)
        self.head_bias = nn.Parameter(torch.randn(10) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        x = x.view(x.size(0), -1)  # Unsqueeze -> Concat -> Reshape (+ Shape/Gather if dynamic)
        x = self.relu(self.fc1(x))
        return x @ self.head_weight.t() + self.head_bias


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def _randomize_bn(module: nn.Module, seed: int) -> None:
    """Non-trivial running stats, so a wrong BN fold would show up numerically."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.2)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)


def _export(
    module: nn.Module, example: torch.Tensor, *, opset: int = 17, dynamo: bool = False, **kw
) -> onnx.ModelProto:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            module,
            (example,),
            buf,
            opset_version=opset,
            dynamo=dynamo,
            input_names=["x"],
            output_names=["y"],
            **kw,
        )
    return onnx.load_from_string(buf.getvalue())


@pytest.fixture(scope="module")
def cnn() -> tuple[nn.Module, onnx.ModelProto]:
    torch.manual_seed(0)
    module = _Cnn().eval()
    _randomize_bn(module, 1)
    # do_constant_folding=False keeps BatchNormalization and the weight Transpose in the graph.
    return module, _export(module, torch.randn(2, 1, 8, 8), do_constant_folding=False)


@pytest.fixture(scope="module")
def encoder() -> tuple[nn.Module, onnx.ModelProto]:
    torch.manual_seed(0)
    module = _Encoder().eval()
    return module, _export(module, torch.randn(2, 16, 64))


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _assert_prepared_invariants(prepared: onnx.ModelProto) -> None:
    graph = prepared.graph
    assert "Identity" not in _ops(prepared)
    assert "Constant" not in _ops(prepared)
    inits = {i.name for i in graph.initializer}
    types = tensor_types(prepared)
    for node in graph.node:
        # Nothing left that could have been computed ahead of time.
        if node.op_type not in _UNFOLDABLE:
            assert not all(n in inits for n in node.input if n), node.name
        if node.op_type == "Shape":
            dims = types[node.input[0]][1]
            assert dims is None or not all(isinstance(d, int) for d in dims), node.name
        for out in node.output:
            assert types[out][0] != TensorProto.UNDEFINED, out
    names = [n.name for n in graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert onnx.checker.check_model(prepared) is None


def test_cnn_prepared_matches_original_and_torch(cnn) -> None:
    module, model = cnn
    original_bytes = model.SerializeToString()
    prepared = prepare_model(model)
    assert model.SerializeToString() == original_bytes, "input model was mutated"

    x = np.random.default_rng(0).standard_normal((2, 1, 8, 8)).astype(np.float32)
    want = module(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(_run(model, x), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-6)
    _assert_prepared_invariants(prepared)
    # The export had work to do: inline constants, a constant reshape-target chain (the static
    # batch size is traced as a Constant) and a weight transpose.
    assert {"Constant", "Concat", "Transpose"} <= set(_ops(model))
    assert not {"Concat", "Unsqueeze", "Transpose"} & set(_ops(prepared))


def test_cnn_2d_matmul_add_becomes_gemm_named_after_matmul(cnn) -> None:
    _, model = cnn
    prepared = prepare_model(model)
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert len(matmuls) == 1
    by_name = {n.name: n for n in prepared.graph.node}
    gemm = by_name[matmuls[0].name]
    assert gemm.op_type == "Gemm"
    assert "MatMul" not in _ops(prepared) and "Add" not in _ops(prepared)
    # Bias and weight are initializers with the shapes Gemm(A[M,K], B[K,N], C[N]) needs.
    inits = {i.name: numpy_helper.to_array(i) for i in prepared.graph.initializer}
    weight, bias = inits[gemm.input[1]], inits[gemm.input[2]]
    assert weight.shape == (32, 10) and bias.shape == (10,)
    assert tensor_types(prepared)[gemm.input[0]][1] == [2, 32]
    assert gemm.output[0] == "y"


def test_cnn_surviving_nodes_keep_names(cnn) -> None:
    _, model = cnn
    prepared = prepare_model(model)
    before = {n.name: n.op_type for n in model.graph.node}
    after = {n.name: n.op_type for n in prepared.graph.node}
    for op in ("Conv", "Relu", "Gemm", "Reshape"):
        names = {name for name, t in before.items() if t == op}
        assert names and names <= set(after), op
        assert all(after[name] == op for name in names)
    assert "BatchNormalization" in before.values()
    assert "BatchNormalization" not in after.values(), "BN is folded into the Conv before it"
    for name, op in after.items():
        assert name in before, name
        assert op == before[name] or (before[name], op) == ("MatMul", "Gemm")


def test_encoder_prepared_matches_and_3d_matmuls_stay(encoder) -> None:
    module, model = encoder
    prepared = prepare_model(model)
    x = np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)
    want = module(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(_run(prepared, x), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-5)
    _assert_prepared_invariants(prepared)
    assert {"Identity", "Constant", "Shape"} <= set(_ops(model))  # there was work to do

    types = tensor_types(prepared)
    after = {n.name: n for n in prepared.graph.node}
    inits = {i.name for i in prepared.graph.initializer}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert len(matmuls) >= 6
    for mm in matmuls:
        assert after[mm.name].op_type == "MatMul", mm.name
        assert len(types[after[mm.name].input[0]][1]) >= 3, mm.name
    # The 3-D projections are MatMul + constant-bias Add: the pattern that must NOT become Gemm.
    adds = [n for n in prepared.graph.node if n.op_type == "Add"]
    biased = {a.input[0] for a in adds if a.input[1] in inits}
    biased |= {a.input[1] for a in adds if a.input[0] in inits}
    assert sum(after[mm.name].output[0] in biased for mm in matmuls) >= 4
    for gemm in (n for n in prepared.graph.node if n.op_type == "Gemm"):
        assert len(types[gemm.input[0]][1]) == 2
    # Every standard compute layer of the export survives under its module-path name.
    for n in model.graph.node:
        if n.op_type in ("MatMul", "Gemm", "LayerNormalization", "Softmax", "Relu"):
            assert after[n.name].op_type in (n.op_type, "Gemm")


def test_identity_aliases_of_weights_keep_their_names(encoder) -> None:
    _, model = encoder
    aliases = {
        n.output[0]
        for n in model.graph.node
        if n.op_type == "Identity" and n.input[0] in {i.name for i in model.graph.initializer}
    }
    assert aliases
    prepared = prepare_model(model)
    inits = {i.name: numpy_helper.to_array(i) for i in prepared.graph.initializer}
    src = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.output and n.output[0] in aliases and n.output[0] in inits:
            np.testing.assert_array_equal(inits[n.output[0]], src[n.input[0]])
    used = {name for node in prepared.graph.node for name in node.input}
    assert aliases & used, "aliased weights should still be read under their own names"


def test_deterministic_bytes(cnn, encoder) -> None:
    for _, model in (cnn, encoder):
        assert prepare_model(model).SerializeToString() == prepare_model(model).SerializeToString()


def test_opset13_model_is_upgraded(cnn) -> None:
    module, _ = cnn
    model = _export(module, torch.randn(2, 1, 8, 8), opset=13)
    assert model.opset_import[0].version == 13
    prepared = prepare_model(model)
    assert {o.domain: o.version for o in prepared.opset_import}[""] == 17
    x = np.random.default_rng(2).standard_normal((2, 1, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-6)
    _assert_prepared_invariants(prepared)
    assert {o.domain: o.version for o in prepare_model(model, min_opset=21).opset_import}[""] == 21


def test_dynamic_batch_keeps_shape_ops_and_still_fuses(cnn) -> None:
    module, _ = cnn
    model = _export(
        module, torch.randn(2, 1, 8, 8), dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}
    )
    prepared = prepare_model(model)
    x = np.random.default_rng(3).standard_normal((5, 1, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-6)
    assert "Shape" in _ops(prepared)  # the batch size is only known at run time
    assert _ops(prepared).count("Gemm") == 2
    assert tensor_types(prepared)["y"] == (TensorProto.FLOAT, ["batch", 10])


def test_dynamo_export_encoder_prepares() -> None:
    torch.manual_seed(0)
    module = _Encoder().eval()
    model = _export(module, torch.randn(2, 16, 64), dynamo=True)
    prepared = prepare_model(model)
    x = np.random.default_rng(4).standard_normal((2, 16, 64)).astype(np.float32)
    want = module(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(_run(prepared, x), want, rtol=1e-4, atol=1e-4)
    _assert_prepared_invariants(prepared)


def _tiny(nodes, outputs, opset: int = 17, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        initializer=list(inits),
    )
    # IR 10: what torch emits and what ONNX Runtime 1.31 accepts (onnx 1.23 would default to 14).
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def test_identity_before_graph_output_keeps_output_name_and_unnamed_nodes_get_names() -> None:
    model = _tiny(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Identity", ["r"], ["y"]),
            helper.make_node("Identity", ["x"], ["passthrough"]),
            helper.make_node("Neg", ["y"], ["z"], name="keep_me"),
        ],
        ["y", "passthrough", "z"],
    )
    prepared = prepare_model(model)
    assert [o.name for o in prepared.graph.output] == ["y", "passthrough", "z"]
    # An input passed straight to an output needs its Identity; the other one goes.
    assert _ops(prepared) == ["Relu", "Identity", "Neg"]
    assert [n.name for n in prepared.graph.node] == ["Relu_0", "Identity_1", "keep_me"]
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    sess = ort.InferenceSession(prepared.SerializeToString(), providers=["CPUExecutionProvider"])
    y, p, z = sess.run(None, {"x": x})
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    np.testing.assert_array_equal(p, x)
    np.testing.assert_array_equal(z, -np.maximum(x, 0))


def test_matmul_add_with_non_vector_bias_is_not_fused() -> None:
    w = numpy_helper.from_array(np.ones((4, 2), np.float32), "w")
    b = numpy_helper.from_array(np.ones((3, 1), np.float32), "b")  # broadcasts, but not per column
    model = _tiny(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
        ["y"],
        inits=[w, b],
    )
    assert _ops(prepare_model(model)) == ["MatMul", "Add"]


def test_unknown_op_fails_upgrade_with_model_error() -> None:
    model = _tiny([helper.make_node("FooBar", ["x"], ["y"])], ["y"], opset=11)
    with pytest.raises(ModelError, match="opset 11 to 17"):
        prepare_model(model)


def test_exporter_symbolic_dims_survive_so_ort_keeps_skip_layer_norm(tmp_path) -> None:
    """ONNX inference alone says `unk__6` where the exporter said `batch` after a Reshape; ORT's
    SkipLayerNormalization fusion compares those dims, so preparation must keep the exporter's."""
    import collections

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.o, self.ln = nn.Linear(32, 32), nn.LayerNorm(32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, h = x.shape
            y = self.o(x.view(b, s, 4, 8).transpose(1, 2).transpose(1, 2).reshape(b, s, h))
            return self.ln(x + y)

    path = tmp_path / "block.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Block().eval(),
            (torch.randn(2, 8, 32),),
            str(path),
            input_names=["x"],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            dynamo=True,
            verbose=False,
        )
    original = onnx.load(str(path))

    def fused(model: onnx.ModelProto, name: str) -> collections.Counter:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.optimized_model_filepath = str(tmp_path / name)
        ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
        return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / name)).graph.node)

    before = fused(original, "original.onnx")
    after = fused(prepare_model(original), "prepared.onnx")
    assert before["SkipLayerNormalization"] == 1, before
    assert after["SkipLayerNormalization"] == before["SkipLayerNormalization"], after


def test_castlike_expand_zero_bias_folds_into_a_constant(tmp_path) -> None:
    """The dynamo exporter without its optimizer builds a bias-free Conv's bias as
    Expand(CastLike(0, x), shape): CastLike reads only x's element type, so it folds."""
    path = tmp_path / "nobias.onnx"
    module = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.ReLU()).eval()
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
    original = onnx.load(str(path))
    assert any(n.op_type == "CastLike" for n in original.graph.node)
    prepared = prepare_model(original)
    assert [n.op_type for n in prepared.graph.node] == ["Conv", "Relu"]
    conv = prepared.graph.node[0]
    bias = {t.name: t for t in prepared.graph.initializer}[conv.input[2]]
    assert not numpy_helper.to_array(bias).any() and list(bias.dims) == [4]


# --------------------------------------------------------------------------- BatchNorm folding


class _BnNet(nn.Module):
    """Each layer kind a BatchNormalization folds into, each followed by one (random stats).

    Covers a biased Conv, a bias-free depthwise Conv, a grouped Conv, a grouped ConvTranspose
    (weight [C_in, C_out/group, k, k]) and a Linear (Gemm transB=1) + BatchNorm1d; ReLU6 exports
    as Clip(0, 6).
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.grouped = nn.Conv2d(8, 12, 1, groups=4, bias=False)
        self.bn3 = nn.BatchNorm2d(12)
        self.up = nn.ConvTranspose2d(12, 6, 2, stride=2, groups=3)
        self.bn4 = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 8 * 8, 5)
        self.bn5 = nn.BatchNorm1d(5)
        self.relu6 = nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu6(self.bn1(self.conv(x)))
        x = torch.relu(self.bn2(self.dw(x)))
        x = self.bn4(self.up(self.bn3(self.grouped(x))))
        return self.bn5(self.fc(torch.flatten(x, 1)))


_BN_EXPORTS = {
    # Both keep BatchNormalization: TorchScript folds it only when constant folding runs in eval
    # mode (PRESERVE skips it), the dynamo exporter only in its optimize pass.
    "torchscript-preserve": {"training": torch.onnx.TrainingMode.PRESERVE},
    "dynamo-unoptimized": {"dynamo": True, "optimize": False},
}


@pytest.fixture(scope="module", params=sorted(_BN_EXPORTS))
def bn_net(request) -> tuple[str, nn.Module, onnx.ModelProto]:
    torch.manual_seed(0)
    module = _BnNet().eval()
    _randomize_bn(module, 2)
    export = request.param
    return export, module, _export(module, torch.randn(2, 3, 4, 4), **_BN_EXPORTS[export])


def test_batchnorm_folds_into_conv_convtranspose_and_gemm(bn_net) -> None:
    _, module, model = bn_net
    assert _ops(model).count("BatchNormalization") == 5
    prepared = prepare_model(model)
    assert "BatchNormalization" not in _ops(prepared)
    x = np.random.default_rng(6).standard_normal((2, 3, 4, 4)).astype(np.float32)
    want = module(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(_run(model, x), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-4, atol=1e-5)
    _assert_prepared_invariants(prepared)
    inits = {i.name for i in prepared.graph.initializer}
    layers = [n for n in prepared.graph.node if n.op_type in ("Conv", "ConvTranspose", "Gemm")]
    assert sorted(n.op_type for n in layers) == ["Conv", "Conv", "Conv", "ConvTranspose", "Gemm"]
    for node in layers:
        # Weight and a bias (the folded BN offset, also where the layer had none) are constants.
        assert len(node.input) == 3 and set(node.input[1:]) <= inits, node.name


def test_zero_biases_and_relu6_bounds_become_initializers(bn_net) -> None:
    export, _, model = bn_net
    if export.startswith("dynamo"):
        # The unoptimized dynamo export builds zero biases and Clip bounds as CastLike/Expand of
        # literals (CastLike reads only the element type of an activation).
        assert {"CastLike", "Expand"} <= set(_ops(model))
    prepared = prepare_model(model)
    assert not {"CastLike", "Expand", "Constant"} & set(_ops(prepared))
    inits = {i.name: numpy_helper.to_array(i) for i in prepared.graph.initializer}
    (clip,) = (n for n in prepared.graph.node if n.op_type == "Clip")
    assert len(clip.input) == 3
    low, high = (inits[name] for name in clip.input[1:])
    assert low.shape == high.shape == () and low.dtype == high.dtype == np.float32
    assert (float(low), float(high)) == (0.0, 6.0)


def _gemm_bn_model(*, trans_b: int, extra_reader: bool = False, training: bool = False):
    """x[3, 4] -> Gemm(alpha 0.5, beta 2) -> BatchNormalization over its 5 columns."""
    rng = np.random.default_rng(7)
    w_shape = (5, 4) if trans_b else (4, 5)
    inits = [
        numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "c"),
        numpy_helper.from_array((rng.random(5) + 0.5).astype(np.float32), "scale"),
        numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "mean"),
        numpy_helper.from_array((rng.random(5) + 0.5).astype(np.float32), "var"),
    ]
    gemm = helper.make_node(
        "Gemm", ["x", "w", "c"], ["g"], name="fc", alpha=0.5, beta=2.0, transB=trans_b
    )
    bn_outputs = ["y", "running_mean", "running_var"] if training else ["y"]
    bn = helper.make_node(
        "BatchNormalization",
        ["g", "scale", "beta", "mean", "var"],
        bn_outputs,
        name="bn",
        epsilon=1e-3,
        training_mode=int(training),
    )
    nodes, outputs = [gemm, bn], ["y"]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["g"], ["r"]))
        outputs.append("r")
    return _tiny(nodes, outputs, inits=inits)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_batchnorm_folds_into_gemm_with_alpha_beta(trans_b: int) -> None:
    model = _gemm_bn_model(trans_b=trans_b)
    prepared = prepare_model(model)
    assert _ops(prepared) == ["Gemm"] and prepared.graph.node[0].name == "fc"
    x = np.random.default_rng(8).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_batchnorm_stays_when_not_foldable() -> None:
    # The Gemm output is also read by a Relu: folding would change what the Relu sees.
    shared = prepare_model(_gemm_bn_model(trans_b=1, extra_reader=True))
    assert _ops(shared) == ["Gemm", "BatchNormalization", "Relu"]
    # Training mode normalises with the batch's statistics, not the constant ones.
    training = prepare_model(_gemm_bn_model(trans_b=1, training=True))
    assert _ops(training) == ["Gemm", "BatchNormalization"]


def test_batchnorm_fold_gives_layers_sharing_a_weight_their_own_copy() -> None:
    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array(rng.standard_normal((5, 4)).astype(np.float32), "w")]
    nodes = []
    for k in range(2):
        inits += [
            numpy_helper.from_array((rng.random(5) + 0.5).astype(np.float32), f"s{k}"),
            numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), f"b{k}"),
            numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), f"m{k}"),
            numpy_helper.from_array((rng.random(5) + 0.5).astype(np.float32), f"v{k}"),
        ]
        nodes += [
            helper.make_node("Gemm", ["x", "w"], [f"g{k}"], transB=1),
            helper.make_node(
                "BatchNormalization", [f"g{k}", f"s{k}", f"b{k}", f"m{k}", f"v{k}"], [f"y{k}"]
            ),
        ]
    model = _tiny(nodes, ["y0", "y1"], inits=inits)
    prepared = prepare_model(model)
    assert _ops(prepared) == ["Gemm", "Gemm"]
    weights = [n.input[1] for n in prepared.graph.node]
    assert len(set(weights)) == 2
    x = np.random.default_rng(10).standard_normal((3, 4)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})
    sess = ort.InferenceSession(prepared.SerializeToString(), providers=["CPUExecutionProvider"])
    for got, ref in zip(sess.run(None, {"x": x}), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- growth rule


def _expanded_zero(shape: list[int], out: str) -> tuple[list[onnx.NodeProto], list]:
    """CastLike(0, x) expanded to `shape`: how the dynamo exporter writes a zero tensor."""
    inits = [
        numpy_helper.from_array(np.array(0.0, np.float64), f"{out}_zero"),
        numpy_helper.from_array(np.array(shape, np.int64), f"{out}_shape"),
    ]
    nodes = [
        helper.make_node("CastLike", [f"{out}_zero", "x"], [f"{out}_cast"]),
        helper.make_node("Expand", [f"{out}_cast", f"{out}_shape"], [out]),
    ]
    return nodes, inits


def test_large_expanded_bias_folds_but_large_expanded_activation_does_not() -> None:
    # A 1.2 MB bias (over the growth limit) is the layer's own weight: it must be a constant.
    n = 300_000
    weight = numpy_helper.from_array(np.full((4, n), 0.01, np.float32), "w")
    bias_nodes, bias_inits = _expanded_zero([n], "bias")
    gemm = helper.make_node("Gemm", ["x", "w", "bias"], ["y"], name="fc")
    # A 1.5 MB broadcast operand of an Add is not: folding it would only grow the file.
    wide_nodes, wide_inits = _expanded_zero([32768, 3, 4], "wide")
    add = helper.make_node("Add", ["x", "wide"], ["z"], name="add")
    model = _tiny(
        [*bias_nodes, gemm, *wide_nodes, add], ["y", "z"], inits=[weight, *bias_inits, *wide_inits]
    )
    prepared = prepare_model(model)
    by_name = {node.name: node for node in prepared.graph.node}
    inits = {i.name: i for i in prepared.graph.initializer}
    assert by_name["fc"].input[2] in inits
    assert list(inits[by_name["fc"].input[2]].dims) == [n]
    assert _ops(prepared) == ["Gemm", "Expand", "Add"]  # both CastLikes folded
    x = np.random.default_rng(11).standard_normal((3, 4)).astype(np.float32)
    sess = ort.InferenceSession(prepared.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, x @ np.full((4, n), 0.01, np.float32), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(z, np.broadcast_to(x, (32768, 3, 4)))


# --------------------------------------------------------------------------- ORT fusions kept


class _PostLnLayer(nn.Module):
    """A post-LN BERT layer with explicit attention MatMuls (the benchmark encoder's shape)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.ff1, self.ff2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / (h // self.heads) ** 0.5 + bias
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.o(ctx))
        return self.ln2(x + self.ff2(nn.functional.gelu(self.ff1(x))))


class _PostLnEncoder(nn.Module):
    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(100, hidden), nn.Embedding(16, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(_PostLnLayer(hidden, heads) for _ in range(layers))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        x = self.ln(self.tok(ids) + self.pos(pos))
        bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, bias)
        return x


def _ort_op_counts(path) -> dict[str, int]:
    """Op types of the graph ONNX Runtime's CPU provider runs after all its optimisations."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.optimized_model_filepath = str(path) + ".ort.onnx"
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return dict(Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node))


def test_quantized_encoder_keeps_ort_skip_layer_norm_fusion(tmp_path) -> None:
    """The dynamo exporter names the batch dim `batch` on every residual-stream tensor; ONNX
    shape inference alone invents a new symbol after each Reshape, and ORT fuses Add +
    LayerNormalization into SkipLayerNormalization only when both Add inputs match, symbols
    included. Both the prepared float model and the QDQ model must keep every fusion."""
    torch.manual_seed(0)
    module = _PostLnEncoder().eval()
    batch = torch.export.Dim("batch")
    source = tmp_path / "encoder.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            (torch.randint(0, 100, (2, 16)), torch.ones((2, 16), dtype=torch.int64)),
            input_names=["ids", "mask"],
            output_names=["y"],
            dynamic_shapes=({0: batch}, {0: batch}),
            opset_version=17,
            dynamo=True,
        )
    program.save(str(source))
    (tmp_path / "recipe.yaml").write_text(
        "model: {onnx: encoder.onnx}\n"
        "inputs: {ids: {shape: [1, 16], dtype: int64}, mask: {shape: [1, 16], dtype: int64}}\n"
        "calibration: {data: {synthetic: true, samples: 8}, batch_size: 8, method: minmax}\n"
        "quantization: {target: ort-cpu, op_types: [MatMul, Gemm]}\n"
        "output: {dir: out}\n"
    )
    recipe = load_recipe(tmp_path / "recipe.yaml")
    result = quantize(recipe, progress=False)
    original = _ort_op_counts(source)
    assert original.get("SkipLayerNormalization", 0) == 4  # two per layer
    for path in (recipe.float_model_path, result.model_path):
        counts = _ort_op_counts(path)
        assert counts.get("SkipLayerNormalization", 0) == original["SkipLayerNormalization"]
        assert counts.get("LayerNormalization", 0) == original.get("LayerNormalization", 0)
    assert result.report["summary"]["quantized_by_op_type"]["MatMul"] >= 12
