"""TensorRT truth, honestly (issue 20, item 4).

The placement check is built from TensorRT's documented rules; a model that follows them passes,
and a model built to break each rule is caught by that rule. The engine path (build with
TensorRT, read each layer's precision with the engine inspector) runs only where the `tensorrt`
package and a GPU are present, and is skipped with its reason elsewhere. A quantize run for
target tensorrt never words ORT's CPU fusion as TensorRT's.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.runtime.tensorrt_engine import engine_block, inspect_engine, unavailable
from qtool.runtime.tensorrt_rules import BASIS, TRT_RULES, check_placement

RNG = np.random.default_rng(0)


def _conv_model(
    *,
    act_type=np.int8,
    weight_type=np.int8,
    zero=0,
    act_scale=0.02,
    weight_axis=0,
    act_scales=1,
    int32_bias=False,
    weight_only=False,
    float_type=TensorProto.FLOAT,
    stray_fp32=False,
    stray_cast=False,
) -> onnx.ModelProto:
    """x -> [Q/DQ] -> Conv(DQ weight[, DQ bias]) -> Relu -> y; each keyword breaks one rule."""
    npf = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}[float_type]
    weight = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    channel_scale = (np.abs(weight).reshape(4, -1).max(1) / 127).astype(npf)
    if weight_axis != 0:
        channel_scale = np.full(3, 0.01, npf)
    stored = np.clip(np.round(weight / 0.01), -127, 127).astype(weight_type)
    weight_zero = np.zeros(channel_scale.shape, weight_type)
    act_zero = np.array(zero, act_type) if act_scales == 1 else np.full(act_scales, zero, act_type)
    act_scale_values = np.full(act_scales, act_scale, npf) if act_scales > 1 else None
    inits = [
        numpy_helper.from_array(stored, "w_q"),
        numpy_helper.from_array(channel_scale, "w_scale"),
        numpy_helper.from_array(weight_zero, "w_zero"),
        numpy_helper.from_array(
            act_scale_values if act_scale_values is not None else np.array(act_scale, npf),
            "x_scale",
        ),
        numpy_helper.from_array(act_zero, "x_zero"),
    ]
    nodes = []
    x = "x"
    if float_type != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", ["x"], ["x16"], name="in_cast", to=float_type))
        x = "x16"
    q_axis = {"axis": 1} if act_scales > 1 else {}
    if not weight_only:
        nodes += [
            helper.make_node(
                "QuantizeLinear", [x, "x_scale", "x_zero"], ["xq"], name="q", **q_axis
            ),
            helper.make_node(
                "DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"], name="dq", **q_axis
            ),
        ]
        x = "xd"
    nodes.append(
        helper.make_node(
            "DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], name="w_dq", axis=weight_axis
        )
    )
    conv_inputs = [x, "w"]
    if int32_bias:
        inits += [
            numpy_helper.from_array(np.zeros(4, np.int32), "b_q"),
            numpy_helper.from_array(np.full(4, 1e-4, npf), "b_scale"),
        ]
        nodes.append(
            helper.make_node("DequantizeLinear", ["b_q", "b_scale"], ["b"], name="b_dq", axis=0)
        )
        conv_inputs.append("b")
    nodes.append(helper.make_node("Conv", conv_inputs, ["c"], name="conv", pads=[1, 1, 1, 1]))
    out = "c"
    if stray_fp32:  # a Relu in FP32 inside an FP16 model, with no reason given
        nodes += [
            helper.make_node("Cast", ["c"], ["c32"], name="to32", to=TensorProto.FLOAT),
            helper.make_node("Relu", ["c32"], ["r32"], name="relu32"),
            helper.make_node("Cast", ["r32"], ["r"], name="back16", to=float_type),
        ]
        out = "r"
    else:
        nodes.append(helper.make_node("Relu", ["c"], ["r"], name="relu"))
        out = "r"
    if stray_cast:  # a Cast to FP32 and back between two FP16 ops
        nodes += [
            helper.make_node("Cast", ["r"], ["r32b"], name="mid32", to=TensorProto.FLOAT),
            helper.make_node("Cast", ["r32b"], ["rb"], name="mid16", to=float_type),
            helper.make_node("Relu", ["rb"], ["r2"], name="relu2"),
        ]
        out = "r2"
    if float_type != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", [out], ["y"], name="out_cast", to=TensorProto.FLOAT))
    else:
        nodes.append(helper.make_node("Identity", [out], ["y"], name="out"))
    graph = helper.make_graph(
        nodes,
        "trt",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _violations(model: onnx.ModelProto, float_type: str = "fp32") -> dict[str, list[str]]:
    block = check_placement(model, {}, float_type)
    found: dict[str, list[str]] = {}
    for violation in block["violations"]:
        found.setdefault(violation["rule"], []).append(violation["node"])
    return found


def test_a_model_that_follows_the_rules_passes() -> None:
    block = check_placement(_conv_model(), {}, "fp32")
    assert block["passed"] and block["basis"] == BASIS
    assert {r["rule"] for r in block["rules"]} == {rule.name for rule in TRT_RULES}
    assert all(r["checked"] for r in block["rules"] if r["rule"] != "strong-typing")
    fp16 = check_placement(_conv_model(float_type=TensorProto.FLOAT16), {}, "fp16")
    assert fp16["passed"], fp16["violations"]


def test_fp8_pairs_pass() -> None:
    model = _conv_model(act_type=ml_dtypes.float8_e4m3fn, weight_type=ml_dtypes.float8_e4m3fn)
    assert _violations(model) == {}


@pytest.mark.parametrize(
    ("broken", "rule", "nodes"),
    [
        ({"act_type": np.uint8, "zero": 128}, "qdq-types", ["q", "dq"]),
        ({"int32_bias": True}, "qdq-types", ["b_dq"]),
        ({"zero": 3}, "zero-point", ["q", "dq"]),
        ({"act_scale": -0.02}, "positive-scale", ["q", "dq"]),
        ({"weight_axis": 1}, "weight-axis", ["w_dq"]),
        ({"act_scales": 3}, "activation-per-tensor", ["dq"]),
        ({"weight_only": True}, "weight-only-int4", ["conv"]),
        ({"act_type": ml_dtypes.float8_e4m3fn}, "matching-types", ["conv"]),
    ],
)
def test_each_rule_catches_the_model_built_to_break_it(broken, rule, nodes) -> None:
    found = _violations(_conv_model(**broken))
    assert found.get(rule) == nodes, found


def test_strong_typing_catches_an_unexplained_fp32_op_and_a_stray_cast() -> None:
    stray = _conv_model(float_type=TensorProto.FLOAT16, stray_fp32=True)
    found = _violations(stray, "fp16")
    assert "relu32" in found["strong-typing"] and "to32" in found["strong-typing"]
    # the same FP32 Relu with a reason in report.json is a boundary the recipe allows
    explained = check_placement(stray, {"relu32": "kept FP32 (overflow)"}, "fp16")
    assert explained["passed"], explained["violations"]
    cast = _violations(_conv_model(float_type=TensorProto.FLOAT16, stray_cast=True), "fp16")
    assert set(cast["strong-typing"]) == {"mid32", "mid16"}


def test_the_engine_path_runs_where_tensorrt_and_a_gpu_are(tmp_path) -> None:
    why = unavailable()
    if why is not None:
        assert engine_block(b"", {}) == {"built": False, "why": why}
        pytest.skip(f"TensorRT engine not built here: {why}")
    model = _conv_model(float_type=TensorProto.FLOAT16)
    engine = inspect_engine(model.SerializeToString(), {"x": (1, 3, 8, 8)})
    assert engine["built"] and engine["layers"]
    types = {t for layer in engine["layers"] for t in layer["outputs"]}
    assert types & {"int8", "fp16"}, engine["layers"]


def test_quantize_for_tensorrt_never_words_ort_fusion_as_tensorrts(digits_dir, cli) -> None:
    out = digits_dir / "out-trt-words"
    result = cli("quantize", digits_dir / "recipe-int8-fp16.yaml", "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "TensorRT placement, checked against TensorRT's documented rules, not built by" in text
    assert "ONNX Runtime CPU check (qtool's verifier, not tensorrt)" in text
    assert "ONNX Runtime (CPU provider) fuses" not in text
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert all("ONNX Runtime CPU check (not the target)" in w for w in warnings), warnings
    report = json.loads((out / "report.json").read_text())
    assert "not TensorRT" in report["runtime"]["runs_on"]
    assert report["tensorrt"]["placement"]["basis"] == BASIS
    assert report["tensorrt"]["engine"]["built"] is (unavailable() is None)
    ort_words = json.dumps(report["tensorrt"])
    assert "QLinearConv" not in ort_words and "fused" not in ort_words
