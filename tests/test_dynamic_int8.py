"""Dynamic INT8 end to end: `activations: dynamic`, the attention split and its errors.

A two-block transformer (LayerNorm, 2-head attention, GELU MLP) exported by torch is quantized
with its MatMul inputs quantized at run time: the written graph must be ONNX Runtime's dynamic
form (DynamicQuantizeLinear + MatMulInteger), ORT must fuse it (the report's runtime truth is
checked against ORT's own optimized graph), the outputs must stay close to float, the bytes must
repeat, calibration must ask for no range it does not use, and the Q/K-dynamic V-static split
must find Q, K and V from the graph's structure.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration.requests import plan_requests
from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError
from qtool.metrics.signal import SignalQuality
from qtool.pipeline.planning import float_tensors, plan
from qtool.plan.attention import node_roles

DIM, HEADS, TOKENS = 32, 2, 8


class _Block(torch.nn.Module):
    """A BERT-style block: separate Q, K, V projections (nn.Linear: MatMul + Add in ONNX)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(DIM, DIM) for _ in range(4))
        self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.f1, self.f2 = torch.nn.Linear(DIM, 4 * DIM), torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = DIM // HEADS
        y = self.ln1(x)
        q, k, v = (p(y).view(b, t, HEADS, d).transpose(1, 2) for p in (self.q, self.k, self.v))
        attention = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1) @ v
        x = x + self.o(attention.transpose(1, 2).reshape(b, t, DIM))
        return x + self.f2(torch.nn.functional.gelu(self.f1(self.ln2(x))))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The exported model, its calibration and evaluation samples, and a base recipe."""
    root = tmp_path_factory.mktemp("dynamic")
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block()).eval()
    torch.onnx.export(
        model,
        (torch.randn(1, TOKENS, DIM),),
        str(root / "model.onnx"),
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    rng = np.random.default_rng(0)
    np.savez(root / "cal.npz", x=rng.normal(size=(16, TOKENS, DIM)).astype(np.float32))
    np.savez(root / "eval.npz", x=rng.normal(size=(24, TOKENS, DIM)).astype(np.float32))
    return root


def _recipe(folder: Path, name: str, quantization: dict, out: str | None = None) -> Path:
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, TOKENS, DIM]},
        "calibration": {"data": {"npz": "cal.npz"}, "batch_size": 4, "method": "minmax"},
        "evaluation": {"data": {"npz": "eval.npz"}, "batch_size": 8},
        "quantization": {"op_types": ["MatMul", "Gemm"], **quantization},
        "output": {"dir": out or f"out-{name}"},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _preset_recipe(folder: Path, preset: str, out: str) -> Path:
    """A recipe that takes everything but the model and its data from `preset`."""
    recipe = {
        "base": preset,
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, TOKENS, DIM]},
        "calibration": {"data": {"npz": "cal.npz"}, "batch_size": 4},
        "output": {"dir": out},
    }
    path = folder / f"{preset}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _ort_ops(model: Path, tmp: Path) -> collections.Counter:
    """Op counts of the graph ONNX Runtime's CPU provider optimizes (qtool's own session
    settings are not used: this is the independent check of the report's runtime truth)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp / f"{model.stem}.ort.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    return collections.Counter(n.op_type for n in optimized.graph.node)


def _cosine(reference: Path, candidate: Path, inputs: np.ndarray, optimize: bool) -> float:
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    float_run = ort.InferenceSession(str(reference), providers=["CPUExecutionProvider"])
    quant_run = ort.InferenceSession(str(candidate), options, providers=["CPUExecutionProvider"])
    quality = SignalQuality(cosine="rows")
    for start in range(0, len(inputs), 8):
        feed = {"x": inputs[start : start + 8]}
        quality.update(float_run.run(None, feed)[0], quant_run.run(None, feed)[0])
    return quality.cosine()


