"""FP16 and BF16 written into the file (issue 20, item 1): the typing pass and its keep rules.

The digits CNN is written FP16 with nothing quantized and INT8 (TensorRT) with FP16 elsewhere:
every op computes in FP16 in the file ONNX Runtime loads, Casts stand only where the recipe allows
a boundary, the file is half the FP32 one and scores >= 60 dB against it. Small hand-built
models show each keep-in-FP32 rule with its reason in report.json, a per-node fp16 in an FP32
model, BF16 (kept FP32 where the opset's schema has no BF16 form, scored on the FP32 emulation)
and the recipe's refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError
from qtool.write.float_type import type_model
from qtool.write.keep_fp32 import FP16_MAX, KEEP_RULES

LOW = {TensorProto.FLOAT16, TensorProto.BFLOAT16}


def _types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    infos = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    types = {i.name: i.type.tensor_type.elem_type for i in infos}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    return types


def _computes_in(node: onnx.NodeProto, types: dict[str, int]) -> int | None:
    floats = {TensorProto.FLOAT, *LOW}
    for name in [*node.output, *node.input]:
        if types.get(name) in floats:
            return types[name]
    return None


def _casts_at_allowed_boundaries(model: onnx.ModelProto, kept: set[str]) -> list[str]:
    """Every Cast's input is a graph input, its output a graph output, or a neighbour of it is
    a node the report keeps FP32 (or a Q/DQ kept for its scale); returns the Casts that are not."""
    graph = model.graph
    inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    stray = []
    for cast in (n for n in graph.node if n.op_type == "Cast"):
        source, out = cast.input[0], cast.output[0]
        if source in inputs or out in outputs:
            continue
        neighbours = [producer.get(source), *readers.get(out, [])]
        if any(n is not None and n.name in kept for n in neighbours):
            continue
        stray.append(cast.name)
    return stray


@pytest.fixture(scope="module")
def fp16_run(digits_dir, cli):
    out = digits_dir / "out-fp16"
    result = cli("quantize", digits_dir / "recipe-fp16.yaml", "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    evaluated = cli(
        "evaluate",
        digits_dir / "recipe-fp16.yaml",
        "-o",
        out,
        "--no-progress",
        "--min-sqnr",
        "60",
        "--json",
        out / "eval.json",
    )
    return out, result, evaluated


def test_fp16_digits_every_op_in_fp16_casts_only_at_the_graph_boundary(fp16_run) -> None:
    out, result, _ = fp16_run
    model = onnx.load(str(out / "model.fp16.onnx"))
    onnx.checker.check_model(model, full_check=True)
    types = _types(model)
    computing = [n for n in model.graph.node if n.op_type != "Cast"]
    assert computing and all(_computes_in(n, types) == TensorProto.FLOAT16 for n in computing)
    weights = [i for i in model.graph.initializer if i.data_type == TensorProto.FLOAT16]
    assert len(weights) == 10  # every weight and bias of the 3 Convs and 2 Gemms
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert [c.input[0] for c in casts] == ["image", "output_fp16"]  # in and out: the boundary
    assert _casts_at_allowed_boundaries(model, set()) == []
    # graph input and output keep their FP32 type (float_io: keep)
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    report = json.loads((out / "report.json").read_text())
    assert report["float_type"]["nodes_by_type"] == {"fp16": 11}
    assert {c["why"] for c in report["float_type"]["casts"]} == {
        "graph input keeps its type (float_io: keep)",
        "graph output keeps its type (float_io: keep)",
    }
    nodes = {n["name"]: n for n in report["nodes"]}
    assert nodes["/conv1/Conv"]["precision"] == "fp16"
    assert nodes["/conv1/Conv"]["float_type"] == {"computes_in": "fp16"}
    assert "float type fp16: nodes compute in 11 fp16" in " ".join(result.output.split())


def test_fp16_digits_runs_in_ort_at_60_db_and_half_the_file(fp16_run) -> None:
    out, _, evaluated = fp16_run
    assert evaluated.exit_code == 0, evaluated.output
    scores = json.loads((out / "eval.json").read_text())
    output = scores["outputs"][0]
    assert output["fused"]["sqnr_db"] >= 60.0 and output["unfused"]["sqnr_db"] >= 60.0
    size = scores["size"]
    assert 0.45 <= size["quant_bytes"] / size["fp32_bytes"] <= 0.55
    session = ort.InferenceSession(str(out / "model.fp16.onnx"))
    image = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    assert session.run(None, {"image": image})[0].dtype == np.float32


def test_int8_tensorrt_with_fp16_elsewhere_types_the_qdq(digits_dir, cli) -> None:
    out = digits_dir / "out-int8-fp16"
    result = cli("quantize", digits_dir / "recipe-int8-fp16.yaml", "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    model = onnx.load(str(out / "model.int8.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version >= 19  # typed Q/DQ need opset 19
    scales = {i.name: i.data_type for i in model.graph.initializer if i.name.endswith("_scale")}
    assert scales and set(scales.values()) == {TensorProto.FLOAT16}
    types = _types(model)
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear":
            assert types[node.output[0]] == TensorProto.FLOAT16, node.name
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert len(casts) == 2 and _casts_at_allowed_boundaries(model, set()) == []
    # TensorRT's DequantizeLinear takes no int32: the biases stay in the float type
    assert not [i for i in model.graph.initializer if i.data_type == TensorProto.INT32]
    report = json.loads((out / "report.json").read_text())
    assert report["tensorrt"]["placement"]["passed"], report["tensorrt"]["placement"]


# The keep rules, each on a model built to trip it


def _keep_model(path: Path) -> None:
    """x -> Mul(x, 2000) -> m; m -> Mul(m, 50) -> big (beyond 65504); m -> ReduceSum -> s;
    big and s are outputs; x -> Relu -> r -> Mul(r, 1e-6) -> tiny (every value subnormal)."""
    constants = [
        numpy_helper.from_array(np.array(2000.0, np.float32), "c2000"),
        numpy_helper.from_array(np.array(50.0, np.float32), "c50"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "c_tiny"),
        numpy_helper.from_array(np.array([1], np.int64), "axis"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "c2000"], ["m"], name="scale"),
            helper.make_node("Mul", ["m", "c50"], ["big"], name="blowup"),
            helper.make_node("ReduceSum", ["m", "axis"], ["s"], name="sum", keepdims=1),
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Mul", ["r", "c_tiny"], ["tiny"], name="shrink"),
        ],
        "keep",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [
            helper.make_tensor_value_info("big", TensorProto.FLOAT, ["N", 16]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, ["N", 1]),
            helper.make_tensor_value_info("tiny", TensorProto.FLOAT, ["N", 16]),
        ],
        constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, path)


def _recipe(folder: Path, quantization: dict, name: str = "recipe.yaml") -> Path:
    rng = np.random.default_rng(0)
    np.savez(folder / "calib.npz", x=rng.random((64, 16), dtype=np.float32))
    raw = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, 16]},
        "calibration": {"data": {"npz": "calib.npz"}, "batch_size": 16, "method": "minmax"},
        "quantization": quantization,
        "output": {"dir": "out"},
    }
    path = folder / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_keep_rules_keep_nodes_in_fp32_with_their_reasons(tmp_path, cli) -> None:
    _keep_model(tmp_path / "model.onnx")
    recipe = _recipe(tmp_path, {"op_types": [], "float_type": "fp16"})
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    nodes = {n["name"]: n for n in report["nodes"]}
    assert nodes["scale"]["precision"] == "fp16"  # 2000 x [0, 1): fine in FP16
    kept = {name: nodes[name]["float_type"]["kept_by"] for name in ("blowup", "sum", "shrink")}
    assert kept == {"blowup": "overflow", "sum": "reduction", "shrink": "underflow"}
    for name in kept:
        assert nodes[name]["precision"] == "float" and nodes[name]["source"] == "kept-fp32"
    assert "65504" in nodes["blowup"]["reason"] and "'big' reaches" in nodes["blowup"]["reason"]
    assert "accumulates" in nodes["sum"]["reason"]
    assert report["float_type"]["kept_fp32"] == {"overflow": 1, "reduction": 1, "underflow": 1}
    model = onnx.load(str(tmp_path / "out" / "model.fp16.onnx"))
    onnx.checker.check_model(model, full_check=True)
    types = _types(model)
    by_name = {n.name: n for n in model.graph.node}
    assert _computes_in(by_name["scale"], types) == TensorProto.FLOAT16
    assert _computes_in(by_name["relu"], types) == TensorProto.FLOAT16
    for name in kept:
        assert _computes_in(by_name[name], types) == TensorProto.FLOAT, name
    assert _casts_at_allowed_boundaries(model, set(kept)) == []
    # the kept nodes make the numbers: no inf, and the tiny values keep their precision
    x = np.random.default_rng(1).random((4, 16), dtype=np.float32)
    big, total, tiny = ort.InferenceSession(str(tmp_path / "out" / "model.fp16.onnx")).run(
        None, {"x": x}
    )
    assert np.all(np.isfinite(big)) and big.max() > FP16_MAX
    np.testing.assert_allclose(tiny, np.maximum(x, 0) * 1e-6, rtol=1e-3)
    np.testing.assert_allclose(total, (x * 2000).sum(axis=1, keepdims=True), rtol=2e-3)


def test_the_keep_rules_are_a_table_with_reasons() -> None:
    names = [rule.name for rule in KEEP_RULES]
    assert names == [
        "no-low-type",
        "reduction",
        "normalization",
        "overflow",
        "constant-overflow",
        "underflow",
    ]
    assert all(rule.why and rule.applies_to for rule in KEEP_RULES)


def test_per_node_fp16_in_an_fp32_model_is_cast_around(tmp_path, cli) -> None:
    _keep_model(tmp_path / "model.onnx")
    overrides = [{"nodes": "relu", "precision": "fp16"}]
    recipe = _recipe(tmp_path, {"op_types": [], "overrides": overrides})
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    model = onnx.load(str(tmp_path / "out" / "model.fp16.onnx"))
    types = _types(model)
    by_name = {n.name: n for n in model.graph.node}
    assert _computes_in(by_name["relu"], types) == TensorProto.FLOAT16
    for name in ("scale", "blowup", "sum", "shrink"):
        assert _computes_in(by_name[name], types) == TensorProto.FLOAT
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert sorted(c.input[0] for c in casts) == ["r", "x"]  # into and out of the FP16 Relu
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    whys = {c["tensor"]: c["why"] for c in report["float_type"]["casts"]}
    assert "planned FP32" in whys["r"]


def test_bf16_keeps_ops_without_a_bf16_schema_and_is_scored_on_the_emulation(tmp_path, cli):
    """At opset 17 ReduceSum has no BF16 form (rule no-low-type, before the reduction rule);
    Relu and Mul have. ORT's CPU provider runs no BF16 Mul: evaluate scores the emulation."""
    _keep_model(tmp_path / "model.onnx")
    recipe = _recipe(tmp_path, {"target": "tensorrt", "op_types": [], "float_type": "bf16"})
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    nodes = {n["name"]: n for n in report["nodes"]}
    assert nodes["relu"]["float_type"] == {"computes_in": "bf16"}
    assert nodes["blowup"]["float_type"] == {"computes_in": "bf16"}  # BF16 does not overflow
    assert nodes["sum"]["float_type"]["kept_by"] in ("no-low-type", "reduction")
    assert "FP32 copy" in report["runtime"]["emulated"]
    np.savez(tmp_path / "eval.npz", x=np.random.default_rng(2).random((32, 16), dtype=np.float32))
    evaluated = cli(
        "evaluate",
        "--fp32",
        tmp_path / "out" / "model.fp32.onnx",
        "--quant",
        tmp_path / "out" / "model.bf16.onnx",
        "--data",
        tmp_path / "eval.npz",
        "--no-progress",
        "--json",
        tmp_path / "eval.json",
    )
    assert evaluated.exit_code == 0, evaluated.output
    scores = json.loads((tmp_path / "eval.json").read_text())
    assert "FP32 copy" in scores["emulated"]
    relu_out = next(o for o in scores["outputs"] if o["name"] == "tiny")
    assert 40.0 < relu_out["unfused"]["sqnr_db"] < 70.0  # BF16's 8 bits: about 50 dB


