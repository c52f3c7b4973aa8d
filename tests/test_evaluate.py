"""Tests for qtool.metrics.evaluate and qtool.ort.sessions on small ONNX models built with
onnx.helper.

Expected values come from numpy re-implementations of the same models (Gemm, QDQ weight) or from
ONNX Runtime sessions opened here directly, never from the code under test.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console

from qtool.config.recipe import load_recipe
from qtool.errors import DataError, ModelError, RecipeError
from qtool.metrics.evaluate import evaluate_models
from qtool.metrics.fusion_gap import fused_gap_warning
from qtool.metrics.gates import Gates, judge_gates
from qtool.metrics.junit import junit_xml
from qtool.metrics.kinds import KindEvidence
from qtool.metrics.results import (
    EvalResult,
    FusedVsUnfused,
    ModelMetrics,
    OutputResult,
    VariantMetrics,
)
from qtool.metrics.signal import format_db
from qtool.metrics.spec import gate_problem
from qtool.metrics.tables import fused_unfused_notes, render_table
from qtool.model import provenance
from qtool.ort.cpu import detect_cpu, resolve_cpu
from qtool.ort.sessions import create_session

FEATURES, CLASSES = 16, 5
OPSET = 17
IR_VERSION = 8  # the IR version of opset 17; onnx 1.23 defaults to one newer than ORT reads


def _make_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )


def _qdq_weight(name: str, weight: np.ndarray, scale: float | None, nodes: list, inits: list):
    """Add `weight` as an initializer; with a scale, route it through int8 QuantizeLinear and
    DequantizeLinear. Returns the name the consumer reads."""
    inits.append(numpy_helper.from_array(weight, name))
    if scale is None:
        return name
    inits += [
        numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale"),
        numpy_helper.from_array(np.array(0, np.int8), f"{name}_zp"),
    ]
    nodes += [
        helper.make_node("QuantizeLinear", [name, f"{name}_scale", f"{name}_zp"], [f"{name}_q"]),
        helper.make_node(
            "DequantizeLinear", [f"{name}_q", f"{name}_scale", f"{name}_zp"], [f"{name}_dq"]
        ),
    ]
    return f"{name}_dq"


def _gemm_model(
    weight: np.ndarray, bias: np.ndarray, *, qdq_scale: float | None = None, batch: str | int = "N"
) -> onnx.ModelProto:
    """y = x @ W.T + b; with qdq_scale, W goes through QuantizeLinear/DequantizeLinear (int8)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, weight.shape[1]])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, weight.shape[0]])
    nodes: list = []
    inits = [numpy_helper.from_array(bias, "b")]
    weight_name = _qdq_weight("W", weight, qdq_scale, nodes, inits)
    nodes.append(helper.make_node("Gemm", ["x", weight_name, "b"], ["logits"], transB=1))
    model = _make_model(helper.make_graph(nodes, "gemm", [x], [y], inits))
    onnx.checker.check_model(model)
    return model


