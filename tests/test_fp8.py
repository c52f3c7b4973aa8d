"""FP8 E4M3 Q/DQ (issue 20, item 2): valid files, scales from the calibration methods, and the
CPU runs them unfused and says so.

ORT's CPU provider cannot load a float8 QDQ model with its graph optimizations on (its QDQ fusion
builds MatMulIntegerToFloat on float8, measured below), so the verify stage, `evaluate` and the
search run FP8 models unfused (ORT_DISABLE_ALL) and no fused number is made up.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration.fp8_range import FP8_MAX, compute_fp8_range, fp8_round
from qtool.calibration.observers import TensorStats
from qtool.model.prepare import tensor_types
from qtool.ort.float8 import unfused_only_reason
from qtool.plan.layout import plan_layout
from qtool.plan.settings import Override, QuantizationSpec


@pytest.fixture(scope="module")
def fp8_run(digits_dir, cli):
    out = digits_dir / "out-fp8"
    recipe = digits_dir / "recipe-fp8.yaml"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    evaluated = cli("evaluate", recipe, "-o", out, "--no-progress", "--json", out / "eval.json")
    return out, result, evaluated


def test_fp8_file_is_valid_float8_qdq_at_opset_19_or_later(fp8_run) -> None:
    out, _, _ = fp8_run
    model = onnx.load(str(out / "model.fp8.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version >= 19
    float8 = {i.name: i for i in model.graph.initializer if i.data_type == TensorProto.FLOAT8E4M3FN}
    weights = [name for name in float8 if name.endswith(".weight_quantized")]
    # conv3 (32 -> 64) and fc1 (1024 -> 64); TensorRT's FP8 kernels gain nothing on conv1
    # (1 input channel), conv2 (16) and fc2 (N = 10): they stay FP16
    assert sorted(weights) == ["conv3.weight_quantized", "fc1.weight_quantized"]
    zero_points = [i for name, i in float8.items() if name.endswith("_zero_point")]
    assert zero_points and all(
        not numpy_helper.to_array(z).astype(np.float32).any() for z in zero_points
    )
    # weights: one scale per output channel, amax / 448, and the largest lands on 448
    fp32 = onnx.load(str(out / "model.fp32.onnx"))
    original = numpy_helper.to_array(
        next(i for i in fp32.graph.initializer if i.name == "conv3.weight")
    )
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    scale = values["conv3.weight_scale"].astype(np.float32)
    amax = np.abs(original).reshape(original.shape[0], -1).max(axis=1)
    np.testing.assert_allclose(scale, amax / FP8_MAX, rtol=1e-3)  # FP16-typed scale: 11 bits
    stored = values["conv3.weight_quantized"].astype(np.float32)
    assert np.abs(stored).reshape(original.shape[0], -1).max(axis=1).min() == FP8_MAX


def test_fp8_verify_and_evaluate_run_unfused_and_say_so(fp8_run) -> None:
    out, result, evaluated = fp8_run
    report = json.loads((out / "report.json").read_text())
    runtime = report["runtime"]
    assert runtime["unfused_only"] and runtime["fused"] == 0 and runtime["planned"] == 2
    nodes = [n for n in report["nodes"] if n["precision"] == "fp8"]
    assert len(nodes) == 2 and all(n["runtime"]["status"] == "unfused-only" for n in nodes)
    conv = next(n for n in nodes if n["name"] == "/conv3/Conv")
    dtypes = {t["role"]: t["dtype"] for t in conv["tensors"]}
    assert dtypes == {"activation": "float8e4m3fn", "weight": "float8e4m3fn"}
    text = " ".join(result.output.split())
    assert "unfused only (float8: no fused CPU variant)" in text
    assert evaluated.exit_code == 0, evaluated.output
    assert "no fused variant" in " ".join(evaluated.output.split())
    scores = json.loads((out / "eval.json").read_text())
    assert scores["fused_variant"] == {
        "available": False,
        "why_not": scores["fused_variant"]["why_not"],
        "judged": "unfused",
    }
    output = scores["outputs"][0]
    assert output["fused"] is None and output["fused_vs_unfused"] is None
    # E4M3 keeps 3 mantissa bits: with FP8 on the two layers TensorRT runs in FP8 and the rest
    # FP16, the CNN lands near int8 (36.3 dB measured; all five layers in FP8 gave 27.6)
    assert 33.0 < output["unfused"]["sqnr_db"] < 45.0
    assert all(g["model"] == "unfused" for g in scores["gates"])


def _fp8_matmul(scale_x: float = 1 / 400) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 16)).astype(np.float32)
    scale = (np.abs(weight).max(0) / FP8_MAX).astype(np.float32)
    values = (weight / scale).astype(ml_dtypes.float8_e4m3fn)
    zero8 = np.zeros((), ml_dtypes.float8_e4m3fn)
    inits = [
        numpy_helper.from_array(values, "wq"),
        numpy_helper.from_array(scale, "ws"),
        numpy_helper.from_array(np.zeros(16, ml_dtypes.float8_e4m3fn), "wz"),
        numpy_helper.from_array(np.array(scale_x, np.float32), "xs"),
        numpy_helper.from_array(zero8, "xz"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
            helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=1),
            helper.make_node("MatMul", ["xd", "wd"], ["y"]),
        ],
        "fp8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_ort_cpu_loads_float8_only_unfused_which_is_why_qtool_runs_it_so() -> None:
    model = _fp8_matmul()
    assert unfused_only_reason(model) is not None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    with pytest.raises(Exception, match="float8e4m3fn"):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options)
    x = np.random.default_rng(1).random((2, 8), dtype=np.float32)
    assert np.all(np.isfinite(session.run(None, {"x": x})[0]))


def _stats(values: np.ndarray, bins: int = 4096) -> TensorStats:
    bound = float(np.abs(values).max())
    half = 2.0 ** np.ceil(np.log2(bound))
    counts, _ = np.histogram(values, bins=bins, range=(-half, half))
    return TensorStats("t", float(values.min()), float(values.max()), half, counts, values.size)


def test_fp8_ranges_amax_percentile_and_an_mse_search_on_e4m3s_grid() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(200_000), [400.0, -350.0]]).astype(np.float32)
    stats = _stats(values)
    low, high = compute_fp8_range(stats, "minmax")
    assert (low, high) == (-400.0, 400.0)  # amax: scale = amax / 448
    _, mse = compute_fp8_range(stats, "mse")
    _, percentile = compute_fp8_range(stats, "percentile", 99.9)
    assert percentile < 5.0 and 0.0 < mse <= 400.0

    def error(threshold: float) -> float:
        scale = threshold / FP8_MAX
        return float(
            np.mean(
                (fp8_round(np.clip(values, -threshold, threshold) / scale) * scale - values) ** 2
            )
        )

    assert error(mse) <= error(400.0)  # the search never does worse than amax on its data


def _two_readers(path: Path) -> None:
    """x feeds two Convs; an fp8 model with one of them overridden to int8 writes a pair of each
    type on x and each Conv reads its own."""
    rng = np.random.default_rng(0)
    # 32 channels in and out: TensorRT's FP8 kernels take the Convs (tensorrt_fp8.py)
    w = [rng.standard_normal((32, 32, 3, 3)).astype(np.float32) for _ in range(2)]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "wa"], ["a"], name="a", pads=[1, 1, 1, 1]),
            helper.make_node("Conv", ["x", "wb"], ["b"], name="b", pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["a", "b"], ["y"], name="add"),
        ],
        "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32, 8, 8])],
        [numpy_helper.from_array(w[0], "wa"), numpy_helper.from_array(w[1], "wb")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_int8_and_fp8_readers_of_one_tensor_get_a_pair_each(tmp_path, cli) -> None:
    _two_readers(tmp_path / "model.onnx")
    np.savez(
        tmp_path / "calib.npz", x=np.random.default_rng(0).random((16, 32, 8, 8), dtype=np.float32)
    )
    raw = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, 32, 8, 8]},
        "calibration": {"data": {"npz": "calib.npz"}, "batch_size": 8, "method": "minmax"},
        "quantization": {
            "target": "tensorrt",
            "precision": "fp8",
            "op_types": ["Conv", "Add"],
            "overrides": [{"nodes": "a", "precision": "int8"}],
        },
        "output": {"dir": "out"},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    result = cli("quantize", tmp_path / "recipe.yaml", "--no-progress")
    assert result.exit_code == 0, result.output
    model = onnx.load(str(tmp_path / "out" / "model.fp8.onnx"))
    onnx.checker.check_model(model, full_check=True)
    reads = {n.name: n.input[0] for n in model.graph.node if n.op_type == "Conv"}
    assert reads == {"a": "x_dequantized", "b": "x_fp8_dequantized"}
    zero = {i.name: i.data_type for i in model.graph.initializer if i.name.endswith("_zero_point")}
    assert zero["x_zero_point"] == TensorProto.INT8
    assert zero["x_fp8_zero_point"] == TensorProto.FLOAT8E4M3FN
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    nodes = {n["name"]: n for n in report["nodes"]}
    assert (nodes["a"]["precision"], nodes["b"]["precision"]) == ("int8", "fp8")
    # an Add has no FP8 form (nothing FP8 to feed): it stays float, and the report says why
    assert nodes["add"]["precision"] == "float" and "no fp8 form" in nodes["add"]["reason"]
    # the placement check sees an int8 Conv and an fp8 Conv, each with its own weight type
    assert report["tensorrt"]["placement"]["passed"], report["tensorrt"]["placement"]


def _shapes_model() -> onnx.ModelProto:
    """One weighted node per case of TensorRT's FP8 kernel rules (qtool/plan/ops/tensorrt_fp8.py),
    chained so that every node reads a float activation."""
    rng = np.random.default_rng(0)

    def weight(name: str, *dims: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(dims).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w_first"], ["a"], name="first", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["a", "w_mid"], ["b"], name="mid", pads=[1, 1, 1, 1]),
        helper.make_node(
            "Conv", ["b", "w_dw"], ["c"], name="depthwise", pads=[1, 1, 1, 1], group=32
        ),
        helper.make_node("Conv", ["c", "w_big"], ["d"], name="big7x7", pads=[3, 3, 3, 3]),
        helper.make_node("Conv", ["d", "w_five"], ["e"], name="five", pads=[2, 2, 2, 2]),
        helper.make_node("GlobalAveragePool", ["e"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w_fc"], ["g"], name="fc", transB=1),
        helper.make_node("MatMul", ["g", "w_head"], ["y"], name="head"),
    ]
    inits = [
        weight("w_first", 32, 3, 3, 3),  # 3 input channels
        weight("w_mid", 32, 32, 3, 3),  # FP8
        weight("w_dw", 32, 1, 3, 3),  # depthwise: 1 input channel per group
        weight("w_big", 32, 32, 7, 7),  # 49-element filter
        weight("w_five", 32, 32, 5, 5),  # 25 elements: FP8
        weight("w_fc", 64, 32),  # Gemm transB: N = 64, K = 32: FP8
        weight("w_head", 64, 10),  # N = 10
    ]
    graph = helper.make_graph(
        nodes,
        "shapes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_tensorrt_fp8_leaves_nodes_its_fp8_kernels_gain_nothing_on_in_the_float_type() -> None:
    """ModelOpt's TensorRT rules, from the weight shapes: Convs with <= 16 channels in (per
    group) or out, or filters over 32 elements, and GEMMs with K or N under 16 stay FP16, each
    with the reason, and only the FP8 nodes' inputs get FP8 Q/DQ pairs; int8 for TensorRT is
    untouched."""
    model = onnx.shape_inference.infer_shapes(_shapes_model())
    floats = {n for n, (elem, _) in tensor_types(model).items() if elem == TensorProto.FLOAT}
    spec = QuantizationSpec(
        target="tensorrt",
        op_types=("Conv", "Gemm", "MatMul"),
        precision="fp8",
        float_type="fp16",
    )
    layout = plan_layout(model, spec, floats)
    plan = layout.plan
    fp8 = {n.name for n in plan if n.precision == "fp8"}
    assert fp8 == {"mid", "five", "fc"}
    # Q/DQ on the inputs of the FP8 nodes only (TensorRT's placement): not on mid's output,
    # which only the FP16 depthwise Conv reads, nor on five's, which the pool reads
    assert {slot.tensor for slot in layout.activations.values()} == {"a", "d", "f"}
    reasons = {n.name: (n.precision, n.source, n.reason) for n in plan}
    for name, words in [
        ("first", "Conv with C_in = 3 per group, C_out = 32; one <= 16"),
        ("depthwise", "depthwise Conv with C_in = 1 per group, C_out = 32"),
        ("big7x7", "Conv filter 7x7 = 49 elements, > 32"),
        ("head", "MatMul with K = 64, N = 10; under 16"),
    ]:
        precision, source, reason = reasons[name]
        assert (precision, source) == ("fp16", "unsupported"), reasons[name]
        assert words in reason and "TensorRT's FP8 kernels gain nothing" in reason, reason
    # an explicit per-node fp8 asks for a form the node does not take: the same answer
    pinned = QuantizationSpec(
        target="tensorrt",
        op_types=("Conv", "Gemm", "MatMul"),
        precision="fp8",
        float_type="fp16",
        overrides=(Override(where="test", nodes=("first",), precision="fp8"),),
    )
    assert plan_layout(model, pinned, floats).plan["first"].precision == "fp16"
    # int8 for TensorRT keeps every weighted node quantized: the rules are FP8's
    int8 = dataclasses.replace(spec, precision=None)
    int8_layout = plan_layout(model, int8, floats)
    quantized = {n.name for n in int8_layout.plan if n.precision == "int8"}
    assert {"first", "mid", "depthwise", "big7x7", "five", "fc", "head"} <= quantized
    assert "e" in {slot.tensor for slot in int8_layout.activations.values()}  # a Conv output