def test_type_model_leaves_a_model_asked_fp32_unchanged(tmp_path) -> None:
    _keep_model(tmp_path / "model.onnx")
    model = onnx.load(str(tmp_path / "model.onnx"))
    typed = type_model(model, {}, "fp32", {}, {})
    assert not typed.casts and all(r.computes_in == "fp32" for r in typed.nodes.values())
    assert [n.op_type for n in typed.model.graph.node] == [n.op_type for n in model.graph.node]


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"precision": "fp8"}, "quantization.precision: fp8 is not offered by target ort-cpu"),
        ({"float_type": "bf16"}, "quantization.float_type: bf16 is not offered by target ort-cpu"),
        ({"float_io": "float_type"}, "quantization.float_io: applies to a float_type other"),
        ({"float_type": "fp64"}, "quantization.float_type: must be one of fp32, fp16, bf16"),
        (
            {"overrides": [{"nodes": "relu", "precision": "fp16", "weights": {"bits": 8}}]},
            "precision fp16 has no Q/DQ: weights and activations do not apply",
        ),
        (
            {"target": "tensorrt", "precision": "fp8", "weights": {"bits": 4}},
            "quantization.weights.bits: 4 contradicts precision 'fp8'",
        ),
        (
            {"target": "tensorrt", "precision": "fp8", "weights": {"method": "gptq"}},
            "quantization.weights.method: gptq is for integer weights",
        ),
        (
            {"target": "tensorrt", "precision": "fp8", "activations": "float"},
            "quantization.activations: float contradicts precision fp8",
        ),
    ],
)
def test_recipe_refuses_what_the_target_cannot_run(tmp_path, quantization, message) -> None:
    _keep_model(tmp_path / "model.onnx")
    with pytest.raises(RecipeError, match=message):
        load_recipe(_recipe(tmp_path, quantization))


