"""INT4 and weight-only quantization through the whole pipeline: recipe, plan, writer, ORT.

The digits example (a real trained CNN exported by qtool) runs with 4-bit weights: its Gemms must
become MatMulNBits in the graph ONNX Runtime optimizes and saves, its Convs must run float on the
dequantized weights and the report must say so; small hand-built models cover the embedding
table (Gather) and the validation errors.
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration.hessian_file import load_hessians
from qtool.calibration.stats_file import load_stats
from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError
from qtool.ort.cpu import detect_cpu
from qtool.write.gptq import hessian_error
from qtool.write.int4 import dequantize, quantize_blockwise
from qtool.write.matmul_nbits import accuracy_level_for, read_nbits_weight

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _ort_optimized_ops(model: Path, tmp: Path, config: dict | None = None) -> collections.Counter:
    """Op counts of the graph ORT's CPU provider saves after optimizing `model`."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp / "optimized.onnx")
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(tmp / "optimized.onnx")).graph.node)


@pytest.fixture(scope="module")
def digits_int4(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("digits-int4") / "digits"
    shutil.copytree(EXAMPLES / "digits", folder, ignore=shutil.ignore_patterns("out*", "__py*"))
    run_cli = request.getfixturevalue("cli")
    out = folder / "out-int4"
    result = run_cli("quantize", folder / "recipe-int4.yaml", "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    return folder, out, result


def test_digits_int4_gemms_become_matmulnbits_and_convs_run_float(digits_int4, tmp_path):
    _, out, result = digits_int4
    model_path = out / "model.int4.onnx"
    model = onnx.load(str(model_path))
    assert model.opset_import[0].version >= 21
    int4 = [i for i in model.graph.initializer if i.data_type == TensorProto.INT4]
    assert len(int4) == 3  # the Conv weights, packed two per byte, behind DequantizeLinear
    # The Gemm weights are written as MatMulNBits with the level chosen for this CPU, so a
    # default ORT session runs the compute type that is fastest here.
    level, _ = accuracy_level_for(detect_cpu())
    written = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert sorted(n.name for n in written) == ["/fc1/Gemm", "/fc2/Gemm"]
    assert all({a.name: a.i for a in n.attribute}["accuracy_level"] == level for n in written)
    report_level = json.loads((out / "report.json").read_text())["int4_matmul"]
    assert report_level["format"] == "matmulnbits" and report_level["accuracy_level"] == level
    ops = _ort_optimized_ops(model_path, tmp_path)
    assert ops["MatMulNBits"] == 2 and ops["Gemm"] == 0 and ops["FusedGemm"] == 0, ops

    report = json.loads((out / "report.json").read_text())
    nodes = {n["name"]: n for n in report["nodes"]}
    for name in ("/fc1/Gemm", "/fc2/Gemm"):
        assert nodes[name]["precision"] == "int4"
        assert nodes[name]["runtime"]["runs_as"] == "MatMulNBits"
        assert nodes[name]["weight"]["transposed"] is True  # transB weight stored [K, N]
        assert nodes[name]["activations"] == "float"
    conv = report["low_bit"]["int4 Conv"]
    assert conv["nodes"] == 3 and conv["fused"] == 0
    assert "float speed" in conv["effect"]
    assert nodes["/conv1/Conv"]["runtime"]["reason"].startswith("ORT has no 4-bit Conv kernel")
    assert "int4 Conv: 3 nodes, smaller file only" in " ".join(result.output.split())
    assert "warning" not in result.output  # weight-only Convs are expected to run float
    speed = report["low_bit_speed"]  # measured here: faster, or only smaller, on this CPU
    assert speed["cpu"] == detect_cpu().describe() and speed["fp32_ms_median"] > 0
    faster = speed["speedup"] >= 1.05
    assert speed["verdict"] == ("faster" if faster else "only smaller: no speed-up on this CPU")


def test_digits_int4_keeps_accuracy_and_shrinks_the_file(digits_int4, cli, tmp_path):
    folder, out, _ = digits_int4
    report_json = tmp_path / "eval.json"
    result = cli(
        "evaluate",
        folder / "recipe-int4.yaml",
        "-o",
        out,
        "--latency-runs",
        "2",
        "--json",
        report_json,
        "--no-progress",
    )
    assert result.exit_code == 0, result.output
    evaluation = json.loads(report_json.read_text())
    gated = evaluation["outputs"][0]
    assert gated["fused"]["accuracy"] >= gated["fp32_accuracy"] - 0.01
    assert evaluation["size"]["ratio"] > 4.0
    assert evaluation["low_bit"] == {"kernels": {"MatMulNBits": 2}, "dequantized": {"Conv": 3}}
    level, _ = accuracy_level_for(detect_cpu())
    note = evaluation["matmul_nbits_accuracy_level"]
    assert note.startswith(f"MatMulNBits: 2 written with accuracy level {level}"), note


def test_accuracy_level_option_reaches_the_session_for_qdq_models(digits_int4, cli, tmp_path):
    folder, _, _ = digits_int4
    recipe = folder / "recipe-int4-qdq.yaml"
    recipe.write_text(
        "base: recipe-int4.yaml\nquantization: {int4_format: qdq, algorithms: []}\n"
        "output: {dir: out-int4-qdq}\n"
    )
    out = folder / "out-int4-qdq"
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    model = onnx.load(str(out / "model.int4.onnx"))
    assert not [n for n in model.graph.node if n.op_type == "MatMulNBits"]  # portable QDQ
    assert _ort_optimized_ops(out / "model.int4.onnx", tmp_path)["MatMulNBits"] == 2
    notes = {}
    for level in (None, "1"):
        report_json = tmp_path / f"eval-{level}.json"
        extra = [] if level is None else ["--accuracy-level", level]
        args = ["-o", out, "--latency-runs", "1", "--json", report_json, "--no-progress"]
        result = cli("evaluate", recipe, *args, *extra)
        assert result.exit_code == 0, result.output
        notes[level] = json.loads(report_json.read_text())["matmul_nbits_accuracy_level"]
    assert "2 formed from QDQ at accuracy level 4" in notes[None]
    assert "ORT's session default" in notes[None]
    assert "2 formed from QDQ at accuracy level 1: fp32" in notes["1"]
    assert "recipe/CLI" in notes["1"]
    bad = cli("evaluate", recipe, "-o", out, "--accuracy-level", "7")
    assert bad.exit_code == 2


def test_int4_output_is_byte_identical_across_runs(digits_int4, cli, tmp_path):
    folder, out, _ = digits_int4
    again = tmp_path / "again"
    result = cli("quantize", folder / "recipe-int4.yaml", "-o", again, "--no-progress")
    assert result.exit_code == 0, result.output
    assert (again / "model.int4.onnx").read_bytes() == (out / "model.int4.onnx").read_bytes()


_DATA = """
import numpy as np

def batches():
    rng = np.random.default_rng(0)
    for _ in range(4):
        ids = rng.integers(0, 50, size=(1, 6), dtype=np.int64)
        yield {"ids": ids, "x": rng.normal(size=(1, 64)).astype(np.float32)}
"""


def _write_recipe(folder: Path, quantization: dict, model: str = "model.onnx") -> Path:
    recipe = {
        "model": {"onnx": model},
        "inputs": {"ids": {"shape": [1, 6], "dtype": "int64"}, "x": [1, 64]},
        "calibration": {"data": {"python": "data.py:batches"}, "batch_size": 1},
        "quantization": quantization,
        "output": {"dir": "out"},
    }
    (folder / "data.py").write_text(_DATA)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("bits", [4, 8])
def test_embedding_table_is_gathered_quantized_by_ort(tmp_path, cli, bits):
    table = _embedding_model(tmp_path / "model.onnx")
    recipe = _write_recipe(
        tmp_path,
        {
            "op_types": ["Gather", "MatMul"],
            "weights": {"bits": 4, "block_size": 32},
            "overrides": [{"op_types": "Gather", "precision": f"int{bits}"}],
        },
    )
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    model = onnx.load(str(out / "model.int4.onnx"))
    gather = next(n for n in model.graph.node if n.name == "embed")
    assert gather.op_type == "GatherBlockQuantized" and gather.domain == "com.microsoft"
    report = json.loads((out / "report.json").read_text())
    node = next(n for n in report["nodes"] if n["name"] == "embed")
    assert node["precision"] == f"int{bits}" and node["runtime"]["status"] == "fused"
    assert report["low_bit"][f"int{bits} Gather"]["fused"] == 1
    assert _ort_optimized_ops(out / "model.int4.onnx", tmp_path)["MatMulNBits"] == 1
    # ORT's gathered rows equal the numpy dequantized reference of the same quantization
    # (8-bit tables are asymmetric: GatherBlockQuantized has no signed 8-bit form).
    reference = quantize_blockwise(
        table, bits=bits, block_size=32, symmetric=bits == 4, axis=1, name="table"
    )
    session = ort.InferenceSession(str(out / "model.int4.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 3, 49, 7, 7, 1]], dtype=np.int64)
    emb = session.run(["emb"], {"ids": ids, "x": np.zeros((1, 64), np.float32)})[0]
    np.testing.assert_allclose(emb, dequantize(reference)[ids], rtol=0, atol=1e-6)
    assert np.abs(emb - table[ids]).max() <= np.abs(table).max() / (7 if bits == 4 else 100)


def test_tensorrt_target_writes_standard_dequantize_gather(tmp_path, cli):
    _embedding_model(tmp_path / "model.onnx")
    recipe = _write_recipe(
        tmp_path,
        {"target": "tensorrt", "op_types": ["Gather"], "weights": {"bits": 8}},
    )
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    model = onnx.load(str(tmp_path / "out" / "model.int8.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert "GatherBlockQuantized" not in ops and ops.count("DequantizeLinear") == 1
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    assert dq.input[0] == "table_quantized" and helper.get_attribute_value(dq.attribute[0]) == 0


def test_int8_consumer_of_a_fused_gather_reads_its_pair(tmp_path, cli):
    """ort-cpu, int8: the Gather becomes GatherBlockQuantized and the MatMul reading the gathered
    rows is int8, so the Q/DQ pair on the rows must follow the fused Gather (the writer once
    skipped it, and onnx.checker refused the graph as not topologically sorted)."""
    rng = np.random.default_rng(1)
    table = rng.normal(size=(50, 64)).astype(np.float32)
    weight = rng.normal(size=(64, 32)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
            helper.make_node("MatMul", ["emb", "w"], ["y"], name="proj"),
        ],
        "emb",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 6]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 32])],
        initializer=[numpy_helper.from_array(table, "table"), numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    recipe = _write_recipe(tmp_path, {"op_types": ["Gather", "MatMul"]}, model="m.onnx")
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    model = onnx.load(str(tmp_path / "out" / "model.int8.onnx"))
    onnx.checker.check_model(model, full_check=True)
    order = [n.name for n in model.graph.node]
    assert order.index("embed") < order.index("emb_QuantizeLinear") < order.index("proj")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    nodes = {n["name"]: n for n in report["nodes"]}
    assert nodes["proj"]["activations"] == "int8" and nodes["embed"]["precision"] == "int8"
    session = ort.InferenceSession(str(tmp_path / "out" / "model.int8.onnx"))
    ids = np.array([[0, 3, 49, 7, 7, 1]], dtype=np.int64)
    y = session.run(["y"], {"ids": ids, "x": np.zeros((1, 64), np.float32)})[0]
    reference = table[ids] @ weight
    assert 10 * np.log10((reference**2).sum() / ((y - reference) ** 2).sum()) > 30


def _embedding_model(path: Path) -> np.ndarray:
    """ids -> Gather(table [50, 64]) (+ x) -> MatMul(W [64, 32]) -> y; `emb` is an output too."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(50, 64)).astype(np.float32)
    weight = rng.normal(size=(64, 32)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
        helper.make_node("Add", ["emb", "x"], ["h"], name="add"),
        helper.make_node("MatMul", ["h", "w"], ["y"], name="proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "emb",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 6]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 32]),
            helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, 6, 64]),
        ],
        initializer=[numpy_helper.from_array(table, "table"), numpy_helper.from_array(weight, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return table


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"weights": {"bits": 3}}, "quantization.weights.bits: must be 4 or 8"),
        ({"weights": {"block_size": 24}}, "quantization.weights.block_size: must be one of"),
        (
            {"weights": {"granularity": "per-channel", "block_size": 32}},
            "quantization.weights.block_size: applies to granularity 'block'",
        ),
        ({"weights": {"method": "hqq"}}, "quantization.weights.method: must be one of"),
        ({"activations": "int4"}, "quantization.activations: must be one of int8, dynamic, float"),
        ({"overrides": [{"precision": "int4"}]}, "quantization.overrides[0]: needs `nodes`"),
        (
            {"overrides": [{"nodes": "p*", "precision": "int4", "weights": {"bits": 8}}]},
            "quantization.overrides[0].weights.bits: 8 contradicts precision 'int4'",
        ),
        ({"per_channel": False, "weights": {"granularity": "block"}}, "quantization.per_channel"),
        (
            {"target": "tensorrt", "int4_format": "matmulnbits"},
            "quantization.int4_format: matmulnbits is ONNX Runtime's operator",
        ),
        ({"int4_format": "nbits"}, "quantization.int4_format: must be one of matmulnbits, qdq"),
        ({"accuracy_level": 5}, "quantization.accuracy_level: must be one of auto, 0"),
    ],
)
def test_bad_weight_settings_name_the_key(tmp_path, quantization, message):
    _embedding_model(tmp_path / "model.onnx")
    with pytest.raises(RecipeError, match=r"recipe\.yaml: " + _escaped(message)):
        load_recipe(_write_recipe(tmp_path, quantization))


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_pattern_matching_no_node_suggests_the_onnx_names(tmp_path, cli):
    _embedding_model(tmp_path / "model.onnx")
    recipe = _write_recipe(
        tmp_path,
        {"op_types": ["MatMul"], "overrides": [{"nodes": "projection", "precision": "float"}]},
    )
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 2
    line = " ".join(result.output.split())
    assert "quantization.overrides[0].nodes[0]: pattern 'projection' matches no node" in line
    assert "'proj'" in line
    assert not (tmp_path / "out" / "model.int8.onnx").exists()


def test_pytorch_module_name_points_to_the_exported_node_names(digits_int4, cli, tmp_path):
    folder, _, _ = digits_int4
    recipe = folder / "recipe-pt-name.yaml"
    recipe.write_text("base: recipe.yaml\nquantization:\n  exclude: [fc1]\n")
    result = cli("quantize", recipe, "-o", tmp_path / "out", "--no-progress")
    assert result.exit_code == 2
    line = " ".join(result.output.split())
    assert "quantization.exclude[0]: pattern 'fc1' matches no node" in line
    assert "'/fc1/Gemm'" in line


def test_overrides_apply_in_order_and_are_reported(digits_int4, cli, tmp_path):
    folder, _, _ = digits_int4
    recipe = folder / "recipe-mixed.yaml"
    recipe.write_text(
        "base: recipe.yaml\n"
        "quantization:\n"
        "  overrides:\n"
        "    - {op_types: Gemm, precision: int4}\n"
        "    - {nodes: '/fc2/*', precision: float}\n"
        "    - {nodes: '/conv1/*', weights: {bits: 8}, activations: float}\n"
    )
    out = tmp_path / "out"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    nodes = {n["name"]: n for n in json.loads((out / "report.json").read_text())["nodes"]}
    assert nodes["/fc1/Gemm"]["precision"] == "int4" and nodes["/fc1/Gemm"]["source"] == "override"
    assert nodes["/fc2/Gemm"]["precision"] == "float"
    assert "overrides[0]" in nodes["/fc2/Gemm"]["reason"]
    assert "overrides[1]" in nodes["/fc2/Gemm"]["reason"]
    conv1 = nodes["/conv1/Conv"]
    assert conv1["precision"] == "int8" and conv1["activations"] == "float"
    assert conv1["weight"]["format"] == "s8"
    conv2 = nodes["/conv2/Conv"]
    assert conv2["precision"] == "int8" and conv2["activations"] == "int8"
    assert conv2["runtime"]["runs_as"] == "QLinearConv"
    model = onnx.load(str(out / "model.int4.onnx"))
    conv1_inputs = next(n for n in model.graph.node if n.name == "/conv1/Conv").input
    assert conv1_inputs[0] == "image"  # weight-only: the activation has no Q/DQ pair


def test_weight_only_round_to_nearest_needs_no_statistics(tmp_path, cli):
    _embedding_model(tmp_path / "model.onnx")
    recipe = _write_recipe(tmp_path, {"op_types": ["MatMul"], "weights": {"bits": 4}})
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    stats, _ = load_stats(tmp_path / "out" / "stats.npz")
    assert stats == {}
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["summary"]["activation_qdq_pairs"] == 0
    assert report["summary"]["weight_only_nodes"] == 1
    node = next(n for n in report["nodes"] if n["name"] == "proj")
    assert node["runtime"]["runs_as"] == "MatMulNBits"


def test_gptq_streams_hessians_and_beats_round_to_nearest_on_them(digits_int4, cli, tmp_path):
    folder, _, _ = digits_int4
    recipe = folder / "recipe-gptq.yaml"
    recipe.write_text(
        "base: recipe-int4.yaml\nquantization:\n  weights: {method: gptq, block_size: 16}\n"
    )
    out = tmp_path / "gptq"
    assert cli("calibrate", recipe, "-o", out, "--no-progress").exit_code == 0
    hessians = load_hessians(out / "hessians.npz", load_stats(out / "stats.npz")[1])
    assert sorted(hessians) == ["/flatten/Flatten_output_0", "/relu4/Relu_output_0"]
    result = cli("quantize", recipe, "--stats", out / "stats.npz", "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    nodes = {n["name"]: n for n in json.loads((out / "report.json").read_text())["nodes"]}
    assert nodes["/fc1/Gemm"]["weight"]["method"] == "gptq"
    assert nodes["/conv1/Conv"]["weight"]["method"] == "mse"  # gptq is for MatMul/Gemm
    assert "gptq is for MatMul/Gemm" in nodes["/conv1/Conv"]["weight"]["reason"]

    # On the calibration Hessian (the error GPTQ minimises), the written fc1 weight beats
    # round-to-nearest with the same blocks.
    fp32 = {
        i.name: numpy_helper.to_array(i)
        for i in onnx.load(str(out / "model.fp32.onnx")).graph.initializer
    }
    weight = np.ascontiguousarray(fp32["fc1.weight"].T)  # stored [K, N]
    model = onnx.load(str(out / "model.int4.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    written = read_nbits_weight(next(n for n in model.graph.node if n.name == "/fc1/Gemm"), inits)
    h = hessians["/flatten/Flatten_output_0"].xtx
    rtn = quantize_blockwise(weight, block_size=16)
    assert hessian_error(weight, written, h) < 0.9 * hessian_error(weight, rtn, h)

    (out / "hessians.npz").unlink()
    again = cli("quantize", recipe, "--stats", out / "stats.npz", "-o", out, "--no-progress")
    assert again.exit_code == 2
    assert "hessians.npz: not found" in " ".join(again.output.split())
