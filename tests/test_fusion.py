"""Fusion truth: what ORT's CPU provider runs for each node qtool planned, read from ORT itself."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.runtime.fusion import compare_fused_unfused, fusion_summary, fusion_truth


def _conv_model(after: str) -> bytes:
    """x -> Q/DQ -> Conv(int8 weight DQ) -> `after` ("q": Q/DQ, "bn": BN then Q/DQ, "relu")."""
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
        numpy_helper.from_array(np.array(128, np.uint8), "z"),
        numpy_helper.from_array(np.ones((4, 3, 3, 3), np.int8), "w_quantized"),
        numpy_helper.from_array(np.full(4, 0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(4, np.int8), "w_zero"),
    ]
    for name, value in (("gamma", 1.0), ("beta", 0.0), ("mean", 0.0), ("var", 1.0)):
        inits.append(numpy_helper.from_array(np.full(4, value, np.float32), name))
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="x_Q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="x_DQ"),
        helper.make_node(
            "DequantizeLinear", ["w_quantized", "w_scale", "w_zero"], ["wd"], name="w_DQ", axis=0
        ),
        helper.make_node("Conv", ["xd", "wd"], ["c"], name="conv"),
    ]
    last = "c"
    if after == "bn":
        nodes.append(
            helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"])
        )
        last = "bn"
    if after == "relu":
        nodes.append(helper.make_node("Relu", [last], ["y"], name="relu"))
    else:
        nodes += [
            helper.make_node("QuantizeLinear", [last, "s", "z"], ["yq"], name="y_Q"),
            helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["y"], name="y_DQ"),
        ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def test_dq_conv_q_fuses_into_qlinearconv() -> None:
    truth = fusion_truth(_conv_model("q"), {"conv": "Conv"})
    assert truth["conv"].status == "fused" and truth["conv"].runs_as == "QLinearConv"
    assert truth["conv"].reason is None


@pytest.mark.parametrize(
    ("after", "reason"),
    [("bn", "BatchNormalization"), ("relu", "no QuantizeLinear")],
)
def test_unfusable_conv_is_reported_float_with_the_reason(after: str, reason: str) -> None:
    truth = fusion_truth(_conv_model(after), {"conv": "Conv"})
    assert truth["conv"].status == "float", truth
    assert reason in truth["conv"].reason
    summary = fusion_summary(truth)
    assert summary["planned"] == 1 and summary["fused"] == 0 and summary["float"] == 1
    assert summary["unfused"][0]["name"] == "conv"


def test_fused_and_unfused_outputs_are_compared_per_output() -> None:
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    sqnr = compare_fused_unfused(_conv_model("q"), [{"x": x}])
    assert set(sqnr) == {"y"} and sqnr["y"] > 30
    float_conv = compare_fused_unfused(_conv_model("relu"), [{"x": x}])
    assert float_conv["y"] == math.inf  # nothing fused: both runs do the same float work


def test_report_records_the_runtime_truth_of_every_quantized_node(digits_run) -> None:
    import json

    report = json.loads((digits_run.out / "report.json").read_text())
    quantized = [n for n in report["nodes"] if n["precision"] != "float"]
    assert quantized and all(n["runtime"]["status"] == "fused" for n in quantized)
    assert {n["runtime"]["runs_as"] for n in quantized} == {"QLinearConv", "QGemm"}
    runtime = report["runtime"]
    assert runtime["planned"] == runtime["fused"] == len(quantized)
    assert set(runtime["fused_vs_unfused_sqnr_db"]) == {"output"}
    assert "fuses 5 of 5 quantized nodes" in digits_run.quantize.output.replace("\n", " ")


def test_quantize_warns_when_ort_cannot_fuse(tmp_path) -> None:
    """The last Conv's output is the graph output, so it gets no QuantizeLinear and ORT cannot
    form QLinearConv: the report and the warnings must say it runs in float."""
    import textwrap

    from qtool.pipeline import quantize
    from qtool.recipe import load_recipe

    (tmp_path / "model.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def make_model():
                torch.manual_seed(0)
                return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3))
            """
        )
    )
    (tmp_path / "recipe.yaml").write_text(
        "model: {pytorch: model.py:make_model}\ninputs: {x: [1, 3, 8, 8]}\n"
        "calibration: {data: {synthetic: true, samples: 8}, method: minmax}\n"
    )
    result = quantize(load_recipe(tmp_path / "recipe.yaml"), progress=False)
    runtime = {n["name"]: n["runtime"] for n in result.report["nodes"] if "runtime" in n}
    last = runtime["/1/Conv"]
    assert last["status"] == "float" and "QuantizeLinear" in last["reason"]
    assert any("/1/Conv" in w and "not fused" in w for w in result.warnings)
    assert result.report["runtime"]["fused"] == result.report["runtime"]["planned"] - 1
    onnx.checker.check_model(onnx.load(str(result.model_path)))
