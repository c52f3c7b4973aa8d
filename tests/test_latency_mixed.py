"""Mixed precision with `objective: latency`: ONNX Runtime's profiler times mapped to plan nodes
(runtime/profile.py), and a search that minimises the summed time instead of the bytes.

The profiler tests run real sessions on the digits example's float and int8 models and on a
hand-built QDQ model whose Q/DQ nodes have a known owner; the search test runs `qtool quantize`
on the digits example with a budget every plan meets, so the knapsack's answer is each node's
fastest measured precision, which the test checks by hand from report.json.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.config.recipe import load_recipe
from qtool.runtime.fusion import optimized_graph
from qtool.runtime.profile import OTHER, node_times
from qtool.search.knapsack import Choice, solve
from qtool.search.promote import predicted_size

PLANNED_OPS = ("Conv", "Gemm", "MatMul")


def _planned(model: onnx.ModelProto) -> dict[str, str]:
    return {n.name: n.op_type for n in model.graph.node if n.op_type in PLANNED_OPS}


def _digits_feed() -> dict[str, np.ndarray]:
    return {"image": np.random.default_rng(0).random((1, 1, 8, 8), dtype=np.float32)}


@pytest.mark.parametrize("which", ["model.fp32.onnx", "model.int8.onnx"])
def test_profiler_times_every_plan_node_of_digits(digits_run, which):
    model = onnx.load(digits_run.out / which)
    planned = _planned(model)
    assert len(planned) == 5
    times = node_times(model.SerializeToString(), planned, _digits_feed(), runs=5)
    assert set(times.nodes) == set(planned)
    assert all(us > 0 for us in times.nodes.values()), times.nodes
    # Every profiled kernel is counted exactly once: planned nodes plus the rest.
    assert sum(times.nodes.values()) + times.other_us == pytest.approx(times.total_us)
    # The Flatten and MaxPool between the layers belong to no planned node.
    for entry in times.ort_nodes.values():
        if entry["op"] in ("Flatten", "MaxPool", "NhwcMaxPool"):
            assert entry["owners"] == [OTHER]


def test_int8_input_quantize_counts_toward_the_first_conv(digits_run):
    model = onnx.load(digits_run.out / "model.int8.onnx")
    serialized = model.SerializeToString()
    ort = optimized_graph(serialized)
    quantize = [n.name for n in ort.graph.node if n.op_type == "QuantizeLinear"]
    first = [n.name for n in ort.graph.node if n.op_type == "QuantizeLinear" and "image" in n.input]
    assert first, quantize
    times = node_times(serialized, _planned(model), _digits_feed(), runs=3)
    assert times.ort_nodes[first[0]]["owners"] == ["/conv1/Conv"]
    assert all(times.ort_nodes[name]["owners"] != [OTHER] for name in quantize)


def _qdq_model() -> onnx.ModelProto:
    """x -> Q -> DQ -> MatMul(DQ(int8 w)) -> Q -> DQ -> Softmax: the MatMul fuses (QLinearMatMul);
    the input Q feeds it, the output DQ reads from it for the float Softmax."""
    rng = np.random.default_rng(0)
    weight = rng.integers(-127, 128, (64, 64)).astype(np.int8)
    inits = [
        numpy_helper.from_array(weight, "w_q"),
        numpy_helper.from_array(np.array(0.01, np.float32), "w_s"),
        numpy_helper.from_array(np.array(0, np.int8), "w_z"),
        numpy_helper.from_array(np.array(0.02, np.float32), "x_s"),
        numpy_helper.from_array(np.array(128, np.uint8), "x_z"),
        numpy_helper.from_array(np.array(0.05, np.float32), "y_s"),
        numpy_helper.from_array(np.array(128, np.uint8), "y_z"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"], name="x_Q"),
        helper.make_node("DequantizeLinear", ["xq", "x_s", "x_z"], ["xd"], name="x_DQ"),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"], name="w_DQ"),
        helper.make_node("MatMul", ["xd", "wd"], ["y"], name="/a/MatMul"),
        helper.make_node("QuantizeLinear", ["y", "y_s", "y_z"], ["yq"], name="y_Q"),
        helper.make_node("DequantizeLinear", ["yq", "y_s", "y_z"], ["yd"], name="y_DQ"),
        helper.make_node("Softmax", ["yd"], ["out"], name="/soft/Softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 64])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_qdq_time_goes_to_the_node_it_feeds_or_reads_from():
    model = _qdq_model().SerializeToString()
    ops = {n.op_type: n.name for n in optimized_graph(model).graph.node}
    assert "QLinearMatMul" in ops, ops  # ORT fused the MatMul: the test's premise
    feed = {"x": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
    times = node_times(model, {"/a/MatMul": "MatMul"}, feed, runs=3)
    owners = {name: entry["owners"] for name, entry in times.ort_nodes.items()}
    by_op = {entry["op"]: owners[name] for name, entry in times.ort_nodes.items()}
    assert by_op["QLinearMatMul"] == ["/a/MatMul"]
    assert by_op["QuantizeLinear"] == ["/a/MatMul"]  # quantizes its input
    assert by_op["DequantizeLinear"] == ["/a/MatMul"]  # its int8 output back to float
    assert by_op["Softmax"] == [OTHER]
    assert times.nodes["/a/MatMul"] == pytest.approx(times.total_us - times.other_us)


def test_latency_choices_give_another_plan_than_bytes():
    """One node that is small but slow in int8 (uint8 kernels without VNNI): by bytes the knapsack
    takes int8 everywhere, by time it keeps that node float; predicted size reads the bytes."""
    sizes = {
        "slow": [Choice("float", 4000, 0.0), Choice("int8", 1000, 0.1)],
        "fast": [Choice("float", 4000, 0.0), Choice("int8", 1000, 0.1)],
    }
    times = {
        "slow": [Choice("float", 10.0, 0.0), Choice("int8", 25.0, 0.1)],
        "fast": [Choice("float", 30.0, 0.0), Choice("int8", 12.0, 0.1)],
    }
    by_size = {n: c.precision for n, c in solve(sizes, 1.0).items()}
    by_time = {n: c.precision for n, c in solve(times, 1.0).items()}
    assert by_size == {"slow": "int8", "fast": "int8"}
    assert by_time == {"slow": "float", "fast": "int8"}
    assert predicted_size(sizes, by_time, 8000) == 5000


def test_recipe_accepts_objective_latency(digits_dir):
    spec = load_recipe(digits_dir / "recipe-auto-latency.yaml").mixed_precision
    assert spec.objective == "latency"


def test_latency_objective_picks_each_nodes_fastest_precision(digits_dir, tmp_path, cli):
    """A budget every plan meets (100 points): the least summed time is each node's fastest
    measured choice, which report.json's per-node times let us check by hand."""
    folder = tmp_path / "digits"
    shutil.copytree(digits_dir, folder, ignore=shutil.ignore_patterns("out*", "__pycache__"))
    recipe = folder / "recipe-auto-latency.yaml"
    raw = yaml.safe_load(recipe.read_text())
    raw["mixed_precision"]["budget"] = {"max_drop": 100}
    raw["mixed_precision"]["samples"] = 32
    recipe.write_text(yaml.safe_dump(raw))
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    report = json.loads((folder / "out-auto-latency" / "report.json").read_text())
    block = report["mixed_precision"]
    assert block["objective"] == "latency" and block["passed"]
    for node in block["nodes"]:
        times = {p: c["latency_us"] for p, c in node["choices"].items()}
        assert set(times) >= {"float", "int8"}, node
        assert times[node["precision"]] == min(times.values()), node
    predicted = block["predicted"]["latency"]
    chosen = {n["name"]: n["choices"][n["precision"]]["latency_us"] for n in block["nodes"]}
    assert predicted["planned_nodes_us"] == pytest.approx(sum(chosen.values()), abs=0.05)
    assert set(predicted["uniform_profiled_us"]) == {"float", "int8", "int4"}
    measured = block["measured"]["latency"]
    assert measured["threads"] == 1
    assert min(measured["float_ms_median"], measured["int8_ms_median"]) > 0
    assert measured["model_ms_median"] > 0
