"""Fusion truth: what ONNX Runtime's CPU provider really runs for each node qtool quantized.

The CNN, MLP and transformer block are real torch exports quantized by qtool's pipeline
(synthetic calibration data, asked for in the recipe); the failure cases are small QDQ graphs
written with onnx.helper in qtool's naming scheme. Every verdict comes from the graph ORT itself
optimizes and saves, so nothing here restates what the module assumes.
"""

from __future__ import annotations

import json
import math
import platform
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.app.quantize import quantize
from qtool.config.recipe import load_recipe
from qtool.errors import DataError, ModelError, OutputError
from qtool.metrics.signal import SignalQuality
from qtool.ort.sessions import create_session
from qtool.plan.ops.targets import ORT_CPU_INTEGER_KERNELS as INTEGER_OPS
from qtool.runtime import fused_vs_unfused
from qtool.runtime.fused_vs_unfused import compare_fused_unfused, run_unfused
from qtool.runtime.fusion import (
    fusion_summary,
    fusion_truth,
    optimized_graph,
    optimized_session,
)

ON_ARM = platform.machine().lower() in ("aarch64", "arm64")

CNN_SOURCE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = self.conv2(torch.relu(self.bn1(self.conv1(x))))
        x = torch.relu(y + x)
        return self.fc(torch.flatten(self.pool(x), 1))

def make_model():
    torch.manual_seed(0)
    return Net()
"""

MLP_SOURCE = """
import torch
from torch import nn

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
"""

BLOCK_SOURCE = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        attn = torch.softmax(q @ k.transpose(1, 2) * 0.25, dim=-1)
        x = self.norm(x + self.out(attn @ v))
        return x + self.ff(torch.relu(x))

def make_model():
    torch.manual_seed(0)
    return Block()
"""


def _quantize(folder: Path, source: str, inputs: str, op_types: str):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(textwrap.dedent(source))
    (folder / "recipe.yaml").write_text(
        textwrap.dedent(
            f"""
            model: {{pytorch: model.py:make_model}}
            inputs: {inputs}
            calibration: {{data: {{synthetic: true, samples: 16}}, batch_size: 8, method: minmax}}
            quantization: {{op_types: {op_types}}}
            output: {{dir: out}}
            """
        )
    )
    result = quantize(load_recipe(folder / "recipe.yaml"), progress=False)
    planned = {n["name"]: n["op_type"] for n in result.report["nodes"] if n["precision"] == "int8"}
    return result.model_path, planned


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    return _quantize(
        tmp_path_factory.mktemp("cnn"),
        CNN_SOURCE,
        "{image: [1, 3, 8, 8]}",
        "[Conv, Gemm, Add, GlobalAveragePool]",
    )


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return _quantize(tmp_path_factory.mktemp("mlp"), MLP_SOURCE, "{x: [1, 16]}", "[Gemm]")


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    return _quantize(
        tmp_path_factory.mktemp("block"), BLOCK_SOURCE, "{x: [1, 6, 16]}", "[MatMul, Gemm]"
    )


