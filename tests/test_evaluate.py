"""Tests for qtool.evaluate and qtool.ort_session on small ONNX models built with onnx.helper.

Expected values come from numpy re-implementations of the same models (Gemm, QDQ weight), never
from the code under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console

from qtool.errors import DataError, ModelError
from qtool.evaluate import EvalResult, ModelMetrics, evaluate_models, render_table
from qtool.ort_session import create_session

FEATURES, CLASSES = 16, 5
OPSET = 17
IR_VERSION = 8  # the IR version of opset 17; onnx 1.23 defaults to one newer than ORT reads


def _make_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )


def _gemm_model(
    weight: np.ndarray, bias: np.ndarray, *, qdq_scale: float | None = None, batch: str | int = "N"
) -> onnx.ModelProto:
    """y = x @ W.T + b; with qdq_scale, W goes through QuantizeLinear/DequantizeLinear (int8)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, weight.shape[1]])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, weight.shape[0]])
    inits = [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "b")]
    nodes = []
    weight_name = "W"
    if qdq_scale is not None:
        inits += [
            numpy_helper.from_array(np.array(qdq_scale, np.float32), "W_scale"),
            numpy_helper.from_array(np.array(0, np.int8), "W_zp"),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", ["W", "W_scale", "W_zp"], ["W_q"]),
            helper.make_node("DequantizeLinear", ["W_q", "W_scale", "W_zp"], ["W_dq"]),
        ]
        weight_name = "W_dq"
    nodes.append(helper.make_node("Gemm", ["x", weight_name, "b"], ["logits"], transB=1))
    graph = helper.make_graph(nodes, "gemm", [x], [y], inits)
    model = _make_model(graph)
    onnx.checker.check_model(model)
    return model


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _numpy_qdq(weight: np.ndarray, scale: float) -> np.ndarray:
    """ONNX QuantizeLinear (round half to even, saturate) then DequantizeLinear, in numpy."""
    q = np.clip(np.rint(weight / np.float32(scale)), -128, 127).astype(np.int8)
    return q.astype(np.float32) * np.float32(scale)


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
    quant = _save(_gemm_model(weight, bias, qdq_scale=scale), folder / "quant.onnx")
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
    return {
        "fp32": fp32,
        "fp32_copy": fp32_copy,
        "quant": quant,
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


def _expected_sqnr(ref: np.ndarray, q: np.ndarray) -> float:
    return 10 * math.log10(np.sum(ref**2) / np.sum((ref - q) ** 2))


def _expected_cosine(ref: np.ndarray, q: np.ndarray) -> float:
    return float(
        np.mean(np.sum(ref * q, axis=1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(q, axis=1)))
    )


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
    assert result.fp32.accuracy == pytest.approx(acc_ref)
    assert result.quant.accuracy == pytest.approx(acc_q)
    assert result.agreement == pytest.approx(agreement)
    assert result.sqnr_db == pytest.approx(_expected_sqnr(ref, q), abs=1e-3)
    assert result.cosine == pytest.approx(_expected_cosine(ref, q), abs=1e-6)
    assert result.accuracy_drop_points() == pytest.approx((acc_ref - acc_q) * 100)
    assert result.fp32.file_bytes == setup["fp32"].stat().st_size
    assert result.quant.file_bytes == setup["quant"].stat().st_size
    for m in (result.fp32, result.quant):
        assert 0 < m.latency_ms_median <= m.latency_ms_p90
    assert result.latency_batch == 1


def test_identical_models_agree_fully_with_infinite_sqnr(setup):
    # progress=True: the bar must not break runs without a terminal (pytest captures output).
    result = evaluate_models(setup["fp32"], setup["fp32_copy"], _batches(setup), latency_runs=2)
    assert result.agreement == 1.0
    assert math.isinf(result.sqnr_db) and result.sqnr_db > 0
    assert result.cosine == pytest.approx(1.0, abs=1e-12)
    assert result.fp32.accuracy == result.quant.accuracy
    assert result.accuracy_drop_points() == 0.0
    data = result.to_dict()
    assert data["sqnr_db"] == "inf"
    json.loads(json.dumps(data, allow_nan=False))  # strict JSON, no Infinity/NaN tokens


def test_without_labels_drop_is_disagreement(setup):
    batches = (b for b in _batches(setup, with_labels=False))  # a generator, length unknown
    result = evaluate_models(setup["fp32"], setup["quant"], batches, latency_runs=2, progress=False)
    ref, q = setup["ref"], setup["q"]
    agreement = np.mean(np.argmax(ref, 1) == np.argmax(q, 1))
    assert result.fp32.accuracy is None and result.quant.accuracy is None
    assert result.agreement == pytest.approx(agreement)
    assert result.accuracy_drop_points() == pytest.approx((1 - agreement) * 100)
    assert result.to_dict()["drop_metric"] == "top1_agreement"


def _table_text(result: EvalResult) -> str:
    console = Console(record=True, width=140, force_terminal=False)
    console.print(render_table(result))
    return console.export_text()


def test_render_table_rows_and_changes(setup):
    result = EvalResult(
        fp32=ModelMetrics(
            accuracy=0.95, latency_ms_median=2.0, latency_ms_p90=3.0, file_bytes=4_000_000
        ),
        quant=ModelMetrics(
            accuracy=0.93, latency_ms_median=1.0, latency_ms_p90=2.0, file_bytes=1_000_000
        ),
        samples=100,
        agreement=0.97,
        sqnr_db=31.5,
        cosine=0.9991,
    )
    text = _table_text(result)
    for row in (
        "accuracy",
        "top-1 agreement",
        "SQNR dB",
        "cosine",
        "latency median",
        "latency p90",
        "file size",
    ):
        assert row in text
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert "95.00%" in lines["accuracy"] and "93.00%" in lines["accuracy"]
    assert "-2.00 pts" in lines["accuracy"]
    assert "2.00x" in lines["latency median"]
    assert "1.50x" in lines["latency p90"]
    assert "4.00x" in lines["file size"] and "1.00 MB" in lines["file size"]
    assert "31.50" in lines["SQNR dB"]


def test_render_table_without_labels_says_na(setup):
    result = EvalResult(
        fp32=ModelMetrics(None, 1.0, 1.0, 10),
        quant=ModelMetrics(None, 1.0, 1.0, 10),
        samples=10,
        agreement=0.9,
        sqnr_db=math.inf,
        cosine=0.99,
    )
    text = _table_text(result)
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert "n/a" in lines["accuracy"] and "0.00%" not in lines["accuracy"]
    assert "90.00%" in lines["top-1 agreement"] and "-10.00 pts" in lines["top-1 agreement"]
    assert "inf" in lines["SQNR dB"]
    assert "0.99000" in lines["cosine"]


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
    with pytest.raises(DataError, match="labels"):
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
