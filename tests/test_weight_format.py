"""Weight formats for the deployment CPU: the 16-bit pair-sum model checked against ORT itself.

The pair model (which products share a saturating 16-bit sum on x86 without VNNI) is asserted in
the direction that holds on every CPU: whatever qtool calls safe runs fused exactly as unfused.
The other direction (what qtool calls unsafe really saturates) is asserted only where this CPU
saturates, since CI machines differ (VNNI machines never do).
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.app.quantize import quantize
from qtool.config.recipe import load_recipe
from qtool.ort.cpu import detect_cpu, resolve_cpu
from qtool.plan.layout import WeightSlot
from qtool.plan.plan import WeightPlan
from qtool.write import weight_format
from qtool.write.params import quantize_weight
from qtool.write.sum_rounding import keep_channel_sums
from qtool.write.weight_format import (
    PAIR_LIMIT,
    can_saturate,
    choose_weight,
    pair_extremes,
    reduction_matrix,
)

SATURATING_HERE = detect_cpu().u8s8_saturates
AVX2 = resolve_cpu("avx2")


def _session(model: onnx.ModelProto, fused: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if fused
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    return ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])


def _qdq_model(op: str, weight_q: np.ndarray, x_shape: list[int], **attrs) -> onnx.ModelProto:
    """x (uint8, scale 1/255) -> op with the given int8 weight (scale 1/255) -> y (uint8)."""
    inits = [
        numpy_helper.from_array(np.array(1 / 255, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(0, np.uint8), "x_zero"),
        numpy_helper.from_array(weight_q.astype(np.int8), "w_q"),
        numpy_helper.from_array(np.array(1 / 255, np.float32), "w_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "w_zero"),
        numpy_helper.from_array(np.array(1 / 255, np.float32), "y_scale"),
        numpy_helper.from_array(np.array(0, np.uint8), "y_zero"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"]),
        helper.make_node(op, ["x_dq", "w_dq"], ["y_float"], **attrs),
        helper.make_node("QuantizeLinear", ["y_float", "y_scale", "y_zero"], ["y_q"]),
        helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zero"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "pair",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


# Weight patterns with two 127s and the slot qtool assigns: (label, op, weight, x shape, slot).
def _patterns() -> list[tuple[str, str, np.ndarray, list[int], WeightSlot, dict]]:
    cases = []
    for pair in ((0, 1), (1, 2), (2, 3), (3, 4)):
        w = np.zeros((8, 2))
        w[list(pair), :] = 127  # y = x @ w, x all ones: every product is 255 * 127
        cases.append((f"matmul k{pair}", "MatMul", w, [1, 8], WeightSlot("w", 1, "k-rows"), {}))
        wt = np.zeros((2, 8))
        wt[:, list(pair)] = 127
        slot = WeightSlot("w", 0, "k-cols")
        cases.append((f"gemm-transB k{pair}", "Gemm", wt, [1, 8], slot, {"transB": 1}))
    # Conv [M, C, 3, 3]: kernel positions outer, channels inner in ORT's im2col order.
    for channels, a, b in (
        (3, (1, 0, 0), (2, 0, 0)),
        (3, (2, 0, 0), (0, 0, 1)),
        (1, (0, 0, 0), (0, 0, 1)),
    ):
        w = np.zeros((2, channels, 3, 3))
        w[:, a[0], a[1], a[2]] = 127
        w[:, b[0], b[1], b[2]] = 127
        slot = WeightSlot("w", 0, "conv")
        cases.append((f"conv C={channels} {a}+{b}", "Conv", w, [1, channels, 5, 5], slot, {}))
    return cases


@pytest.mark.parametrize("case", _patterns(), ids=lambda c: c[0])
def test_pair_model_matches_what_ort_runs(case) -> None:
    _, op, weight, x_shape, slot, attrs = case
    from qtool.write.params import WeightParams

    params = WeightParams(weight.astype(np.int8), np.ones(weight.shape[slot.axis], np.float32), 0)
    unsafe = bool(can_saturate(params, slot).any())
    model = _qdq_model(op, weight, x_shape, **attrs)
    x = np.ones(x_shape, np.float32)  # every activation byte is 255
    fused = _session(model, True).run(None, {"x": x})[0]
    unfused = _session(model, False).run(None, {"x": x})[0]
    if not unsafe:
        np.testing.assert_array_equal(fused, unfused)  # holds on every CPU
    elif SATURATING_HERE:
        assert not np.array_equal(fused, unfused), "qtool predicted a saturation ORT did not show"


def test_pair_extremes_follow_aligned_pairs() -> None:
    matrix = np.array([[100.0, 100.0, -70.0, 60.0, 5.0]])  # odd K: padded with a zero
    positive, negative = pair_extremes(matrix)
    assert positive.tolist() == [200.0] and negative.tolist() == [70.0]


@pytest.mark.parametrize(
    ("slot", "shape"),
    [
        (WeightSlot("w", 0, "conv"), (16, 8, 3, 3)),
        (WeightSlot("w", 1, "k-rows"), (64, 32)),
        (WeightSlot("w", 0, "k-cols"), (32, 63)),
        (WeightSlot("w", None, "conv"), (8, 3, 3, 3)),
    ],
)
def test_pairsafe_never_overflows_and_beats_seven_bits(slot: WeightSlot, shape) -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal(shape).astype(np.float32)
    results = {}
    for policy in ("ignore", "pair-safe", "reduce-range"):
        plan = WeightPlan("w", axis=slot.axis)
        params = choose_weight(weight, slot, plan, AVX2, policy)
        results[policy] = (plan, params)
    full = results["ignore"][1]
    assert can_saturate(full, slot).any(), "Gaussian weights should have overflowing pairs"
    safe_plan, safe = results["pair-safe"]
    assert safe_plan.format == "s8-pairsafe" and "could overflow" in safe_plan.reason
    matrix = reduction_matrix(safe.values.astype(np.int32), slot)
    positive, negative = pair_extremes(matrix)
    assert positive.max() <= PAIR_LIMIT and negative.max() <= PAIR_LIMIT

    def error(params) -> float:
        shape_c = [1] * weight.ndim
        if params.axis is not None:
            shape_c[params.axis] = -1
        scale = np.asarray(params.scale).reshape(shape_c)
        return float(np.sum((params.values * scale - weight) ** 2))

    seven_plan, seven = results["reduce-range"]
    assert np.abs(seven.values).max() <= 63 and seven_plan.format == "s7"
    assert error(full) < error(safe) < error(seven)


@pytest.mark.parametrize(
    "slot", [WeightSlot("w", 1, "k-rows"), WeightSlot("w", None, "k-rows")], ids=["axis", "tensor"]
)
def test_pairsafe_search_in_small_chunks_gives_the_same_weight(slot, monkeypatch) -> None:
    """The search is chunked to hold memory flat on large weights; chunking must not change it."""
    weight = np.random.default_rng(1).standard_normal((96, 40)).astype(np.float32)
    whole = choose_weight(weight, slot, WeightPlan("w", axis=slot.axis), AVX2, "pair-safe")
    monkeypatch.setattr(weight_format, "_CHUNK_ELEMENTS", 200)  # 2 channels of K=96 per chunk
    chunked = choose_weight(weight, slot, WeightPlan("w", axis=slot.axis), AVX2, "pair-safe")
    assert np.array_equal(whole.values, chunked.values)
    assert np.array_equal(whole.scale, chunked.scale)


def test_uint8_weights_are_the_int8_values_plus_128() -> None:
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    slot = WeightSlot("w", 0, "conv")
    plan = WeightPlan("w")
    u8 = choose_weight(weight, slot, plan, AVX2, "uint8-weights")
    s8 = keep_channel_sums(weight, quantize_weight(weight, 0))  # a conv's filters keep sums
    assert plan.format == "u8" and u8.values.dtype == np.uint8
    assert (u8.zero_point_array() == 128).all()
    np.testing.assert_array_equal(u8.values.astype(np.int16) - 128, s8.values)


def test_cpus_that_do_not_saturate_keep_full_range_int8() -> None:
    weight = np.random.default_rng(2).standard_normal((16, 8, 3, 3)).astype(np.float32)
    for name in ("avx512-vnni", "avx-vnni", "amx", "arm64"):
        plan = WeightPlan("w")
        params = choose_weight(weight, WeightSlot("w", 0, "conv"), plan, resolve_cpu(name), "auto")
        assert plan.format == "s8" and "does not saturate" in plan.reason
        full = keep_channel_sums(weight, quantize_weight(weight, 0))  # round-to-nearest + sums
        np.testing.assert_array_equal(params.values, full.values)


def test_depthwise_weights_stay_full_range_on_avx2() -> None:
    weight = np.full((4, 1, 3, 3), 1.0, np.float32)
    plan = WeightPlan("w")
    choose_weight(weight, WeightSlot("w", 0, "depthwise", 4), plan, AVX2, "auto")
    assert plan.format == "s8" and "depthwise" in plan.reason


# ----------------------------------------------------------------------------- end to end

SATURATING_CNN = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(4, 16, 3, padding=1)
            self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
            self.fc = nn.Linear(16, 10)

        def forward(self, x):
            x = nn.functional.relu6(self.conv1(x))
            x = torch.relu(self.conv2(x))
            return self.fc(x.mean((2, 3)))

    def make_model():
        torch.manual_seed(0)
        model = Net()
        with torch.no_grad():  # mostly positive weights: neighbouring products share a sign
            for conv in (model.conv1, model.conv2):
                conv.weight.copy_(conv.weight.abs() + 0.05 * torch.randn_like(conv.weight))
        return model
    """
)