def _nodes(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {node.name: node for node in model.graph.node}


def _weight_of(node: onnx.NodeProto, model: onnx.ModelProto) -> str:
    """The int8 initializer behind the node's weight DequantizeLinear."""
    producers = {out: n for n in model.graph.node for out in n.output}
    return producers[node.input[1]].input[0]


def _assert_fused_one_to_one(model_path: Path, planned: dict[str, str], expected: dict):
    truth = fusion_truth(model_path, planned)
    assert list(truth) == list(planned)
    ort_nodes = _nodes(optimized_graph(model_path))
    qdq = onnx.load(str(model_path))
    qdq_nodes = _nodes(qdq)
    for name, runtime in truth.items():
        assert runtime.status == "fused", (name, runtime)
        assert runtime.runs_as in expected[planned[name]], (name, runtime)
        assert runtime.reason is None
        ort_node = ort_nodes[runtime.ort_node]
        assert ort_node.op_type == runtime.runs_as
        if planned[name] in ("Conv", "Gemm", "MatMul") and runtime.runs_as != "QLinearMatMul":
            weight = _weight_of(qdq_nodes[name], qdq)
            if weight in {t.name for t in qdq.graph.initializer}:
                assert weight in ort_node.input, (name, runtime, list(ort_node.input))
    assert len({r.ort_node for r in truth.values()}) == len(truth), "two nodes mapped to one"
    return truth


def test_every_cnn_conv_gemm_add_pool_fuses_into_its_qlinear_op(cnn):
    model_path, planned = cnn
    assert sorted(planned.values()).count("Conv") == 3
    truth = _assert_fused_one_to_one(
        model_path,
        planned,
        {
            "Conv": {"QLinearConv"},
            "Gemm": {"QGemm"},
            "Add": {"QLinearAdd"},
            "GlobalAveragePool": {"QLinearGlobalAveragePool"},
        },
    )
    ops = [n.op_type for n in optimized_graph(model_path).graph.node]
    assert ops.count("QLinearConv") == 3 and "Conv" not in ops and "DequantizeLinear" not in ops
    # ORT's NHWC transform re-creates QLinearConv, so these ORT names differ from qtool's.
    assert all(truth[n].ort_node for n, op in planned.items() if op == "Conv")


def test_both_mlp_gemms_fuse_into_qgemm(mlp):
    model_path, planned = mlp
    assert list(planned.values()) == ["Gemm", "Gemm"]
    _assert_fused_one_to_one(model_path, planned, {"Gemm": {"QGemm"}})


def test_transformer_block_matmuls_fuse_by_whether_their_output_is_quantized(block):
    model_path, planned = block
    matmuls = [name for name, op in planned.items() if op == "MatMul"]
    assert len(matmuls) >= 7  # 6 Linear layers on 3-D input + the two attention products
    truth = _assert_fused_one_to_one(
        model_path,
        planned,
        {"MatMul": {"QLinearMatMul", "MatMulIntegerToFloat"}, "Gemm": {"QGemm"}},
    )
    qdq = onnx.load(str(model_path))
    consumers: dict[str, list[str]] = {}
    for node in qdq.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.op_type)
    nodes = _nodes(qdq)
    direct_q = [m for m in matmuls if consumers.get(nodes[m].output[0]) == ["QuantizeLinear"]]
    into_add = [m for m in matmuls if consumers.get(nodes[m].output[0]) == ["Add"]]
    assert direct_q and into_add
    assert all(truth[m].runs_as == "QLinearMatMul" for m in direct_q)
    assert all(truth[m].runs_as == "MatMulIntegerToFloat" for m in into_add)


def test_summary_counts_fused_per_op_type_and_is_json_ready(cnn):
    model_path, planned = cnn
    summary = fusion_summary(fusion_truth(model_path, planned))
    assert summary["planned"] == summary["fused"] == len(planned)
    assert summary["unfused"] == [] and summary["float"] == summary["removed"] == 0
    assert summary["by_op_type"]["Conv"] == {
        "planned": 3,
        "fused": 3,
        "runs_as": {"QLinearConv": 3},
    }
    assert json.loads(json.dumps(summary)) == summary


def test_fusion_truth_is_deterministic(mlp):
    model_path, planned = mlp
    assert fusion_truth(model_path, planned) == fusion_truth(model_path.read_bytes(), planned)


def test_optimized_graph_leaves_no_files_behind(mlp, tmp_path, monkeypatch):
    model_path, _ = mlp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    graph = optimized_graph(model_path)
    assert any(node.domain == "com.microsoft" for node in graph.graph.node)
    assert list(tmp_path.iterdir()) == []