@pytest.fixture(scope="module")
def dynamic_run(folder: Path) -> Path:
    from typer.testing import CliRunner

    from qtool.cli import app

    recipe = _recipe(folder, "dynamic", {"activations": "dynamic"})
    result = CliRunner().invoke(app, ["quantize", str(recipe), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "dynamic int8" in result.output
    return folder / "out-dynamic"


def test_whole_model_dynamic_writes_ort_form_and_ort_fuses_it(dynamic_run, folder, tmp_path):
    model = onnx.load(str(dynamic_run / "model.int8.onnx"))
    ops = collections.Counter(n.op_type for n in model.graph.node)
    # 12 projections with a weight (q, k, v, o, f1, f2 per block): MatMulInteger each; one
    # DynamicQuantizeLinear per distinct input (q/k/v share the LayerNorm output): 4 per block
    assert ops["MatMulInteger"] == 12 and ops["DynamicQuantizeLinear"] == 8
    assert ops["QuantizeLinear"] == 0 and ops["DequantizeLinear"] == 0  # nothing static
    assert ops["MatMul"] == 4  # the attention MatMuls (two activations) stay float, as ORT's
    report = json.loads((dynamic_run / "report.json").read_text())
    assert report["summary"]["dynamic_nodes"] == 12
    assert report["summary"]["activation_qdq_pairs"] == 0
    dynamic = {n["name"]: n for n in report["nodes"] if n.get("activations") == "dynamic"}
    assert len(dynamic) == 12 and set(report["dynamic"]["nodes"]) == set(dynamic)
    assert all(n["runtime"]["status"] == "fused" for n in dynamic.values())
    # what the report says ORT runs is what ORT's optimized graph holds
    ort_ops = _ort_ops(dynamic_run / "model.int8.onnx", tmp_path)
    reported = collections.Counter(n["runtime"]["runs_as"] for n in dynamic.values())
    for kernel in ("DynamicQuantizeMatMul", "MatMulIntegerToFloat"):
        assert reported[kernel] == ort_ops[kernel], (kernel, reported, ort_ops)
    # q/k/v share one DynamicQuantizeLinear, so ORT keeps it and runs MatMulIntegerToFloat
    # behind it; o, f1, f2 own theirs and become DynamicQuantizeMatMul
    assert reported == {"MatMulIntegerToFloat": 6, "DynamicQuantizeMatMul": 6}
    assert ort_ops["MatMulInteger"] == 0
    attention = [
        n for n in report["nodes"] if n["op_type"] == "MatMul" and n["precision"] == "float"
    ]
    assert len(attention) == 4 and all("no constant weight" in n["reason"] for n in attention)
    inputs = np.load(folder / "eval.npz")["x"]
    for optimize in (True, False):  # fused, and the standard ops run as written
        fp32, int8 = dynamic_run / "model.fp32.onnx", dynamic_run / "model.int8.onnx"
        cosine = _cosine(fp32, int8, inputs, optimize)
        assert cosine > 0.999, (optimize, cosine)


def test_dynamic_model_is_byte_identical_twice(dynamic_run, folder, cli):
    recipe = _recipe(folder, "dynamic", {"activations": "dynamic"})
    again = folder / "again"
    result = cli("quantize", recipe, "-o", again, "--no-progress")
    assert result.exit_code == 0, result.output
    assert (again / "model.int8.onnx").read_bytes() == (
        dynamic_run / "model.int8.onnx"
    ).read_bytes()


def test_evaluate_runs_the_dynamic_model_fused_and_unfused(dynamic_run, folder, cli, tmp_path):
    recipe = _recipe(folder, "dynamic", {"activations": "dynamic"})
    report = tmp_path / "eval.json"
    args = ["-o", dynamic_run, "--latency-runs", "2", "--json", report, "--no-progress"]
    result = cli("evaluate", recipe, *args, "--min-cosine", "0.999")
    assert result.exit_code == 0, result.output
    (output,) = json.loads(report.read_text())["outputs"]
    assert output["fused"]["cosine"] > 0.999 and output["unfused"]["cosine"] > 0.999


def test_calibration_asks_for_no_dynamic_range(dynamic_run, folder):
    """All dynamic: no range is requested, so the calibration pass reads no data. The split:
    only the range of the tensor V's projection reads (the LayerNorm output Q and K quantize
    at run time) is requested."""
    prepared = onnx.load(str(dynamic_run / "model.fp32.onnx"))
    floats = float_tensors(prepared)
    spec = load_recipe(_recipe(folder, "dynamic", {"activations": "dynamic"})).quantization
    layout = plan(prepared, spec, "minmax", "test", floats)
    requests = plan_requests(layout)
    assert requests.ranges == () and not requests.needs_data
    assert len(layout.dynamic) == 8
    # and the quantize run read no calibration batch: its provenance records no data
    written = onnx.load(str(dynamic_run / "model.int8.onnx"), load_external_data=False)
    meta = {p.key: p.value for p in written.metadata_props}
    assert meta["qtool.calibration_data_sha256"] == "none"
    split = load_recipe(_split_recipe(folder)).quantization
    layout = plan(prepared, split, "minmax", "test", floats)
    v_inputs = sorted({layout.plan[n].name for n in layout.plan.nodes if n.endswith("/v/MatMul")})
    assert len(v_inputs) == 2
    wanted = sorted(
        next(n for n in prepared.graph.node if n.name == name).input[0] for name in v_inputs
    )
    assert list(plan_requests(layout).ranges) == wanted


def _split_recipe(folder: Path) -> Path:
    return _recipe(
        folder,
        "split",
        {
            "activations": "dynamic",
            "overrides": [{"roles": ["attention-v"], "activations": "int8"}],
        },
    )


def test_attention_roles_come_from_the_graph(dynamic_run):
    prepared = onnx.load(str(dynamic_run / "model.fp32.onnx"))
    roles = node_roles(prepared, float_tensors(prepared))
    for block in ("0", "1"):
        assert roles[f"/{block}/q/MatMul"] == {"attention-q"}
        assert roles[f"/{block}/k/MatMul"] == {"attention-k"}
        assert roles[f"/{block}/v/MatMul"] == {"attention-v"}
        assert roles[f"/{block}/MatMul"] == {"attention-scores"}
        assert roles[f"/{block}/MatMul_1"] == {"attention-context"}
    for name in ("/0/o/MatMul", "/0/f1/MatMul", "/1/f2/MatMul"):
        assert name not in roles  # the output projection and the MLP play no role


def test_q_k_dynamic_v_static_split_on_attention(folder, cli, tmp_path):
    """The preset's split, asked in a recipe: Q and K (and the rest) at run time, V through a
    calibrated uint8 Q/DQ pair that ORT fuses into MatMulIntegerToFloat."""
    recipe = _split_recipe(folder)
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    out = folder / "out-split"
    report = json.loads((out / "report.json").read_text())
    nodes = {n["name"]: n for n in report["nodes"]}
    for block in ("0", "1"):
        for proj in ("q", "k", "o", "f1", "f2"):
            assert nodes[f"/{block}/{proj}/MatMul"]["activations"] == "dynamic"
        v = nodes[f"/{block}/v/MatMul"]
        assert v["activations"] == "int8" and "roles attention-v" in v["reason"]
        assert (v["runtime"]["status"], v["runtime"]["runs_as"]) == (
            "fused",
            "MatMulIntegerToFloat",
        )
        assert v["tensors"][0]["method"] == "minmax"  # a calibrated range
    model = onnx.load(str(out / "model.int8.onnx"))
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["MatMulInteger"] == 10 and ops["QuantizeLinear"] == 2
    assert report["summary"]["dynamic_nodes"] == 10
    inputs = np.load(folder / "eval.npz")["x"]
    assert _cosine(out / "model.fp32.onnx", out / "model.int8.onnx", inputs, True) > 0.999
    # the shipped preset says the same
    preset = _preset_recipe(folder, "int8-dynamic-transformer", "out-preset")
    result = cli("quantize", preset, "--no-progress")
    assert result.exit_code == 0, result.output
    preset_report = json.loads((folder / "out-preset" / "report.json").read_text())
    preset_plan = {n["name"]: n.get("activations") for n in preset_report["nodes"]}
    assert preset_plan == {n["name"]: n.get("activations") for n in report["nodes"]}


def _gemm_model(path: Path) -> None:
    """x [N, 16] -> Gemm(transB=1, bias) -> Relu -> Gemm(transB=0, bias): both dynamic."""
    rng = np.random.default_rng(3)
    w1 = rng.normal(size=(24, 16)).astype(np.float32)
    w2 = rng.normal(size=(24, 8)).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "gemms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(rng.normal(size=24).astype(np.float32), "b1"),
            numpy_helper.from_array(w2, "w2"),
            numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "b2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.mark.parametrize("ranges", ["per-tensor", "per-token"])
def test_dynamic_gemm_with_transposed_weight(tmp_path, cli, ranges):
    _gemm_model(tmp_path / "model.onnx")
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "cal.npz", x=rng.normal(size=(16, 16)).astype(np.float32))
    quantization = {"op_types": ["Gemm"], "activations": "dynamic", "dynamic_ranges": ranges}
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, 16]},
        "calibration": {"data": {"npz": "cal.npz"}, "batch_size": 4},
        "quantization": quantization,
        "output": {"dir": "out"},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli("quantize", tmp_path / "recipe.yaml", "--no-progress")
    assert result.exit_code == 0, result.output
    written = onnx.load(str(tmp_path / "out" / "model.int8.onnx"))
    by_name = {n.name: n for n in written.graph.node}
    assert by_name["fc1"].op_type == "MatMulInteger" and by_name["fc2"].op_type == "MatMulInteger"
    stored = {i.name: list(i.dims) for i in written.graph.initializer}
    assert stored["w1_quantized"] == [16, 24]  # transB weight stored [K, N]
    assert by_name["fc1_bias_Add"].input[1] == "b1"
    if ranges == "per-token":  # the [N] column sums of the [K, N] weight as stored
        assert stored["w1_column_sums"] == [24]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert {n["name"]: n["runtime"]["status"] for n in report["nodes"] if n.get("runtime")} == {
        "fc1": "fused",
        "fc2": "fused",
    }
    inputs = rng.normal(size=(32, 16)).astype(np.float32)
    cpu = ["CPUExecutionProvider"]
    float_run = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=cpu)
    quant_run = ort.InferenceSession(str(tmp_path / "out" / "model.int8.onnx"), providers=cpu)
    quality = SignalQuality(cosine="rows")
    quality.update(float_run.run(None, {"x": inputs})[0], quant_run.run(None, {"x": inputs})[0])
    assert quality.sqnr_db() > 30