def _cnn_recipe(folder: Path, quantization: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(SATURATING_CNN)
    recipe = folder / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(
            f"""
            model: {{pytorch: model.py:make_model}}
            inputs: {{x: [1, 4, 8, 8]}}
            calibration: {{data: {{synthetic: true, samples: 32}}, batch_size: 8, method: minmax}}
            quantization: {{{quantization}}}
            output: {{dir: out}}
            """
        )
    )
    return recipe


def _sqnr_vs_float(float_path: Path, quant_path: Path, fused: bool) -> float:
    x = np.random.default_rng(3).standard_normal((32, 4, 8, 8)).astype(np.float32)
    ref = _session(onnx.load(str(float_path)), True).run(None, {"x": x})[0]
    out = _session(onnx.load(str(quant_path)), fused).run(None, {"x": x})[0]
    noise = float(np.sum((ref.astype(np.float64) - out) ** 2))
    return (
        math.inf
        if noise == 0
        else 10 * math.log10(float(np.sum(ref.astype(np.float64) ** 2)) / noise)
    )


@pytest.fixture(scope="module")
def saturation_runs(tmp_path_factory) -> dict:
    runs = {}
    base = tmp_path_factory.mktemp("saturation")
    for policy in ("ignore", "auto", "uint8-weights"):
        recipe = load_recipe(_cnn_recipe(base / policy, f"cpu: avx2, saturation: {policy}"))
        result = quantize(recipe, progress=False)
        runs[policy] = (recipe, result)
    return runs