def test_optimized_session_runs_what_a_plain_session_runs(mlp):
    """The verify stage's one session also saves ORT's graph; saving must not change what it
    computes (the fused-vs-unfused figure is meant to be the deployed model's)."""
    model_path, _ = mlp
    loaded = optimized_session(model_path)
    plain = create_session(model_path, threads=1, optimize=True)
    rng = np.random.default_rng(4)
    shapes = {i.name: [d if isinstance(d, int) else 3 for d in i.shape] for i in plain.get_inputs()}
    feed = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for got, want in zip(loaded.session.run(None, feed), plain.run(None, feed), strict=True):
        np.testing.assert_array_equal(got, want)
    assert [n.op_type for n in loaded.graph.graph.node] == [
        n.op_type for n in optimized_graph(model_path).graph.node
    ]


# Hand-made QDQ graphs in qtool's naming: {tensor}_QuantizeLinear, {weight}_quantized, ...

_RNG = np.random.default_rng(0)
_U8_128 = np.uint8(128)  # the zero point of a symmetric-ish uint8 range


def _init(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _pair(tensor: str, scale: float = 0.02, zero=_U8_128):
    nodes = [
        helper.make_node(
            "QuantizeLinear",
            [tensor, f"{tensor}_scale", f"{tensor}_zero_point"],
            [f"{tensor}_quantized"],
            name=f"{tensor}_QuantizeLinear",
        ),
        helper.make_node(
            "DequantizeLinear",
            [f"{tensor}_quantized", f"{tensor}_scale", f"{tensor}_zero_point"],
            [f"{tensor}_dequantized"],
            name=f"{tensor}_DequantizeLinear",
        ),
    ]
    return nodes, [_init(f"{tensor}_scale", np.float32(scale)), _init(f"{tensor}_zero_point", zero)]


def _weight(name: str, shape: tuple[int, ...], axis: int = 0):
    values = _RNG.standard_normal(shape).astype(np.float32)
    scale = np.full(shape[axis], np.abs(values).max() / 127, np.float32)
    shape_b = [1] * len(shape)
    shape_b[axis] = -1
    quant = np.clip(np.round(values / scale.reshape(shape_b)), -127, 127).astype(np.int8)
    node = helper.make_node(
        "DequantizeLinear",
        [f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"],
        [f"{name}_dequantized"],
        name=f"{name}_DequantizeLinear",
        axis=axis,
    )
    inits = [
        _init(f"{name}_quantized", quant),
        _init(f"{name}_scale", scale),
        _init(f"{name}_zero_point", np.zeros_like(scale, dtype=np.int8)),
    ]
    return [node], inits


def _model(nodes, inits, inputs, outputs) -> bytes:
    def info(name, shape, elem=TensorProto.FLOAT):
        return helper.make_tensor_value_info(name, elem, shape)

    graph = helper.make_graph(
        nodes,
        "g",
        [info(*spec) for spec in inputs],
        [info(*spec) for spec in outputs],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _conv(tail: str, x_zero=_U8_128, out_zero=_U8_128, name: str = "conv") -> bytes:
    """x -> Q/DQ -> Conv(int8 weight DQ) -> `tail` -> y, on [1, 8, 6, 6]."""
    nodes, inits = _pair("x", zero=x_zero)
    w_nodes, w_inits = _weight("w", (8, 8, 3, 3))
    nodes += w_nodes
    inits += w_inits
    conv_out = "y" if tail == "graph-output" else "c"
    nodes.append(
        helper.make_node(
            "Conv", ["x_dequantized", "w_dequantized"], [conv_out], name=name, pads=[1, 1, 1, 1]
        )
    )
    outputs = [("y", [1, 8, 6, 6])]
    if tail in ("q", "relu-q", "bn-q"):
        source = {"q": "c", "relu-q": "r", "bn-q": "b"}[tail]
        if tail == "relu-q":
            nodes.append(helper.make_node("Relu", ["c"], ["r"], name="relu"))
        if tail == "bn-q":
            nodes.append(helper.make_node("BatchNormalization", ["c", "g", "bb", "m", "v"], ["b"]))
            nodes[-1].name = "bn"
            ones, zeros = np.ones(8, np.float32), np.zeros(8, np.float32)
            inits += [_init("g", ones), _init("bb", zeros), _init("m", zeros), _init("v", ones)]
        pair, pair_inits = _pair(source, scale=0.05, zero=out_zero)
        pair[1].output[0] = "y"
        nodes += pair
        inits += pair_inits
    elif tail == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["c"], ["y"], name="sigmoid"))
    elif tail == "q-and-second-reader":  # x's pair feeds the Conv and a float Sigmoid
        pair, pair_inits = _pair("c", scale=0.05, zero=out_zero)
        pair[1].output[0] = "y"
        nodes += pair + [helper.make_node("Sigmoid", ["x_dequantized"], ["s"], name="sig")]
        inits += pair_inits
        outputs.append(("s", [1, 8, 6, 6]))
    return _model(nodes, inits, [("x", [1, 8, 6, 6])], outputs)


def _binary(op: str, b_zero=_U8_128, second_reader: bool = False) -> bytes:
    nodes, inits = _pair("a")
    b_nodes, b_inits = _pair("b", scale=0.03, zero=b_zero)
    out_nodes, out_inits = _pair("o", scale=0.04)
    out_nodes[1].output[0] = "y"
    nodes += b_nodes + [helper.make_node(op, ["a_dequantized", "b_dequantized"], ["o"], name="op")]
    nodes += out_nodes
    outputs = [("y", [4, 16])]
    if second_reader:
        nodes.append(helper.make_node("Sigmoid", ["b_dequantized"], ["s"], name="sig"))
        outputs.append(("s", [4, 16]))
    inputs = [("a", [4, 16]), ("b", [4, 16])]
    return _model(nodes, inits + b_inits + out_inits, inputs, outputs)


def _matmul_float_weight() -> bytes:
    nodes, inits = _pair("x")
    out_nodes, out_inits = _pair("c")
    out_nodes[1].output[0] = "y"
    weight = _init("w", _RNG.standard_normal((16, 8)).astype(np.float32))
    nodes += [helper.make_node("MatMul", ["x_dequantized", "w"], ["c"], name="mm")] + out_nodes
    return _model(nodes, inits + out_inits + [weight], [("x", [2, 3, 16])], [("y", [2, 3, 8])])


def _truth(model: bytes, name: str, op_type: str):
    return fusion_truth(model, {name: op_type})[name]


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (lambda: _conv("sigmoid"), "no QuantizeLinear"),
        (lambda: _conv("graph-output"), "graph output"),
        (lambda: _conv("bn-q"), "BatchNormalization"),
        (lambda: _conv("relu-q", out_zero=np.uint8(128)), "Relu"),
    ],
    ids=["no-q-after-conv", "conv-feeds-graph-output", "bn-before-q", "relu-zero-point-128"],
)
def test_conv_that_ort_cannot_fuse_is_float_with_its_reason(model, reason):
    runtime = _truth(model(), "conv", "Conv")
    assert runtime.status == "float" and runtime.runs_as not in INTEGER_OPS
    assert runtime.runs_as in ("Conv", "FusedConv") and runtime.ort_node == "conv"
    assert reason in runtime.reason


