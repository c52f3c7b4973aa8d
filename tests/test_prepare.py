"""Graph preparation on real torch exports: equivalence in ONNX Runtime, and the graph properties
the quantizer relies on (no Identity/Constant/foldable chains, 2-D Gemm only, typed tensors).

Models are exported with the TorchScript exporter (`dynamo=False`): its graphs keep module-path
node names ('/conv1/Conv') and carry the Identity aliases, Constant nodes and Shape->Gather->Concat
->Reshape chains that preparation must remove. One test covers the default dynamo exporter too.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from qtool.errors import ModelError
from qtool.quantize.prepare import prepare_model, tensor_types

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
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.2)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)


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
    # BatchNormalization folds into the Conv before it (tests/test_fold_bn.py).
    assert "BatchNormalization" in before.values()
    assert "BatchNormalization" not in after.values()
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