@pytest.mark.parametrize(
    ("quantization", "key"),
    [
        ({"activations": "dynamc"}, "quantization.activations: must be one of int8, dynamic"),
        (
            {"activations": "dynamic", "target": "tensorrt"},
            "quantization.activations: dynamic is ONNX Runtime's form",
        ),
        (
            {"activations": "dynamic", "weights": {"bits": 4}},
            "quantization.activations: dynamic needs int8 weights",
        ),
        (
            {"activations": "dynamic", "weights": {"granularity": "block"}},
            "quantization.weights.granularity: block contradicts activations dynamic",
        ),
        (
            {"activations": "dynamic", "float_type": "fp16"},
            "quantization.float_type: fp16 contradicts activations dynamic",
        ),
        (
            {"overrides": [{"roles": ["attention-x"], "activations": "dynamic"}]},
            "quantization.overrides[0].roles[0]: must be one of attention-q",
        ),
        (
            {"overrides": [{"nodes": ["/0/q/*"], "activations": "dynamc"}]},
            "quantization.overrides[0].activations: must be one of",
        ),
    ],
)
def test_bad_dynamic_recipe_exits_2_naming_the_key(folder, cli, quantization, key):
    recipe = _recipe(folder, "bad", quantization, out="out-bad")
    with pytest.raises(RecipeError, match=r"^.*" + __import__("re").escape(key)):
        load_recipe(recipe)
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 2
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0], result.output
    assert not (folder / "out-bad").exists()