def _two_output_model(
    weights: dict[str, np.ndarray], scales: dict[str, float] | None = None
) -> onnx.ModelProto:
    """One input x, one Gemm output per entry of `weights` (name -> W), W optionally QDQ'd."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])
    nodes: list = []
    inits: list = []
    outputs = []
    for name, weight in weights.items():
        scale = None if scales is None else scales[name]
        weight_name = _qdq_weight(f"W_{name}", weight, scale, nodes, inits)
        nodes.append(helper.make_node("Gemm", ["x", weight_name], [name], transB=1))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", len(weight)]))
    model = _make_model(helper.make_graph(nodes, "two", [x], outputs, inits))
    onnx.checker.check_model(model)
    return model


def _conv_model(weight: np.ndarray, qdq_scale: float | None = None) -> onnx.ModelProto:
    """x [N, 3, H, W] (symbolic batch and spatial dims) -> Conv -> GlobalAveragePool -> [N, C]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", len(weight)])
    nodes: list = []
    inits: list = []
    weight_name = _qdq_weight("Wc", weight, qdq_scale, nodes, inits)
    nodes += [
        helper.make_node("Conv", ["x", weight_name], ["feat"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["feat"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["logits"]),
    ]
    model = _make_model(helper.make_graph(nodes, "conv", [x], [y], inits))
    onnx.checker.check_model(model)
    return model


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _numpy_qdq(weight: np.ndarray, scale: float) -> np.ndarray:
    """ONNX QuantizeLinear (round half to even, saturate) then DequantizeLinear, in numpy."""
    q = np.clip(np.rint(weight / np.float32(scale)), -128, 127).astype(np.int8)
    return q.astype(np.float32) * np.float32(scale)


def _expected_sqnr(ref: np.ndarray, q: np.ndarray) -> float:
    return 10 * math.log10(np.sum(ref**2) / np.sum((ref - q) ** 2))


def _expected_cosine(ref: np.ndarray, q: np.ndarray) -> float:
    return float(
        np.mean(np.sum(ref * q, axis=1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(q, axis=1)))
    )


def _stamped(model: onnx.ModelProto, float_sha256: str) -> onnx.ModelProto:
    stamped = onnx.ModelProto()
    stamped.CopyFrom(model)
    provenance.stamp(
        stamped, {provenance.VERSION: "test", provenance.FLOAT_MODEL_SHA256: float_sha256}
    )
    return stamped


def _error_line(result) -> str:
    """The CLI's one-line error (exit 2), checked to be exactly one line."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(CLASSES, FEATURES)).astype(np.float32)
    bias = rng.normal(size=CLASSES).astype(np.float32)
    # A coarse scale (about 4-bit resolution) so the quantized model really disagrees sometimes.
    scale = float(np.abs(weight).max() / 7)
    folder = tmp_path_factory.mktemp("models")
    fp32 = _save(_gemm_model(weight, bias), folder / "fp32.onnx")
    fp32_copy = _save(_gemm_model(weight, bias), folder / "fp32_copy.onnx")
    quant_model = _gemm_model(weight, bias, qdq_scale=scale)
    quant = _save(quant_model, folder / "quant.onnx")
    # Three batches of different sizes, so streaming accumulation across batches is exercised.
    xs = [rng.normal(size=(n, FEATURES)).astype(np.float32) for n in (64, 64, 37)]
    x_all = np.concatenate(xs)
    ref = x_all.astype(np.float64) @ weight.T.astype(np.float64) + bias
    q = x_all.astype(np.float64) @ _numpy_qdq(weight, scale).T.astype(np.float64) + bias
    # Labels: the FP32 prediction with every 7th sample shifted, so FP32 accuracy is below 1.
    labels_all = np.argmax(ref, axis=1).astype(np.int64)
    labels_all[::7] = (labels_all[::7] + 1) % CLASSES
    splits = np.cumsum([len(x) for x in xs])[:-1]
    labels = np.split(labels_all, splits)
    np.savez(folder / "eval.npz", x=x_all, labels=labels_all)
    np.savez(folder / "eval_unlabelled.npz", x=x_all)
    return {
        "folder": folder,
        "fp32": fp32,
        "fp32_copy": fp32_copy,
        "quant": quant,
        "quant_model": quant_model,
        "npz": folder / "eval.npz",
        "npz_unlabelled": folder / "eval_unlabelled.npz",
        "xs": xs,
        "labels": labels,
        "ref": ref,
        "q": q,
        "labels_all": labels_all,
        "weight": weight,
        "bias": bias,
    }


def _batches(setup, with_labels=True):
    pairs = zip(setup["xs"], setup["labels"], strict=True)
    return [({"x": x}, y if with_labels else None) for x, y in pairs]


# ------------------------------------------------------------------------------ metrics


def test_quantized_vs_fp32_matches_numpy_reference(setup):
    result = evaluate_models(
        setup["fp32"], setup["quant"], _batches(setup), latency_runs=3, progress=False, threads=1
    )
    ref, q, labels = setup["ref"], setup["q"], setup["labels_all"]
    acc_ref = np.mean(np.argmax(ref, 1) == labels)
    acc_q = np.mean(np.argmax(q, 1) == labels)
    agreement = np.mean(np.argmax(ref, 1) == np.argmax(q, 1))
    # The fixture must make the comparison non-trivial, or the test could not fail.
    assert 0.5 < agreement < 1.0 and acc_ref < 1.0

    assert result.samples == len(labels)
    assert [o.name for o in result.outputs] == ["logits"] and result.output == "logits"
    (out,) = result.outputs
    assert out.fp32_accuracy == pytest.approx(acc_ref)
    # Only the weight is quantized, so fused and unfused both compute the numpy model.
    for variant in (out.fused, out.unfused):
        assert variant.accuracy == pytest.approx(acc_q)
        assert variant.agreement == pytest.approx(agreement)
        assert variant.sqnr_db == pytest.approx(_expected_sqnr(ref, q), abs=1e-3)
        assert variant.cosine == pytest.approx(_expected_cosine(ref, q), abs=1e-6)
    assert result.fp32.accuracy == pytest.approx(acc_ref)
    assert result.quant.accuracy == pytest.approx(acc_q)
    assert result.accuracy_drop_points() == pytest.approx((acc_ref - acc_q) * 100)
    assert result.fp32.file_bytes == setup["fp32"].stat().st_size
    assert result.quant.file_bytes == setup["quant"].stat().st_size
    for m in (result.fp32, result.quant):
        assert 0 < m.latency_ms_median <= m.latency_ms_p90
    assert result.latency_batch == 1 and result.latency_runs == 3
    assert result.cpu == detect_cpu()
    assert not [w for w in result.warnings if w.code == "fused_below_unfused"]


def test_identical_models_agree_fully_with_infinite_sqnr(setup):
    # progress=True: the bar must not break runs without a terminal (pytest captures output).
    result = evaluate_models(setup["fp32"], setup["fp32_copy"], _batches(setup), latency_runs=2)
    assert result.agreement == 1.0
    assert math.isinf(result.sqnr_db) and result.sqnr_db > 0
    assert result.cosine == pytest.approx(1.0, abs=1e-12)
    assert result.fp32.accuracy == result.quant.accuracy
    assert result.accuracy_drop_points() == 0.0
    data = result.to_dict()
    assert data["outputs"][0]["fused"]["sqnr_db"] == "inf"
    json.loads(json.dumps(data, allow_nan=False))  # strict JSON, no Infinity/NaN tokens


def test_without_labels_drop_is_disagreement(setup):
    batches = (b for b in _batches(setup, with_labels=False))  # a generator, length unknown
    result = evaluate_models(setup["fp32"], setup["quant"], batches, latency_runs=2, progress=False)
    ref, q = setup["ref"], setup["q"]
    agreement = np.mean(np.argmax(ref, 1) == np.argmax(q, 1))
    assert result.fp32.accuracy is None and result.quant.accuracy is None
    assert result.agreement == pytest.approx(agreement)
    assert result.default_metric() == "agreement"
    assert result.accuracy_drop_points() == pytest.approx((1 - agreement) * 100)
    assert result.to_dict()["labels"] is False


def test_every_output_is_compared_and_gates_judge_the_chosen_one(tmp_path):
    rng = np.random.default_rng(3)
    weights = {n: rng.normal(size=(CLASSES, FEATURES)).astype(np.float32) for n in ("a", "b")}
    # 'a' is quantized finely (int8), 'b' coarsely (about 2 bits): b's SQNR is far lower.
    scales = {"a": float(np.abs(weights["a"]).max() / 127), "b": float(np.abs(weights["b"]).max())}
    fp32 = _save(_two_output_model(weights), tmp_path / "fp32.onnx")
    quant = _save(_two_output_model(weights, scales), tmp_path / "quant.onnx")
    x = rng.normal(size=(80, FEATURES)).astype(np.float32)
    expected = {}
    for name, weight in weights.items():
        ref = x.astype(np.float64) @ weight.T.astype(np.float64)
        q = x.astype(np.float64) @ _numpy_qdq(weight, scales[name]).T.astype(np.float64)
        expected[name] = _expected_sqnr(ref, q)
    assert expected["a"] > expected["b"] + 10  # the fixture separates the two outputs
    floor = (expected["a"] + expected["b"]) / 2

    results = {}
    for output in ("a", "b"):
        results[output] = evaluate_models(
            fp32, quant, [({"x": x}, None)], output=output, latency_runs=1, progress=False
        )
    for result in results.values():
        assert [o.name for o in result.outputs] == ["a", "b"]
        for out in result.outputs:
            assert out.fused.sqnr_db == pytest.approx(expected[out.name], abs=1e-3)
            assert out.unfused.sqnr_db == pytest.approx(expected[out.name], abs=1e-3)
    gates = Gates(min_sqnr=floor)
    (on_a,) = judge_gates(results["a"], gates)
    (on_b,) = judge_gates(results["b"], gates)
    assert (on_a.output, on_a.passed) == ("a", True)
    assert (on_b.output, on_b.passed) == ("b", False)
    assert on_b.value == pytest.approx(expected["b"], abs=1e-3)

    text = _table_text(results["b"])
    rows = [line for line in text.splitlines() if "SQNR dB" in line]
    assert len(rows) == 2  # one per output
    assert rows[0].split("│")[1].strip() == "a" and rows[1].split("│")[1].strip() == "b *"


def test_unknown_output_lists_the_model_outputs(setup):
    with pytest.raises(ModelError) as info:
        evaluate_models(
            setup["fp32"],
            setup["quant"],
            _batches(setup),
            output="probs",
            output_where="--output",
            progress=False,
        )
    message = str(info.value)
    assert "--output 'probs'" in message and "outputs: logits" in message


def test_outputs_are_matched_by_name(tmp_path, setup):
    model = setup["quant_model"]
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    renamed.graph.node[-1].output[0] = "scores"
    renamed.graph.output[0].name = "scores"
    quant = _save(renamed, tmp_path / "renamed.onnx")
    with pytest.raises(ModelError) as info:
        evaluate_models(setup["fp32"], quant, _batches(setup), progress=False)
    message = str(info.value)
    assert "'logits'" in message and "renamed.onnx" in message and "\n" not in message


def test_output_shape_mismatch_names_the_output(tmp_path, setup):
    rng = np.random.default_rng(4)
    weights = {n: rng.normal(size=(CLASSES, FEATURES)).astype(np.float32) for n in ("a", "b")}
    fp32 = _save(_two_output_model(weights), tmp_path / "fp32.onnx")
    wider = dict(weights, b=rng.normal(size=(CLASSES + 2, FEATURES)).astype(np.float32))
    quant = _save(_two_output_model(wider, {"a": 0.05, "b": 0.05}), tmp_path / "quant.onnx")
    x = rng.normal(size=(8, FEATURES)).astype(np.float32)
    with pytest.raises(ModelError) as info:
        evaluate_models(fp32, quant, [({"x": x}, None)], progress=False)
    message = str(info.value)
    assert "output 'b'" in message and "(8, 7)" in message and "(8, 5)" in message
    assert "\n" not in message


def test_accuracy_metric_without_labels_is_an_error(setup):
    with pytest.raises(DataError, match=r"--metric accuracy needs labels"):
        evaluate_models(
            setup["fp32"],
            setup["quant"],
            _batches(setup, with_labels=False),
            labels_required_by="--metric accuracy",
            progress=False,
        )


def test_embedding_model_cosine_without_labels(tmp_path):
    """An embedding output: no labels, the cosine is checked against numpy."""
    rng = np.random.default_rng(1)
    proj = rng.normal(size=(FEATURES, 8)).astype(np.float32)
    noise = (rng.normal(size=proj.shape) * 0.05).astype(np.float32)

    def matmul_model(w: np.ndarray) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["N", FEATURES])
        y = helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["N", 8])
        node = helper.make_node("MatMul", ["tokens", "P"], ["emb"])
        graph = helper.make_graph([node], "emb", [x], [y], [numpy_helper.from_array(w, "P")])
        return _make_model(graph)

    a = _save(matmul_model(proj), tmp_path / "a.onnx")
    b = _save(matmul_model(proj + noise), tmp_path / "b.onnx")
    x = rng.normal(size=(50, FEATURES)).astype(np.float32)
    result = evaluate_models(a, b, [({"tokens": x}, None)], latency_runs=2, progress=False)
    ref = x.astype(np.float64) @ proj.astype(np.float64)
    q = x.astype(np.float64) @ (proj + noise).astype(np.float64)
    assert result.fp32.accuracy is None
    assert result.cosine == pytest.approx(_expected_cosine(ref, q), abs=1e-6)
    assert result.cosine < 1.0
    assert result.sqnr_db == pytest.approx(_expected_sqnr(ref, q), abs=1e-3)
    cosine = result.cosine
    (passed,) = judge_gates(result, Gates(min_cosine=cosine - 1e-4))
    (failed,) = judge_gates(result, Gates(min_cosine=min(cosine + 1e-4, 1.0)))
    assert passed.passed and not failed.passed and failed.metric == "cosine"


# ------------------------------------------------------------------------------ gates


def _result(fused: VariantMetrics, unfused: VariantMetrics, fp32_accuracy=None) -> EvalResult:
    """A hand-made result, for the pure functions that judge and print one."""
    out = OutputResult("logits", fused, unfused, fp32_accuracy)
    return EvalResult(
        fp32=ModelMetrics(fp32_accuracy, 2.0, 3.0, 4_000_000),
        quant=ModelMetrics(fused.accuracy, 1.0, 2.0, 1_000_000),
        samples=100,
        outputs=[out],
        output="logits",
        latency_runs=5,
        cpu=resolve_cpu("avx2"),
    )


def test_gates_are_judged_on_the_fused_model_each_on_its_own():
    # The unfused model would pass the drop gate; the fused one (what deploys) does not.
    result = _result(
        VariantMetrics(sqnr_db=20.0, cosine=0.99, agreement=0.95, accuracy=0.90),
        VariantMetrics(sqnr_db=40.0, cosine=0.999, agreement=0.99, accuracy=0.945),
        fp32_accuracy=0.95,
    )
    judged = judge_gates(result, Gates(max_drop=1.0, min_cosine=0.98, min_sqnr=30.0))
    by_gate = {g.gate: g for g in judged}
    assert list(by_gate) == ["max_drop", "min_cosine", "min_sqnr"]
    assert by_gate["max_drop"].metric == "accuracy"
    assert by_gate["max_drop"].value == pytest.approx(5.0)
    assert by_gate["max_drop"].unfused_value == pytest.approx(0.5)
    assert not by_gate["max_drop"].passed
    assert by_gate["min_cosine"].passed
    assert not by_gate["min_sqnr"].passed
    (agreement,) = judge_gates(result, Gates(metric="agreement", max_drop=6.0))
    assert agreement.metric == "agreement" and agreement.value == pytest.approx(5.0)
    assert agreement.passed
    assert judge_gates(result, Gates()) == []


@pytest.mark.parametrize(
    ("key", "value", "ok"),
    [
        ("max_drop", 0.0, True),
        ("max_drop", 2.5, True),
        ("max_drop", -1.0, False),
        ("max_drop", math.nan, False),
        ("max_drop", math.inf, False),
        ("min_cosine", 0.99, True),
        ("min_cosine", -1.0, True),
        ("min_cosine", 1.5, False),
        ("min_cosine", math.nan, False),
        ("min_sqnr", -5.0, True),
        ("min_sqnr", math.nan, False),
        ("min_sqnr", -math.inf, False),
    ],
)
def test_gate_values_must_be_finite_and_in_range(key, value, ok):
    assert (gate_problem(key, value) is None) == ok


# ------------------------------------------------------------------------------ fused vs unfused


def _gap_outputs(fused: float, unfused: float) -> list[OutputResult]:
    return [
        OutputResult("a", VariantMetrics(40.0, 0.999, 1.0), VariantMetrics(40.5, 0.999, 1.0)),
        OutputResult("b", VariantMetrics(fused, 0.9, 1.0), VariantMetrics(unfused, 0.99, 1.0)),
    ]


def test_fused_gap_warning_names_the_cause_for_the_cpu():
    saturating, vnni = resolve_cpu("avx2"), resolve_cpu("avx512-vnni")
    assert saturating.u8s8_saturates and not vnni.u8s8_saturates
    warning = fused_gap_warning(_gap_outputs(20.0, 35.0), saturating)
    assert warning is not None and warning.code == "fused_below_unfused"
    assert "'b'" in warning.message and "'a'" not in warning.message
    assert "no VNNI" in warning.message and "16-bit" in warning.message
    assert "quantization.cpu" in warning.message
    other = fused_gap_warning(_gap_outputs(20.0, 35.0), vnni)
    assert other is not None and "differ from the QDQ semantics" in other.message
    assert "VNNI" not in other.message.split("(")[0]
    # Within 3 dB, or fused better than unfused, or both exact: nothing to say.
    assert fused_gap_warning(_gap_outputs(32.1, 35.0), saturating) is None
    assert fused_gap_warning(_gap_outputs(50.0, 35.0), saturating) is None
    assert fused_gap_warning(_gap_outputs(math.inf, math.inf), saturating) is None
    assert fused_gap_warning(_gap_outputs(60.0, math.inf), saturating) is not None


def _saturating_models(folder: Path) -> tuple[Path, Path, np.ndarray]:
    """A MatMul whose QDQ model fuses into QLinearMatMul with full-range uint8 activations and
    int8 weights of one sign: on x86 without VNNI, each pair of products (up to 255 * 127 * 2)
    overflows the 16-bit sums of ORT's u8s8 kernel; with VNNI it does not."""
    k, m = 64, 8
    rng = np.random.default_rng(5)
    w_q = np.where(rng.random((k, m)) < 0.9, 127, -127).astype(np.int8)
    w_scale, x_scale, y_scale = np.float32(1 / 127), np.float32(1 / 255), np.float32(2 * k / 255)
    weight = w_q.astype(np.float32) * w_scale
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", m])
    fp32 = _make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "W"], ["y"])],
            "fp32",
            [x],
            [y],
            [numpy_helper.from_array(weight, "W")],
        )
    )
    inits = [
        numpy_helper.from_array(w_q, "Wq"),
        numpy_helper.from_array(w_scale, "sw"),
        numpy_helper.from_array(np.int8(0), "zw"),
        numpy_helper.from_array(x_scale, "sx"),
        numpy_helper.from_array(np.uint8(0), "zx"),
        numpy_helper.from_array(y_scale, "sy"),
        numpy_helper.from_array(np.uint8(128), "zy"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["Wq", "sw", "zw"], ["Wd"]),
        helper.make_node("MatMul", ["xd", "Wd"], ["m"]),
        helper.make_node("QuantizeLinear", ["m", "sy", "zy"], ["mq"]),
        helper.make_node("DequantizeLinear", ["mq", "sy", "zy"], ["y"]),
    ]
    quant = _make_model(helper.make_graph(nodes, "qdq", [x], [y], inits))
    data = rng.uniform(0.9, 1.0, size=(32, k)).astype(np.float32)
    return _save(fp32, folder / "fp32.onnx"), _save(quant, folder / "quant.onnx"), data