@pytest.mark.skipif(ON_ARM, reason="ORT fuses int8 activations into QLinearConv on ARM")
def test_int8_activation_shared_by_two_readers_stays_float_on_x86():
    # ORT rewrites an int8 Q/DQ pair to uint8 only when its Q feeds one DQ; this one feeds two.
    model = _conv("q-and-second-reader", x_zero=np.int8(5), out_zero=np.int8(5))
    runtime = _truth(model, "conv", "Conv")
    assert runtime.status == "float"
    assert "activation is int8" in runtime.reason and "feeds 2" in runtime.reason


def test_int8_activation_with_one_reader_is_rewritten_to_uint8_and_fuses():
    model = _conv("q", x_zero=np.int8(5), out_zero=np.int8(5))
    assert _truth(model, "conv", "Conv").runs_as == "QLinearConv"


def test_relu_made_redundant_by_a_zero_point_of_zero_still_fuses():
    runtime = _truth(_conv("relu-q", out_zero=np.uint8(0)), "conv", "Conv")
    assert runtime.status == "fused" and runtime.runs_as == "QLinearConv"


def test_unnamed_conv_is_found_by_the_weight_it_reads():
    model = _conv("q", name="")
    runtime = _truth(model, "", "Conv")
    assert runtime.status == "fused" and runtime.runs_as == "QLinearConv"
    ort_node = _nodes(optimized_graph(model))[runtime.ort_node]
    assert "w_quantized" in ort_node.input


