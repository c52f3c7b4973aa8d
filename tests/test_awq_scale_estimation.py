"""AWQ and scale estimation lower a layer's output error against round-to-nearest on a built case
(inputs with a few large channels, as LLM activations have), AWQ's float transform is exact and
lands where it costs nothing, and GPTQ's act order is a recipe setting.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.algorithms import awq
from qtool.algorithms.spec import AwqParams
from qtool.calibration.hessians import HessianAccumulator
from qtool.config.recipe import read_algorithms
from qtool.errors import RecipeError
from qtool.model.prepare import prepare_model
from qtool.pipeline import planning
from qtool.plan.layout import WeightSlot
from qtool.plan.plan import WeightPlan
from qtool.plan.settings import QuantizationSpec, WeightSettings
from qtool.write.int4 import dequantize, quantize_blockwise
from qtool.write.scale_estimation import ScaleSearch, block_hessians, scale_estimated

K, N, ROWS = 64, 48, 512


def _outlier_inputs(seed: int = 0) -> np.ndarray:
    """Rows whose channels differ in scale by 100x, a few of them far larger than the rest."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, K)).astype(np.float32) * rng.uniform(0.1, 1.0, K).astype(np.float32)
    x[:, [3, 17, 40]] *= 30.0
    return x


def _output_error(w: np.ndarray, approx: np.ndarray, h: np.ndarray) -> float:
    d = (w - approx).astype(np.float64)
    return float(np.sum(d * (h @ d)))


def test_awq_scale_search_lowers_the_output_error_of_round_to_nearest():
    x = _outlier_inputs()
    h = (x.T @ x / ROWS).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(K, N)).astype(np.float32)
    plan = WeightPlan("w", 4, "block", 0, "s4", "", block_size=16, symmetric=True)
    member = awq.Member("mm", "w", WeightSlot("w", 0, "k-rows", block_size=16), plan)
    choice = awq.search_scale([w], (member,), h, grid=20)
    rtn = dequantize(quantize_blockwise(w, block_size=16, symmetric=True))
    assert choice.error_before == pytest.approx(_output_error(w, rtn, h), rel=1e-4)
    assert choice.scale is not None and 0.0 < choice.alpha <= 1.0
    assert choice.error_after < 0.7 * choice.error_before
    # the scale favours the large channels
    assert choice.scale[[3, 17, 40]].min() > np.median(choice.scale)


def test_awq_keeps_a_layer_unscaled_when_no_alpha_helps():
    x = np.random.default_rng(2).normal(size=(ROWS, K)).astype(np.float32)  # no outliers
    h = (x.T @ x / ROWS).astype(np.float32)
    h = np.eye(K, dtype=np.float32) * float(np.mean(np.diag(h)))  # every channel alike
    w = np.random.default_rng(3).normal(size=(K, N)).astype(np.float32)
    plan = WeightPlan("w", 4, "block", 0, "s4", "", block_size=16, symmetric=True)
    member = awq.Member("mm", "w", WeightSlot("w", 0, "k-rows", block_size=16), plan)
    choice = awq.search_scale([w], (member,), h, grid=10)
    assert choice.scale is None and choice.alpha == 0.0
    assert choice.error_after == choice.error_before