def _ort_sqnr(path: Path, x: np.ndarray, ref: np.ndarray, level) -> float:
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = level
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return _expected_sqnr(ref.astype(np.float64), session.run(None, {"x": x})[0])


def test_fused_below_unfused_warns_where_this_cpu_shows_the_gap(tmp_path):
    fp32, quant, x = _saturating_models(tmp_path)
    ref = onnxruntime.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    levels = onnxruntime.GraphOptimizationLevel
    fused = _ort_sqnr(quant, x, ref, levels.ORT_ENABLE_ALL)
    unfused = _ort_sqnr(quant, x, ref, levels.ORT_DISABLE_ALL)
    result = evaluate_models(fp32, quant, [({"x": x}, None)], latency_runs=1, progress=False)
    (out,) = result.outputs
    assert out.fused.sqnr_db == pytest.approx(fused, abs=1e-3)
    assert out.unfused.sqnr_db == pytest.approx(unfused, abs=1e-3)
    codes = [w.code for w in result.warnings]
    # Whether the gap exists depends on this machine's CPU (VNNI or not): assert what ORT did.
    if unfused - fused > 3.0:
        assert "fused_below_unfused" in codes
        (warning,) = [w for w in result.warnings if w.code == "fused_below_unfused"]
        assert ("no VNNI" in warning.message) == detect_cpu().u8s8_saturates
        report = result.to_dict()
        assert "fused_below_unfused" in [w["code"] for w in report["warnings"]]
    else:
        assert "fused_below_unfused" not in codes