def test_op_without_a_cpu_qlinear_kernel_is_float():
    runtime = _truth(_binary("Sub"), "op", "Sub")
    assert runtime.status == "float" and runtime.runs_as == "Sub"
    assert "no quantized kernel" in runtime.reason


def test_add_of_differently_typed_inputs_is_float():
    runtime = _truth(_binary("Add", b_zero=np.int8(0), second_reader=True), "op", "Add")
    assert runtime.status == "float" and "different types" in runtime.reason


def test_matmul_with_a_float_weight_is_float_with_a_weight_reason():
    runtime = _truth(_matmul_float_weight(), "mm", "MatMul")
    assert runtime.status == "float" and runtime.runs_as == "MatMul"
    assert "weights 'w'" in runtime.reason


def test_node_that_ort_constant_folds_is_removed():
    shape = _init("shape", np.array([1, 16], np.int64))
    const = _init("k", np.arange(16, dtype=np.float32).reshape(4, 4) / 16)
    nodes, inits = _pair("a")
    k_nodes, k_inits = _pair("kr", scale=0.01, zero=np.uint8(0))
    out_nodes, out_inits = _pair("o", scale=0.04)
    out_nodes[1].output[0] = "y"
    nodes = [helper.make_node("Reshape", ["k", "shape"], ["kr"], name="reshape")] + k_nodes + nodes
    nodes += [helper.make_node("Add", ["a_dequantized", "kr_dequantized"], ["o"], name="add")]
    model = _model(
        nodes + out_nodes,
        [shape, const] + inits + k_inits + out_inits,
        [("a", [1, 16])],
        [("y", [1, 16])],
    )
    truth = fusion_truth(model, {"reshape": "Reshape", "add": "Add"})
    assert truth["reshape"].status == "removed" and truth["reshape"].ort_node is None
    assert truth["add"].runs_as == "QLinearAdd"
    summary = fusion_summary(truth)
    assert summary["removed"] == 1 and summary["unfused"][0]["name"] == "reshape"


def test_summary_lists_unfused_nodes_with_reasons():
    summary = fusion_summary(fusion_truth(_conv("bn-q"), {"conv": "Conv"}))
    assert summary["fused"] == 0 and summary["float"] == 1
    (entry,) = summary["unfused"]
    assert entry["name"] == "conv" and "BatchNormalization" in entry["reason"]


def test_bad_plans_and_models_are_model_errors(tmp_path):
    model = _conv("q")
    with pytest.raises(ModelError, match="'missing'"):
        fusion_truth(model, {"missing": "Conv"})
    with pytest.raises(ModelError, match="'conv' is a Gemm in the plan but a Conv"):
        fusion_truth(model, {"conv": "Gemm"})
    with pytest.raises(ModelError, match="not a readable ONNX model"):
        fusion_truth(b"not a model", {"conv": "Conv"})
    with pytest.raises(ModelError, match="does not exist"):
        optimized_graph(tmp_path / "absent.onnx")


# Fused vs unfused outputs