def test_roles_on_a_model_without_attention_exit_2(tmp_path, cli):
    _gemm_model(tmp_path / "model.onnx")
    np.savez(tmp_path / "cal.npz", x=np.ones((4, 16), np.float32))
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, 16]},
        "calibration": {"data": {"npz": "cal.npz"}, "batch_size": 4},
        "quantization": {
            "op_types": ["Gemm"],
            "activations": "dynamic",
            "overrides": [{"roles": ["attention-v"], "activations": "int8"}],
        },
        "output": {"dir": "out"},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli("quantize", tmp_path / "recipe.yaml", "--no-progress")
    assert result.exit_code == 2
    assert "quantization.overrides[0].roles[0]: no node of the model plays 'attention-v'" in (
        " ".join(result.output.split())
    )
    assert not (tmp_path / "out" / "model.int8.onnx").exists()


def test_analyze_and_auto_take_a_dynamic_recipe(folder, cli):
    """The analysis compares a dynamic node's float input (its quantization error shows in its
    output), and the search's size model counts each DynamicQuantizeLinear with its readers;
    the plan.yaml both write keeps `activations: dynamic`."""
    recipe = _recipe(folder, "dynamic-analyze", {"activations": "dynamic"})
    result = cli("analyze", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    out = folder / "out-dynamic-analyze"
    layers = json.loads((out / "sensitivity.json").read_text())
    assert "activations: dynamic" in (out / "plan.yaml").read_text()
    assert "/0/q/MatMul" in json.dumps(layers)
    auto = _recipe(folder, "dynamic-auto", {"activations": "dynamic"})
    raw = yaml.safe_load(auto.read_text())
    raw["mixed_precision"] = {"budget": {"min_cosine": 0.999}, "max_iterations": 2}
    auto.write_text(yaml.safe_dump(raw))
    result = cli("quantize", auto, "--no-progress")
    assert result.exit_code == 0, result.output
    report = json.loads((folder / "out-dynamic-auto" / "report.json").read_text())
    assert report["summary"]["dynamic_nodes"] >= 1


class _FusedQkvRope(torch.nn.Module):
    """One projection split three ways (a fused QKV), rotary embeddings on Q and K (Slice,
    Neg, Concat, Mul by constant cos/sin tables), K repeated for grouped heads."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)
        angles = torch.arange(TOKENS)[:, None] * torch.arange(DIM // HEADS // 2)[None, :] / 7
        self.register_buffer("cos", torch.cat([angles.cos(), angles.cos()], -1))
        self.register_buffer("sin", torch.cat([angles.sin(), angles.sin()], -1))

    @staticmethod
    def _rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = DIM // HEADS
        q, k, v = (p.view(b, t, HEADS, d).transpose(1, 2) for p in self.qkv(x).chunk(3, dim=-1))
        q = q * self.cos + self._rotate(q) * self.sin
        k = k * self.cos + self._rotate(k) * self.sin
        attention = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1) @ v
        return self.out(attention.transpose(1, 2).reshape(b, t, DIM))


def test_attention_roles_of_a_fused_qkv_with_rotary_embeddings(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "fused.onnx"
    torch.onnx.export(
        _FusedQkvRope().eval(),
        (torch.randn(1, TOKENS, DIM),),
        str(path),
        input_names=["x"],
        output_names=["y"],
        opset_version=17,
        dynamo=False,
    )
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    roles = node_roles(model, float_tensors(model))
    by_role = collections.defaultdict(set)
    for name, played in roles.items():
        for role in played:
            by_role[role].add(name)
    (qkv,) = by_role["attention-q"]
    assert by_role["attention-k"] == by_role["attention-v"] == {qkv}
    assert next(n for n in model.graph.node if n.name == qkv).op_type == "MatMul"
    assert len(by_role["attention-scores"]) == len(by_role["attention-context"]) == 1
    # the output projection (a MatMul with a weight too) feeds no attention MatMul
    constants = {i.name for i in model.graph.initializer}
    weighted = {
        n.name
        for n in model.graph.node
        if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in constants
    }
    assert len(weighted) == 2 and {name for name in weighted if name in roles} == {qkv}


def test_one_node_dynamic_in_a_static_model(folder, dynamic_run, cli):
    """`activations: dynamic` on one node by name: only that node quantizes its input at run
    time, its input's range is not requested (no other node reads that tensor), the rest keep
    their calibrated pairs."""
    quantization = {
        "activations": "int8",
        "overrides": [{"nodes": "/0/f1/MatMul", "activations": "dynamic"}],
    }
    recipe = _recipe(folder, "one", quantization)
    prepared = onnx.load(str(dynamic_run / "model.fp32.onnx"))
    layout = plan(prepared, load_recipe(recipe).quantization, "minmax", "test")
    f1_input = next(n for n in prepared.graph.node if n.name == "/0/f1/MatMul").input[0]
    assert layout.dynamic == [f1_input]
    ranges = plan_requests(layout).ranges
    assert f1_input not in ranges and len(ranges) > 10
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    report = json.loads((folder / "out-one" / "report.json").read_text())
    assert report["dynamic"]["nodes"] == ["/0/f1/MatMul"]
    nodes = {n["name"]: n for n in report["nodes"]}
    assert nodes["/0/f1/MatMul"]["runtime"]["runs_as"] == "DynamicQuantizeMatMul"
    assert nodes["/0/f2/MatMul"]["activations"] == "int8"
    assert nodes["/0/f2/MatMul"]["runtime"]["status"] == "fused"


def test_qat_refuses_dynamic_activations(digits_dir, tmp_path, cli):
    """QAT has no fake quantization of run-time ranges: refused up front, naming the key."""
    recipe = digits_dir / "qat-dynamic.yaml"  # beside the example's model and data
    recipe.write_text(
        yaml.safe_dump(
            {
                "base": "recipe.yaml",
                "quantization": {
                    "algorithms": [],
                    "overrides": [{"op_types": ["Gemm"], "activations": "dynamic"}],
                },
                "qat": {"epochs": 1},
                "output": {"dir": str(tmp_path / "out")},
            }
        )
    )
    result = cli("qat", recipe, "--no-progress")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "quantization.overrides[0].activations: qtool qat does not train dynamic INT8" in text
    assert not (tmp_path / "out").exists()


def test_a_4bit_node_under_dynamic_activations_is_weight_only(folder, dynamic_run):
    """Dynamic int8 needs 8-bit weights: a node an override gives 4-bit weights (as the
    search's int4 candidate does) is weight-only, not left float; the others stay dynamic."""
    quantization = {
        "activations": "dynamic",
        "overrides": [{"nodes": "/0/f1/MatMul", "weights": {"bits": 4}}],
    }
    prepared = onnx.load(str(dynamic_run / "model.fp32.onnx"))
    spec = load_recipe(_recipe(folder, "int4-node", quantization)).quantization
    layout = plan(prepared, spec, "minmax", "test")
    f1 = layout.plan["/0/f1/MatMul"]
    assert (f1.precision, f1.activations) == ("int4", "float")
    assert "weight-only (dynamic activations need 8-bit weights)" in f1.reason
    assert layout.plan["/0/f2/MatMul"].activations == "dynamic"
    f1_input = next(n for n in prepared.graph.node if n.name == f1.name).input[0]
    assert f1_input not in layout.dynamic  # read by no dynamic node now


def test_per_token_ranges_write_the_row_form_and_report_what_ort_runs(folder, cli, tmp_path):
    """`dynamic_ranges: per-token`: no DynamicQuantizeLinear; one row quantization per distinct
    input (shared by q/k/v as before); MatMulInteger, which ORT runs unfused (no fused kernel
    takes per-row scales), and the report says so from ORT's own graph."""
    quantization = {"activations": "dynamic", "dynamic_ranges": "per-token"}
    recipe = _recipe(folder, "per-token", quantization)
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "one range per-token" in result.output
    out = folder / "out-per-token"
    model = onnx.load(str(out / "model.int8.onnx"))
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["MatMulInteger"] == 12 and ops["DynamicQuantizeLinear"] == 0
    assert ops["ReduceMin"] == ops["ReduceMax"] == 8
    report = json.loads((out / "report.json").read_text())
    assert report["dynamic"]["ranges"] == "per-token"
    dynamic = [n for n in report["nodes"] if n.get("activations") == "dynamic"]
    assert len(dynamic) == 12
    assert {n["runtime"]["runs_as"] for n in dynamic} == {"MatMulInteger"}
    ort_ops = _ort_ops(out / "model.int8.onnx", tmp_path)
    assert ort_ops["MatMulInteger"] == 12 and ort_ops["DynamicQuantizeMatMul"] == 0
    inputs = np.load(folder / "eval.npz")["x"]
    for optimize in (True, False):
        cosine = _cosine(out / "model.fp32.onnx", out / "model.int8.onnx", inputs, optimize)
        assert cosine > 0.999, (optimize, cosine)
    again = folder / "per-token-again"
    assert cli("quantize", recipe, "-o", again, "--no-progress").exit_code == 0
    assert (again / "model.int8.onnx").read_bytes() == (out / "model.int8.onnx").read_bytes()


def test_per_token_ranges_without_a_dynamic_node_are_refused(folder, cli):
    recipe = _recipe(folder, "per-token-static", {"dynamic_ranges": "per-token"})
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 2
    assert "quantization.dynamic_ranges" in result.output
    assert "activations dynamic" in result.output


def test_w8a8_llm_preset_is_per_token_dynamic(dynamic_run, folder):
    """`base: w8a8-llm` plans every weighted MatMul dynamic with per-token ranges: the registry
    entry it is written by is the per-token one, and no range is calibrated."""
    spec = load_recipe(_preset_recipe(folder, "w8a8-llm", "out-w8a8-llm")).quantization
    assert spec.activations == "dynamic" and spec.dynamic_ranges == "per-token"
    prepared = onnx.load(str(dynamic_run / "model.fp32.onnx"))
    layout = plan(prepared, spec, "minmax", "test", float_tensors(prepared))
    assert layout.dynamic_ranges == "per-token" and len(layout.dynamic) == 8
    assert plan_requests(layout).ranges == ()