# ------------------------------------------------------------------------------ provenance


def test_provenance_refuses_a_quantized_model_of_another_float_model(tmp_path, setup):
    other = provenance.sha256_bytes(b"some other float model")
    quant = _save(_stamped(setup["quant_model"], other), tmp_path / "foreign.onnx")
    with pytest.raises(ModelError) as info:
        evaluate_models(setup["fp32"], quant, _batches(setup), progress=False)
    message = str(info.value)
    assert "foreign.onnx" in message and str(setup["fp32"]) in message
    assert "not derived from" in message and "--allow-foreign-fp32" in message

    result = evaluate_models(
        setup["fp32"],
        quant,
        _batches(setup),
        allow_foreign_fp32=True,
        latency_runs=1,
        progress=False,
    )
    (warning,) = [w for w in result.warnings if w.code == "foreign_fp32"]
    assert "not derived from" in warning.message
    assert result.provenance["status"] == "mismatch"


def test_provenance_matching_and_missing(tmp_path, setup):
    own = provenance.sha256_file(setup["fp32"])
    stamped = _save(_stamped(setup["quant_model"], own), tmp_path / "own.onnx")
    result = evaluate_models(
        setup["fp32"], stamped, _batches(setup), latency_runs=1, progress=False
    )
    assert result.provenance["status"] == "match"
    assert not [w for w in result.warnings if w.code in ("foreign_fp32", "no_provenance")]

    plain = evaluate_models(
        setup["fp32"], setup["quant"], _batches(setup), latency_runs=1, progress=False
    )
    (warning,) = [w for w in plain.warnings if w.code == "no_provenance"]
    assert "cannot check" in warning.message and "quant.onnx" in warning.message
    assert plain.provenance["status"] == "unknown"


def test_cli_provenance_refuse_allow_missing(cli, tmp_path, setup):
    other = provenance.sha256_bytes(b"some other float model")
    foreign = _save(_stamped(setup["quant_model"], other), tmp_path / "foreign.onnx")
    base = ["evaluate", "--fp32", setup["fp32"], "--data", setup["npz"], "--latency-runs", "1"]
    line = _error_line(cli(*base, "--quant", foreign, "--no-progress"))
    assert "foreign.onnx" in line and "fp32.onnx" in line and "not derived from" in line

    report = tmp_path / "r.json"
    allowed = cli(*base, "--quant", foreign, "--allow-foreign-fp32", "--json", report)
    assert allowed.exit_code == 0, allowed.output
    assert "warning:" in allowed.stderr and "not derived from" in allowed.stderr
    assert "foreign_fp32" in [w["code"] for w in json.loads(report.read_text())["warnings"]]

    missing = cli(*base, "--quant", setup["quant"], "--no-progress")
    assert missing.exit_code == 0, missing.output
    assert "cannot check" in missing.stderr