@pytest.mark.parametrize("symmetric", [True, False])
def test_scale_estimation_lowers_every_blocks_output_error(symmetric):
    x = _outlier_inputs(4)
    h = (x.T @ x / ROWS).astype(np.float64)
    w = np.random.default_rng(5).normal(size=(K, N)).astype(np.float32)
    w[::7] *= 4.0  # a few rows with wide ranges: shrinking their grid can pay
    rtn = quantize_blockwise(w, block_size=16, symmetric=symmetric)
    found = scale_estimated(w, h, rtn, ScaleSearch(steps=10, min_factor=0.5, refine=2))
    assert found.values.shape == w.shape and found.scale.shape == rtn.scale.shape
    blocks = block_hessians(h, 16)

    def per_block(bw) -> np.ndarray:
        d = (w - dequantize(bw)).astype(np.float64).reshape(K // 16, 16, N)
        return np.einsum("kbn,kbn->kn", d, np.einsum("kbc,kcn->kbn", blocks, d))

    before, after = per_block(rtn), per_block(found)
    assert np.all(after <= before * (1 + 1e-6))  # never worse on any block
    assert after.sum() < 0.9 * before.sum()
    # and on the layer's whole output error too (cross-block terms included)
    assert _output_error(w, dequantize(found), h) < _output_error(w, dequantize(rtn), h)


# --------------------------------------------------------------------------- the float transform


def _decoder_layer(path, seed: int = 0) -> None:
    """RMSNorm-like Mul(x, gamma) -> q, k; SwiGLU gate/up -> Mul -> down; and an 'o' MatMul whose
    input also feeds the residual Add (1/s cannot go into it)."""
    rng = np.random.default_rng(seed)

    def w(name, *shape):
        return numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Mul", ["x", "gamma"], ["normed"], name="norm"),
        helper.make_node("MatMul", ["normed", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["normed", "wk"], ["k"], name="k_proj"),
        helper.make_node("Add", ["q", "k"], ["qk"], name="qk_add"),
        helper.make_node("MatMul", ["qk", "wo"], ["o"], name="o_proj"),
        helper.make_node("Add", ["o", "qk"], ["res"], name="residual"),
        helper.make_node("MatMul", ["res", "wg"], ["g"], name="gate_proj"),
        helper.make_node("MatMul", ["res", "wu"], ["u"], name="up_proj"),
        helper.make_node("Sigmoid", ["g"], ["sg"], name="sig"),
        helper.make_node("Mul", ["g", "sg"], ["act"], name="silu"),
        helper.make_node("Mul", ["act", "u"], ["gated"], name="gated_mul"),
        helper.make_node("MatMul", ["gated", "wd"], ["y"], name="down_proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", K])],
        [
            numpy_helper.from_array(rng.uniform(0.5, 2, K).astype(np.float32), "gamma"),
            w("wq", K, K),
            w("wk", K, K),
            w("wo", K, K),
            w("wg", K, 2 * K),
            w("wu", K, 2 * K),
            w("wd", 2 * K, K),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.save(model, path)


def _tensors(model: onnx.ModelProto, names: list[str], x: np.ndarray) -> dict[str, np.ndarray]:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    known = {o.name for o in copy.graph.output}
    for name in names:
        if name not in known:
            copy.graph.output.append(helper.make_empty_tensor_value_info(name))
    session = ort.InferenceSession(copy.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(names, session.run(names, {"x": x}), strict=True))


AWQ_INPUTS = ["normed", "qk", "res", "gated"]
AWQ_PARAMS = AwqParams(grid=20)


def _awq_case(tmp_path):
    """The decoder layer prepared, its 4-bit re-planner, outlier inputs, the activations of
    AWQ_INPUTS and `y` on them, and those inputs' Hessians."""
    _decoder_layer(tmp_path / "layer.onnx")
    model = prepare_model(onnx.load(tmp_path / "layer.onnx"), min_opset=21)
    spec = QuantizationSpec(
        op_types=("MatMul",), weights=WeightSettings(bits=4, block_size=16, symmetric=True)
    )

    def replan(m):
        return planning.plan(m, spec, "minmax", "recipe")

    x = _outlier_inputs(6)[:, :K]
    acts = _tensors(model, AWQ_INPUTS + ["y"], x)
    hessians = {}
    for name in AWQ_INPUTS:
        hessians[name] = HessianAccumulator(acts[name].shape[-1], name)
        hessians[name].update(acts[name])
    return model, replan, x, acts, hessians


def test_awq_transform_is_exact_and_folds_where_it_is_free(tmp_path):
    model, replan, x, acts, hessians = _awq_case(tmp_path)
    inputs = AWQ_INPUTS
    scaled = awq.apply_awq(model, replan(model), AWQ_PARAMS, hessians, replan)
    entry = {layer["input"]: layer for layer in scaled.entry["layers"]}
    assert set(entry) == set(inputs)
    assert entry["normed"]["inverse_scale_in"] == "the constant 'gamma' of Mul 'norm'"
    assert entry["gated"]["inverse_scale_in"].startswith("the output columns of MatMul 'up_proj'")
    assert (
        entry["qk"]["inverse_scale_in"] == "a new Mul 'qk_awq_Mul' in front of the scaled MatMuls"
    )
    # the float function is unchanged, every output and every residual tensor
    got = _tensors(scaled.model, ["y", "res"], x)
    np.testing.assert_allclose(got["y"], acts["y"], rtol=1e-3, atol=1e-3 * np.abs(acts["y"]).max())
    scale = np.abs(acts["res"]).max()
    np.testing.assert_allclose(got["res"], acts["res"], rtol=1e-4, atol=1e-5 * scale)
    # the Hessians are those of the scaled inputs the MatMuls now read
    for name in inputs:
        if not entry[name]["applied"]:
            continue
        read = "qk_awq_scaled" if name == "qk" else name
        after = _tensors(scaled.model, [read], x)[read]
        direct = after.T.astype(np.float64) @ after
        np.testing.assert_allclose(
            scaled.hessians[read].xtx, direct, rtol=1e-3, atol=1e-5 * np.abs(direct).max()
        )
        assert entry[name]["error_after"] < entry[name]["error_before"]
    # the re-planned layout finds the scaled MatMuls and their new inputs
    assert scaled.layout.weight_inputs["wo"] == "qk_awq_scaled"
    assert not scaled.layout.plan["qk_awq_Mul"].quantized


# --------------------------------------------------------------------------- GPTQ's parameters


def test_gptq_act_order_and_damp_are_recipe_settings():
    params = read_algorithms({"gptq": {"act_order": False, "damp": 0.05}}, "r.yaml").gptq
    assert dataclasses.asdict(params) == {"act_order": False, "damp": 0.05}
    assert read_algorithms(["gptq"], "r.yaml").gptq.act_order is True  # the default
    with pytest.raises(RecipeError, match="gptq.damp: must be in"):
        read_algorithms({"gptq": {"damp": 2}}, "r.yaml")
    with pytest.raises(RecipeError, match="act_order: must be true or false"):
        read_algorithms({"gptq": {"act_order": "yes"}}, "r.yaml")
    algorithms = read_algorithms({"awq": {"grid": 8}, "scale_estimation": {"steps": 3}}, "r")
    assert algorithms.names() == ("awq", "scale_estimation")


def test_awq_on_a_lazy_model_keeps_its_scaled_weights_on_disk(tmp_path):
    """A lazy model's scaled weights go to a scratch file, referenced as lazy weights (not into
    the model proto), with the values the in-memory transform gives; the file goes with it."""
    from qtool.model.external_data import lazy_file, make_lazy, tensor_array

    model, replan, _, _, hessians = _awq_case(tmp_path)
    whole = awq.apply_awq(model, replan(model), AWQ_PARAMS, hessians, replan)
    assert whole.scratch is None
    onnx.save(model, tmp_path / "ext.onnx", save_as_external_data=True, size_threshold=0)
    lazy = onnx.load(tmp_path / "ext.onnx", load_external_data=False)
    make_lazy(lazy, tmp_path)
    scaled = awq.apply_awq(lazy, replan(lazy), AWQ_PARAMS, hessians, replan)
    assert scaled.scratch is not None and scaled.scratch.path.is_file()
    expected = {t.name: numpy_helper.to_array(t) for t in whole.model.graph.initializer}
    moved = 0
    for tensor in scaled.model.graph.initializer:
        where = lazy_file(tensor)
        # every weight is lazy but the new inverse scales (small, inline)
        assert (where is None) == tensor.name.endswith("_awq_inverse_scale")
        moved += where is not None and where[0] == scaled.scratch.path
        np.testing.assert_array_equal(tensor_array(tensor), expected[tensor.name])
    assert moved == 7  # wq wk wo wg wu wd scaled, and gamma (1/s folded in)
    path = scaled.scratch.path
    scaled.scratch.close()
    assert not path.exists()