def test_remedy_restores_the_unfused_sqnr(saturation_runs) -> None:
    recipe, result = saturation_runs["auto"]
    fused = _sqnr_vs_float(recipe.float_model_path, result.model_path, True)
    unfused = _sqnr_vs_float(recipe.float_model_path, result.model_path, False)
    assert fused >= unfused - 0.5 and unfused > 25
    formats = result.report["summary"]["weight_formats"]
    assert formats.get("s8-pairsafe", 0) >= 2, formats
    assert result.report["cpu"]["u8s8_saturates"] is True
    assert result.report["cpu"]["source"] == "recipe: quantization.cpu = avx2"


@pytest.mark.skipif(not SATURATING_HERE, reason="this CPU's uint8 x int8 kernels do not saturate")
def test_full_range_int8_saturates_here(saturation_runs) -> None:
    recipe, result = saturation_runs["ignore"]
    fused = _sqnr_vs_float(recipe.float_model_path, result.model_path, True)
    unfused = _sqnr_vs_float(recipe.float_model_path, result.model_path, False)
    assert fused < unfused - 6, (fused, unfused)


def test_uint8_weights_equal_int8_semantics(saturation_runs) -> None:
    recipe, result = saturation_runs["uint8-weights"]
    _, ignore = saturation_runs["ignore"]
    unfused_u8 = _sqnr_vs_float(recipe.float_model_path, result.model_path, False)
    unfused_s8 = _sqnr_vs_float(recipe.float_model_path, ignore.model_path, False)
    assert unfused_u8 == pytest.approx(unfused_s8, abs=1e-6)
    fused_u8 = _sqnr_vs_float(recipe.float_model_path, result.model_path, True)
    assert fused_u8 >= unfused_u8 - 0.5  # U8U8 kernels widen before adding: nothing saturates


def test_relu6_folds_into_the_conv_output(saturation_runs) -> None:
    recipe, result = saturation_runs["auto"]
    nodes = {n["name"]: n for n in result.report["nodes"]}
    clips = [n for n in nodes.values() if n["op_type"] == "Clip"]
    assert clips and all(n["source"] == "folded" for n in clips)
    model = onnx.load(str(result.model_path))
    assert not any(n.op_type == "Clip" for n in model.graph.node)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producers = {out: n for n in model.graph.node for out in n.output}
    conv2 = next(n for n in model.graph.node if n.name == "/conv2/Conv")
    quant = producers[producers[conv2.input[0]].input[0]]  # DQ <- Q of the folded Clip output
    scale, zero = values[quant.input[1]], values[quant.input[2]]
    assert zero == 0 and float(scale) * 255 <= 6.0 + 1e-6  # the range never exceeds ReLU6's max


def test_report_reasons_name_what_ort_has(tmp_path) -> None:
    source = textwrap.dedent(
        """
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x):
                return torch.sigmoid(self.fc(x))

        def make_model():
            torch.manual_seed(0)
            return Net()
        """
    )
    (tmp_path / "model.py").write_text(source)
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(
        "model: {pytorch: model.py:make_model}\ninputs: {x: [1, 8]}\n"
        "calibration: {data: {synthetic: true, samples: 8}, method: minmax}\n"
    )
    result = quantize(load_recipe(recipe_path), progress=False)
    sigmoid = next(n for n in result.report["nodes"] if n["op_type"] == "Sigmoid")
    assert sigmoid["precision"] == "float" and "QLinearSigmoid" in sigmoid["reason"]
    report = json.loads(result.report_path.read_text())
    assert report["nodes"][0]["weight"]["format"] in {"s8", "s8-pairsafe"}


def test_recipe_rejects_an_unknown_cpu(tmp_path) -> None:
    from qtool.errors import RecipeError

    path = _cnn_recipe(tmp_path, "cpu: pentium")
    with pytest.raises(RecipeError, match="quantization.cpu"):
        load_recipe(path)
    assert dataclasses.is_dataclass(load_recipe(_cnn_recipe(tmp_path / "ok", "cpu: amx")))