# ------------------------------------------------------------------------------ CLI gates


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    """FP32 and QDQ files with outputs 'a' (fine) and 'b' (coarse), an .npz, numpy SQNRs."""
    folder = tmp_path_factory.mktemp("two")
    rng = np.random.default_rng(6)
    weights = {n: rng.normal(size=(CLASSES, FEATURES)).astype(np.float32) for n in ("a", "b")}
    scales = {"a": float(np.abs(weights["a"]).max() / 127), "b": float(np.abs(weights["b"]).max())}
    fp32 = _save(_two_output_model(weights), folder / "fp32.onnx")
    quant = _save(_two_output_model(weights, scales), folder / "quant.onnx")
    x = rng.normal(size=(100, FEATURES)).astype(np.float32)
    np.savez(folder / "x.npz", x=x)
    sqnr = {}
    for name, weight in weights.items():
        ref = x.astype(np.float64) @ weight.T.astype(np.float64)
        q = x.astype(np.float64) @ _numpy_qdq(weight, scales[name]).T.astype(np.float64)
        sqnr[name] = _expected_sqnr(ref, q)
    args = ["evaluate", "--fp32", fp32, "--quant", quant, "--data", folder / "x.npz"]
    return {"folder": folder, "args": [*args, "--latency-runs", "1"], "sqnr": sqnr}


def test_cli_gate_on_second_output_fails_while_first_passes(cli, two_outputs, tmp_path):
    floor = (two_outputs["sqnr"]["a"] + two_outputs["sqnr"]["b"]) / 2
    args = [*two_outputs["args"], "--min-sqnr", f"{floor:.3f}"]
    first = cli(*args, "--output", "a", "--json", tmp_path / "a.json")
    assert first.exit_code == 0, first.output
    assert "PASS: output 'a'" in first.stdout
    second = cli(
        *args, "--output", "b", "--json", tmp_path / "b.json", "--junit", tmp_path / "b.xml"
    )
    assert second.exit_code == 1, second.output
    assert "FAIL: output 'b'" in second.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    assert [o["name"] for o in report["outputs"]] == ["a", "b"]
    for out in report["outputs"]:
        for variant in ("fused", "unfused"):
            assert out[variant]["sqnr_db"] == pytest.approx(two_outputs["sqnr"][out["name"]], 1e-4)
    assert report["gated_output"] == "b" and report["passed"] is False
    (gate,) = report["gates"]
    assert (gate["gate"], gate["output"], gate["passed"], gate["model"]) == (
        "min_sqnr",
        "b",
        False,
        "fused",
    )
    assert report["cpu"] == detect_cpu().to_dict()
    assert report["latency"]["fp32_ms"]["median"] > 0 and report["size"]["ratio"] > 0
    # The table has rows for both outputs; the gated one is starred.
    assert "a " in second.stdout and "b *" in second.stdout


def test_cli_each_gate_passes_or_fails_separately(cli, two_outputs, tmp_path):
    junit = tmp_path / "gates.xml"
    floor = two_outputs["sqnr"]["a"] + 50  # unreachable
    args = [*two_outputs["args"], "--max-drop", "100", "--min-sqnr", f"{floor:.1f}"]
    # Random Gemm outputs are no class scores (metrics/kinds.py): agreement must be named to be
    # gated (without --metric the drop gate is refused, test_cli_agreement_gate_on_dense_output).
    args += ["--metric", "agreement"]
    result = cli(*args, "--min-cosine", "-1", "--junit", junit, "--no-progress")
    assert result.exit_code == 1, result.output
    assert result.stdout.count("PASS:") == 2 and result.stderr.count("FAIL:") == 1
    assert "agreement dropped" in result.stdout  # no labels: the drop counts agreement
    root = ET.fromstring(junit.read_bytes())
    suite = root.find("testsuite")
    assert suite.get("tests") == "3" and suite.get("failures") == "1"
    cases = suite.findall("testcase")
    assert [c.find("failure") is not None for c in cases] == [False, False, True]
    assert cases[0].get("name") == "a: agreement drop <= 100 points"
    assert cases[2].get("name") == f"a: SQNR >= {float(f'{floor:.1f}'):g} dB"
    assert "SQNR" in cases[2].find("failure").get("message")
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert {"a.fused.sqnr_db", "b.unfused.cosine", "cpu", "samples"} <= set(properties)
    assert properties["samples"] == "100"


def test_junit_is_byte_identical_for_the_same_result():
    result = _result(
        VariantMetrics(30.0, 0.99, 0.97, 0.93), VariantMetrics(31.0, 0.99, 0.97, 0.93), 0.95
    )
    gates = judge_gates(result, Gates(max_drop=1.0, min_sqnr=20.0))
    first, second = junit_xml(result, gates), junit_xml(result, gates)
    assert first == second
    root = ET.fromstring(first)
    assert root.get("tests") == "2" and root.get("failures") == "1"
    (failure,) = root.iter("failure")
    assert "accuracy dropped 2.00 points" in failure.get("message")


def test_cli_unknown_output_and_metric_without_labels(cli, two_outputs):
    line = _error_line(cli(*two_outputs["args"], "--output", "c", "--no-progress"))
    assert "--output 'c'" in line and "outputs: a, b" in line
    line = _error_line(cli(*two_outputs["args"], "--metric", "accuracy", "--max-drop", "1"))
    assert "--metric accuracy needs labels" in line
    line = _error_line(cli(*two_outputs["args"], "--metric", "top5"))
    assert "--metric" in line and "accuracy, agreement" in line


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--max-drop", "-1"),
        ("--max-drop", "nan"),
        ("--max-drop", "inf"),
        ("--min-cosine", "1.5"),
        ("--min-cosine", "nan"),
        ("--min-sqnr", "nan"),
    ],
)
def test_cli_gate_values_are_validated(cli, two_outputs, option, value):
    line = _error_line(cli(*two_outputs["args"], option, value, "--no-progress"))
    assert option in line


# ------------------------------------------------------------------------------ symbolic dims


@pytest.fixture(scope="module")
def conv_models(tmp_path_factory):
    """Float and QDQ conv models with inputs [N, 3, H, W] and a recipe on the float one."""
    folder = tmp_path_factory.mktemp("conv")
    rng = np.random.default_rng(7)
    weight = rng.normal(size=(4, 3, 3, 3)).astype(np.float32)
    fp32 = _save(_conv_model(weight), folder / "conv.onnx")
    quant = _save(_conv_model(weight, float(np.abs(weight).max() / 127)), folder / "conv_q.onnx")
    return {"folder": folder, "fp32": fp32, "quant": quant, "rng": rng}