def test_exact_fusion_compares_as_infinite_sqnr():
    # QLinearConcat requantizes each input with the same rounding as DQ -> Concat -> Q.
    nodes, inits = _pair("a")
    b_nodes, b_inits = _pair("b", scale=0.03)
    out_nodes, out_inits = _pair("o", scale=0.04)
    out_nodes[1].output[0] = "y"
    concat = helper.make_node("Concat", ["a_dequantized", "b_dequantized"], ["o"], name="cat")
    concat.attribute.append(helper.make_attribute("axis", 1))
    model = _model(
        nodes + b_nodes + [concat] + out_nodes,
        inits + b_inits + out_inits,
        [("a", [4, 16]), ("b", [4, 16])],
        [("y", [4, 32])],
    )
    assert _truth(model, "cat", "Concat").runs_as == "QLinearConcat"
    rng = np.random.default_rng(1)
    feeds = [
        {name: (rng.standard_normal((4, 16)) * 2).astype(np.float32) for name in ("a", "b")}
        for _ in range(3)
    ]
    assert compare_fused_unfused(model, feeds) == {"y": math.inf}


def test_integer_kernels_differ_from_the_literal_qdq_graph(cnn):
    model_path, _ = cnn
    rng = np.random.default_rng(2)
    feeds = [{"image": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    sqnr = compare_fused_unfused(model_path, feeds)
    assert list(sqnr) == ["output"]
    # Requantization rounding (and, on x86 without VNNI, saturation) makes them differ; the
    # outputs still agree far better than noise.
    assert math.isfinite(sqnr["output"]) and sqnr["output"] > 10.0


def test_the_spilled_reference_gives_the_sqnr_of_both_runs_in_memory(cnn, monkeypatch):
    """The unfused outputs wait on disk and are read back in slices (here 7 values, and a
    batch of 3 run a row at a time): the SQNR is the one of both runs' whole arrays, and the
    scratch folder is gone afterwards."""
    model_path, _ = cnn
    rng = np.random.default_rng(3)
    feeds = [{"image": rng.standard_normal((3, 3, 8, 8)).astype(np.float32)} for _ in range(2)]
    fused = create_session(model_path, threads=1, optimize=True)
    unfused = create_session(model_path, threads=1, optimize=False)
    expected = SignalQuality()
    for feed in feeds:  # row by row, as the runs below (kernels may block a batch otherwise)
        for row in range(3):
            one = {"image": feed["image"][row : row + 1]}
            expected.update(unfused.run(None, one)[0], fused.run(None, one)[0])
    monkeypatch.setattr(fused_vs_unfused, "CHUNK_ELEMENTS", 7)
    monkeypatch.setattr("qtool.ort.sessions.RUN_ELEMENTS", 1)
    reference = run_unfused(model_path, feeds)
    assert [(run.batch, run.rows) for run in reference.runs] == [
        (batch, slice(row, row + 1)) for batch in range(2) for row in range(3)
    ]
    folder = reference.runs[0].files[0].parent
    assert folder.is_dir()
    sqnr = compare_fused_unfused(model_path, feeds, fused=fused, reference=reference)
    assert sqnr["output"] == pytest.approx(expected.sqnr_db(), rel=1e-9)
    assert not folder.exists()


def test_a_full_scratch_folder_is_an_output_error_not_a_bad_batch(mlp, monkeypatch):
    """The unfused outputs go to the system's temporary folder: when it is full the error says
    so (and TMPDIR), the batch is not blamed, and nothing is left behind."""
    model_path, _ = mlp
    made = []
    real = fused_vs_unfused.tempfile.TemporaryDirectory

    def tracked(**kwargs):
        made.append(real(**kwargs))
        return made[-1]

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fused_vs_unfused.tempfile, "TemporaryDirectory", tracked)
    monkeypatch.setattr(fused_vs_unfused.np, "save", full)
    feeds = [{"x": np.zeros((1, 16), np.float32)}]
    with pytest.raises(OutputError, match="No space left on device.*TMPDIR"):
        run_unfused(model_path, feeds)
    assert not Path(made[0].name).exists()


def test_compare_rejects_empty_and_mismatched_feeds(mlp):
    model_path, _ = mlp
    with pytest.raises(DataError, match="at least one batch"):
        compare_fused_unfused(model_path, [])
    with pytest.raises(DataError, match="batch 0"):
        compare_fused_unfused(model_path, [{"wrong": np.zeros((1, 16), np.float32)}])