@pytest.mark.parametrize(
    ("preset", "precision", "float_type", "target"),
    [("fp8-tensorrt", "fp8", "fp16", "tensorrt"), ("int8-tensorrt-fp16", None, "fp16", "tensorrt")],
)
def test_presets_load_by_name(tmp_path, preset, precision, float_type, target) -> None:
    _keep_model(tmp_path / "model.onnx")
    path = _recipe(tmp_path, {})
    raw = yaml.safe_load(path.read_text())
    raw["base"] = preset
    del raw["quantization"]
    path.write_text(yaml.safe_dump(raw))
    loaded = load_recipe(path).quantization
    assert (loaded.precision, loaded.float_type, loaded.target) == (precision, float_type, target)
    assert loaded.may_need_opset21  # FP8 Q/DQ and typed Q/DQ both need opset >= 19


def test_float_io_float_type_declares_the_graph_io_in_fp16(digits_dir, cli) -> None:
    """Asked for (`float_io: float_type`), the graph inputs and outputs take the float type: no
    Cast at all, and ORT and `evaluate` feed the model FP16 as it declares."""
    recipe = digits_dir / "recipe-fp16-io.yaml"
    recipe.write_text("base: recipe-fp16.yaml\nquantization: {float_io: float_type}\n")
    out = digits_dir / "out-fp16-io"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    model = onnx.load(str(out / "model.fp16.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert not [n for n in model.graph.node if n.op_type == "Cast"]
    evaluated = cli("evaluate", recipe, "-o", out, "--no-progress", "--min-sqnr", "60")
    assert evaluated.exit_code == 0, evaluated.output