def test_data_mode_accepts_any_size_along_symbolic_dims(cli, conv_models, tmp_path):
    rng = conv_models["rng"]
    npz = tmp_path / "x.npz"
    np.savez(npz, x=rng.normal(size=(12, 3, 24, 20)).astype(np.float32))
    args = ["evaluate", "--fp32", conv_models["fp32"], "--quant", conv_models["quant"]]
    report = tmp_path / "r.json"
    result = cli(*args, "--data", npz, "--json", report, "--latency-runs", "1", "--no-progress")
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["samples"] == 12

    bad = tmp_path / "bad.npz"
    np.savez(bad, x=rng.normal(size=(12, 4, 24, 20)).astype(np.float32))
    line = _error_line(cli(*args, "--data", bad, "--latency-runs", "1", "--no-progress"))
    assert "conv.onnx declares [N, 3, H, W]" in line and "[12, 4, 24, 20]" in line
    assert "recipe" not in line and "bad.npz" in line


def test_recipe_mode_with_symbolic_dims_and_gates_from_the_recipe(cli, conv_models, tmp_path):
    rng = conv_models["rng"]
    np.savez(tmp_path / "eval.npz", x=rng.normal(size=(10, 3, 16, 16)).astype(np.float32))
    recipe = {
        "model": {"onnx": str(conv_models["fp32"])},
        "inputs": {"x": [1, 3, 16, 16]},
        "calibration": {"data": {"synthetic": True, "samples": 16}, "method": "minmax"},
        "evaluation": {"data": {"npz": "eval.npz"}, "min_sqnr": 1000.0},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    quantized = cli("quantize", path, "-o", out, "--no-progress")
    assert quantized.exit_code == 0, quantized.output
    args = ["evaluate", path, "-o", out, "--latency-runs", "1", "--no-progress"]
    failed = cli(*args)  # the recipe's SQNR floor of 1000 dB cannot be met
    assert failed.exit_code == 1, failed.output
    assert "FAIL: output 'logits': SQNR" in failed.stderr
    overridden = cli(*args, "--min-sqnr", "-100")  # the option overrides the recipe
    assert overridden.exit_code == 0, overridden.output
    assert "PASS: output 'logits'" in overridden.stdout

    np.savez(tmp_path / "eval.npz", x=rng.normal(size=(10, 3, 12, 12)).astype(np.float32))
    line = _error_line(cli(*args))
    assert "inputs.x: [1, 3, 16, 16]" in line and "[3, 12, 12]" in line


@pytest.mark.parametrize(
    ("key", "value"), [("max_drop", ".nan"), ("max_drop", "-1"), ("min_cosine", "2")]
)
def test_recipe_gate_values_are_validated(cli, conv_models, tmp_path, key, value):
    text = yaml.safe_dump(
        {
            "model": {"onnx": str(conv_models["fp32"])},
            "inputs": {"x": [1, 3, 16, 16]},
            "calibration": {"data": {"synthetic": True}},
            "evaluation": {"data": {"synthetic": True}},
        },
        sort_keys=False,
    )
    path = tmp_path / "r.yaml"
    path.write_text(text + f"  {key}: {value}\n")  # evaluation: is the last mapping
    line = _error_line(cli("evaluate", path, "-o", tmp_path / "out", "--no-progress"))
    assert f"evaluation.{key}" in line and "r.yaml" in line


# ------------------------------------------------------------------------------ table


def _table_text(result: EvalResult) -> str:
    console = Console(record=True, width=160, force_terminal=False)
    console.print(render_table(result))
    return console.export_text()


def _rows(text: str) -> dict[str, str]:
    """Table lines keyed by their metric cell (the second column)."""
    return {line.split("│")[2].strip(): line for line in text.splitlines() if "│" in line}


def test_render_table_rows_and_changes():
    result = _result(
        VariantMetrics(sqnr_db=31.5, cosine=0.9991, agreement=0.97, accuracy=0.93),
        VariantMetrics(sqnr_db=35.25, cosine=0.9995, agreement=0.98, accuracy=0.94),
        fp32_accuracy=0.95,
    )
    text = _table_text(result)
    lines = _rows(text)
    for row in (
        "accuracy",
        "top-1 agreement",
        "SQNR dB",
        "cosine",
        "latency median",
        "latency p90",
        "file size",
    ):
        assert row in lines, row
    assert "95.00%" in lines["accuracy"] and "93.00%" in lines["accuracy"]
    assert "94.00%" in lines["accuracy"]  # unfused
    assert "-2.00 pts" in lines["accuracy"]
    assert "31.50" in lines["SQNR dB"] and "35.25" in lines["SQNR dB"]
    assert "2.00x" in lines["latency median"]
    assert "1.50x" in lines["latency p90"]
    assert "4.00x" in lines["file size"] and "1.00 MB" in lines["file size"]


def test_render_table_without_labels_says_na():
    result = _result(VariantMetrics(math.inf, 0.99, 0.9), VariantMetrics(40.0, 0.995, 0.95))
    lines = _rows(_table_text(result))
    assert "accuracy" not in lines
    assert "90.00%" in lines["top-1 agreement"] and "-10.00 pts" in lines["top-1 agreement"]
    assert "inf" in lines["SQNR dB"]
    assert "0.99000" in lines["cosine"]


# ------------------------------------------------------------------------------ output kinds


def _embedding_models(folder: Path) -> tuple[Path, Path, np.ndarray]:
    """A MiniLM-like output: x [N, 16] -> MatMul -> L2 normalisation -> [N, 24], unit rows; the
    quantized model takes the weight through int8 QDQ. Agreement over such an output flips on
    near-equal values although the embedding barely moves."""
    rng = np.random.default_rng(11)
    proj = rng.normal(size=(FEATURES, 24)).astype(np.float32)

    def model(scale: float | None) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["N", FEATURES])
        y = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", 24])
        nodes: list = []
        inits: list = []
        weight = _qdq_weight("P", proj, scale, nodes, inits)
        nodes += [
            helper.make_node("MatMul", ["tokens", weight], ["pooled"]),
            helper.make_node("LpNormalization", ["pooled"], ["embedding"], axis=-1, p=2),
        ]
        return _make_model(helper.make_graph(nodes, "emb", [x], [y], inits))

    fp32 = _save(model(None), folder / "emb.onnx")
    quant = _save(model(float(np.abs(proj).max() / 15)), folder / "emb_q.onnx")
    return fp32, quant, rng.normal(size=(60, FEATURES)).astype(np.float32)


def _softmax_models(folder: Path, setup) -> tuple[Path, Path]:
    """The fixture's Gemm classifier with a Softmax: rows of probabilities, no labels needed."""
    paths = []
    for name, scale in (("cls", None), ("cls_q", float(np.abs(setup["weight"]).max() / 7))):
        model = _gemm_model(setup["weight"], setup["bias"], qdq_scale=scale)
        model.graph.node[-1].output[0] = "z"
        model.graph.node.append(helper.make_node("Softmax", ["z"], ["logits"], axis=-1))
        paths.append(_save(model, folder / f"{name}.onnx"))
    return paths[0], paths[1]


def test_embedding_output_gets_no_top1_row_by_default(tmp_path):
    fp32, quant, x = _embedding_models(tmp_path)
    result = evaluate_models(fp32, quant, [({"tokens": x}, None)], latency_runs=1, progress=False)
    (out,) = result.outputs
    assert out.kind == "dense" and "unit L2 norm" in out.kind_evidence
    assert out.rows == ("sqnr", "cosine")
    assert out.fused.agreement is not None  # still measured (and in the JSON) ...
    lines = _rows(_table_text(result))
    assert (
        "top-1 agreement" not in lines and "SQNR dB" in lines and "cosine" in lines
    )  # ... not shown
    assert result.to_dict()["outputs"][0]["kind"] == "dense"

    asked = evaluate_models(
        fp32, quant, [({"tokens": x}, None)], latency_runs=1, progress=False, rows=("top1",)
    )
    assert asked.outputs[0].rows == ("top1",)
    assert list(_rows(_table_text(asked))) == [
        "top-1 agreement",
        "latency median",
        "latency p90",
        "file size",
    ]


def test_classifier_outputs_get_top1_rows(setup, tmp_path):
    labelled = evaluate_models(
        setup["fp32"], setup["quant"], _batches(setup), latency_runs=1, progress=False
    )
    (out,) = labelled.outputs
    assert (out.kind, out.kind_evidence) == ("class_scores", "labels are given for it")
    assert out.rows == ("accuracy", "top1", "sqnr", "cosine")
    assert {"accuracy", "top-1 agreement"} <= set(_rows(_table_text(labelled)))

    fp32, quant = _softmax_models(tmp_path, setup)
    unlabelled = evaluate_models(
        fp32, quant, _batches(setup, with_labels=False), latency_runs=1, progress=False
    )
    (out,) = unlabelled.outputs
    assert out.kind == "class_scores" and "probabilities" in out.kind_evidence
    assert out.rows == ("top1", "sqnr", "cosine")
    assert "top-1 agreement" in _rows(_table_text(unlabelled))


@pytest.mark.parametrize(
    ("values", "kind", "evidence"),
    [
        # a confident classifier's logits: one value far above the rest of its row
        (
            np.eye(6)[np.arange(40) % 6] * 12 + np.random.default_rng(0).normal(size=(40, 6)),
            "class_scores",
            "stands out",
        ),
        (np.random.default_rng(1).normal(size=(40, 300)), "dense", "no value stands out"),
        (np.random.default_rng(2).normal(size=(4, 30, 6)), "dense", "[N, 30, 6]"),
        (np.random.default_rng(3).normal(size=(40, 2)), "dense", "two raw columns"),
        (np.random.default_rng(4).normal(size=(40, 1)), "dense", "one column"),
    ],
)
def test_output_kind_rule(values, kind, evidence):
    gathered = KindEvidence()
    for part in np.array_split(values.astype(np.float32), 3):
        gathered.update(part)
    decided = gathered.decide(labelled=False)
    assert decided.kind == kind and evidence in decided.evidence, decided


def test_cli_agreement_gate_on_dense_output_is_refused_unless_named(cli, tmp_path):
    fp32, quant, x = _embedding_models(tmp_path)
    np.savez(tmp_path / "x.npz", tokens=x)
    args = ["evaluate", "--fp32", fp32, "--quant", quant, "--data", tmp_path / "x.npz"]
    args += ["--latency-runs", "1", "--no-progress"]
    refused = cli(*args, "--max-drop", "1")
    assert refused.exit_code == 2, refused.output
    message = refused.stderr
    assert "--max-drop: output 'embedding' is not class scores" in message
    assert "--min-cosine" in message and "--metric agreement" in message
    named = cli(*args, "--max-drop", "100", "--metric", "agreement")
    assert named.exit_code == 0, named.output
    assert "PASS: output 'embedding': agreement dropped" in named.stdout
    floor = cli(*args, "--min-cosine", "0.5", "--rows", "top1,cosine")
    assert floor.exit_code == 0, floor.output
    assert "top-1 agreement" in floor.stdout and "SQNR dB" not in floor.stdout
    line = _error_line(cli(*args, "--rows", "top1,top5"))
    assert "--rows" in line and "'top5'" in line
    line = _error_line(cli(*args, "--rows", "accuracy"))
    assert "--rows accuracy needs labels" in line


def test_recipe_rows_are_read_and_validated(tmp_path):
    recipe = {
        "model": {"onnx": "m.onnx"},
        "inputs": {"x": [1, FEATURES]},
        "calibration": {"data": {"synthetic": True}},
        "evaluation": {"data": {"synthetic": True}, "rows": ["cosine", "top1"]},
    }
    _save(
        _gemm_model(np.ones((CLASSES, FEATURES), np.float32), np.zeros(CLASSES, np.float32)),
        tmp_path / "m.onnx",
    )
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert load_recipe(path).evaluation.rows == ("cosine", "top1")
    recipe["evaluation"]["rows"] = ["agreement"]
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match=r"evaluation\.rows: must be among .*'agreement'"):
        load_recipe(path)


# ------------------------------------------------------------------------------ speed


def test_a_slowdown_prints_as_slower():
    result = _result(VariantMetrics(30.0, 0.99, 0.97), VariantMetrics(31.0, 0.99, 0.97))
    result.fp32.latency_ms_median, result.quant.latency_ms_median = 1.0, 2.44
    lines = _rows(_table_text(result))
    assert "2.44x slower" in lines["latency median"] and "speed-up" not in lines["latency median"]
    assert "1.50x faster" in lines["latency p90"]  # 3.0 ms FP32, 2.0 ms quantized
    latency = result.to_dict()["latency"]
    assert latency["fp32_over_quant_median"] == pytest.approx(1.0 / 2.44)
    assert latency["quant_is"] == "slower" and "speedup" not in latency


# ------------------------------------------------------------------------------ fused vs unfused


def _integer_to_float_model(folder: Path) -> tuple[Path, Path, np.ndarray]:
    """x -> QDQ (uint8) -> MatMul with an int8 QDQ weight -> float y [N, 10]: ORT fuses it into
    MatMulIntegerToFloat (int32 products, one float scale), which rounds differently from the
    float MatMul of the unfused graph on every CPU, so fused and unfused really differ."""
    k, m = 64, 10
    rng = np.random.default_rng(8)
    w_q = rng.integers(-127, 128, size=(k, m)).astype(np.int8)
    w_scale, x_scale = np.float32(0.0123), np.float32(1 / 255)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", m])
    weight = w_q.astype(np.float32) * w_scale
    fp32 = _make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "W"], ["y"])],
            "fp32",
            [x],
            [y],
            [numpy_helper.from_array(weight, "W")],
        )
    )
    inits = [
        numpy_helper.from_array(w_q, "Wq"),
        numpy_helper.from_array(w_scale, "sw"),
        numpy_helper.from_array(np.int8(0), "zw"),
        numpy_helper.from_array(x_scale, "sx"),
        numpy_helper.from_array(np.uint8(0), "zx"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["Wq", "sw", "zw"], ["Wd"]),
        helper.make_node("MatMul", ["xd", "Wd"], ["y"]),
    ]
    quant = _make_model(helper.make_graph(nodes, "qdq", [x], [y], inits))
    data = rng.uniform(0, 1, size=(40, k)).astype(np.float32)
    return _save(fp32, folder / "fp32.onnx"), _save(quant, folder / "quant.onnx"), data


def test_fused_vs_unfused_is_computed_from_the_two_variants(cli, tmp_path):
    fp32, quant, x = _integer_to_float_model(tmp_path)
    levels = onnxruntime.GraphOptimizationLevel
    runs = {}
    for name, level in (("fused", levels.ORT_ENABLE_ALL), ("unfused", levels.ORT_DISABLE_ALL)):
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = level
        session = onnxruntime.InferenceSession(
            str(quant), options, providers=["CPUExecutionProvider"]
        )
        runs[name] = session.run(None, {"x": x})[0].astype(np.float64)
    fused, unfused = runs["fused"], runs["unfused"]
    noise = np.sum((unfused - fused) ** 2)
    expected = math.inf if noise == 0 else 10 * math.log10(np.sum(unfused**2) / noise)
    changed = int(np.sum(np.argmax(fused, 1) != np.argmax(unfused, 1)))

    result = evaluate_models(fp32, quant, [({"x": x}, None)], latency_runs=1, progress=False)
    gap = result.outputs[0].fused_vs_unfused
    assert gap is not None and gap.predictions == len(x)
    assert gap.sqnr_db == pytest.approx(expected, abs=1e-9) and gap.top1_changed == changed
    assert result.to_dict()["outputs"][0]["fused_vs_unfused"]["top1_changed"] == changed

    np.savez(tmp_path / "x.npz", x=x)
    args = ["evaluate", "--fp32", fp32, "--quant", quant, "--data", tmp_path / "x.npz"]
    printed = cli(*args, "--latency-runs", "1", "--no-progress", "--rows", "top1,sqnr")
    assert printed.exit_code == 0, printed.output
    text = " ".join(printed.stdout.split())
    assert f"fused vs unfused, output 'y': SQNR {format_db(expected)} dB" in text
    assert f"top-1 changed on {changed} of {len(x)}" in text


def test_fused_vs_unfused_note_says_what_it_means_and_what_to_try():
    quantization = VariantMetrics(20.0, 0.99, 1.0)
    for gap_db, matters in ((45.0, False), (24.0, True)):
        out = OutputResult(
            "y", quantization, quantization, fused_vs_unfused=FusedVsUnfused(gap_db, 0, 10)
        )
        result = _result(quantization, quantization)
        result.outputs = [out]
        result.output = "y"
        notes = fused_unfused_notes(result)
        assert notes[0].startswith(f"fused vs unfused, output 'y': SQNR {gap_db:.2f} dB")
        assert ("negligible" in notes[0]) != matters
        if matters:  # the avx2 CPU of _result: the saturation advice
            assert "no VNNI" in notes[1] and "quantization.cpu" in notes[1]
        else:
            assert len(notes) == 1
    vnni = _result(quantization, quantization)
    vnni.cpu = resolve_cpu("avx512-vnni")
    vnni.outputs = [
        OutputResult("y", quantization, quantization, fused_vs_unfused=FusedVsUnfused(24.0, 0, 10))
    ]
    vnni.output = "y"
    advice = fused_unfused_notes(vnni)[1]
    assert "round" in advice and "quantization.cpu" in advice and "fused model" in advice


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"image": np.zeros((4, FEATURES), np.float32)}, "'image'"),
        (
            {"x": np.zeros((4, FEATURES + 1), np.float32)},
            "has shape (4, 17) but the model expects [N, 16]",
        ),
        ({"x": np.zeros((4, 2, FEATURES), np.float32)}, "has shape (4, 2, 16)"),
        ({"x": np.zeros((4, FEATURES), np.float64)}, "dtype float64"),
        ({"x": np.full((4, FEATURES), np.nan, np.float32)}, "NaN"),
    ],
)
def test_bad_inputs_raise_data_error_naming_input(setup, inputs, message):
    with pytest.raises(DataError) as info:
        evaluate_models(
            setup["fp32"], setup["quant"], [(inputs, None)], latency_runs=1, progress=False
        )
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_input_raises_data_error(setup):
    with pytest.raises(DataError, match="missing input 'x'"):
        evaluate_models(setup["fp32"], setup["quant"], [({}, None)], progress=False)


def test_mixed_labels_raise_data_error(setup):
    batches = _batches(setup)
    batches[1] = (batches[1][0], None)
    with pytest.raises(DataError, match="batch 2"):
        evaluate_models(setup["fp32"], setup["quant"], batches, latency_runs=1, progress=False)
    batches = _batches(setup, with_labels=False)
    batches[2] = (batches[2][0], setup["labels"][2])
    with pytest.raises(DataError, match="batch 3"):
        evaluate_models(setup["fp32"], setup["quant"], batches, latency_runs=1, progress=False)


def test_label_shape_mismatch_raises_data_error(setup):
    x = setup["xs"][0]
    with pytest.raises(DataError, match="labels.*'logits'"):
        evaluate_models(
            setup["fp32"],
            setup["quant"],
            [({"x": x}, np.zeros(len(x) + 1, np.int64))],
            latency_runs=1,
            progress=False,
        )


def test_empty_data_raises_data_error(setup):
    with pytest.raises(DataError, match="no batches"):
        evaluate_models(setup["fp32"], setup["quant"], [], progress=False)


def test_fixed_batch_model_times_its_batch(tmp_path, setup):
    model = _gemm_model(setup["weight"], setup["bias"], batch=8)
    a = _save(model, tmp_path / "a.onnx")
    b = _save(model, tmp_path / "b.onnx")
    x = setup["xs"][0][:8]
    result = evaluate_models(a, b, [({"x": x}, None)], latency_runs=1, progress=False)
    assert result.latency_batch == 8
    assert "batch 8" in _table_text(result)


def test_create_session_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.onnx"
    with pytest.raises(ModelError, match="missing.onnx"):
        create_session(missing)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ModelError, match="garbage.onnx"):
        create_session(garbage)
    with pytest.raises(ModelError, match="NoSuchExecutionProvider"):
        create_session(garbage, providers=["NoSuchExecutionProvider"])


def test_create_session_defaults_to_cpu_and_accepts_bytes(setup):
    data = setup["fp32"].read_bytes()
    session = create_session(data, threads=1, optimize=False)
    assert session.get_providers() == ["CPUExecutionProvider"]
    x = setup["xs"][0]
    out = session.run(None, {"x": x})[0]
    expected = x @ setup["weight"].T + setup["bias"]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_create_session_invalid_graph_message_is_one_clean_line(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"])], "g", [x], [y])
    path = _save(_make_model(graph), tmp_path / "unknown_op.onnx")
    with pytest.raises(ModelError) as info:
        create_session(path)
    message = str(info.value)
    assert "unknown_op.onnx" in message and "NoSuchOp" in message
    assert "\n" not in message and "[ONNXRuntimeError]" not in message
