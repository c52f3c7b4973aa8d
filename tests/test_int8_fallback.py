"""INT8 fallback (quantization.algorithms.int8_fallback): the 4-bit layers whose rounding costs
the most output noise (relative to the layer's output) per parameter keep 8-bit weights, within
the share the recipe sets; the ranking is the exact output error and energy from the calibration
Hessian; the plan and report say which.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.algorithms import int8_fallback
from qtool.algorithms.spec import Int8FallbackParams
from qtool.calibration.hessians import HessianAccumulator
from qtool.config import presets
from qtool.errors import RecipeError
from qtool.model.prepare import prepare_model
from qtool.pipeline import planning
from qtool.plan.settings import QuantizationSpec, WeightSettings
from qtool.write.int4 import dequantize, quantize_blockwise

K, N, ROWS = 64, 32, 256
SPEC = QuantizationSpec(
    op_types=("MatMul",),
    weights=WeightSettings(bits=4, block_size=16, symmetric=False),
)


def _model(path: Path, widths: dict[str, int], heavy: str | None = None) -> onnx.ModelProto:
    """Independent MatMuls `name`: input `x_name` [b, K] times a random [K, width] weight. The
    weight of `heavy` has one entry in every 16 rows 12x larger: each 4-bit block of 16 along K
    holds an outlier that sets its step (the weights 4 bits serve worst)."""
    rng = np.random.default_rng(0)
    nodes, inputs, outputs, weights = [], [], [], []
    for name, width in widths.items():
        nodes.append(helper.make_node("MatMul", [f"x_{name}", f"w_{name}"], [f"y_{name}"], name))
        inputs.append(helper.make_tensor_value_info(f"x_{name}", TensorProto.FLOAT, ["b", K]))
        outputs.append(helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, ["b", width]))
        w = rng.normal(size=(K, width)).astype(np.float32)
        if name == heavy:
            w[::16, :] *= 12.0
        weights.append(numpy_helper.from_array(w, f"w_{name}"))
    graph = helper.make_graph(nodes, "g", inputs, outputs, weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.save(model, path)
    return prepare_model(model, min_opset=21)


def _hessian(x: np.ndarray, name: str) -> HessianAccumulator:
    acc = HessianAccumulator(x.shape[1], name)
    acc.update(x)
    return acc


def _hessians(names, scaled: str | None = None) -> dict[str, HessianAccumulator]:
    """Alike inputs for every layer; `scaled`'s input is 30x larger throughout."""
    found = {}
    for i, name in enumerate(names):
        x = np.random.default_rng(10 + i).normal(size=(ROWS, K)).astype(np.float32)
        if name == scaled:
            x *= 30.0
        found[f"x_{name}"] = _hessian(x, f"x_{name}")
    return found


def _plan(model):
    return planning.plan(model, SPEC, "minmax", "test")


def test_the_layer_whose_weights_4_bits_serve_worst_ranks_first(tmp_path):
    model = _model(tmp_path / "m.onnx", {"a": N, "b": N, "c": N}, heavy="b")
    hessians = _hessians("abc")
    ranked = int8_fallback.rank_layers(model, _plan(model), hessians)
    assert [r.node for r in ranked][0] == "b"
    # the errors are the exact output errors of round-to-nearest on the plan's grid, and the
    # signal the output's energy, over the tokens the Hessian holds
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w_b"))
    approx = dequantize(quantize_blockwise(w, block_size=16, symmetric=False))
    d = (w - approx).astype(np.float64)
    h = hessians["x_b"].xtx
    b = ranked[0]
    assert b.error_int4 == pytest.approx(float(np.sum(d * (h @ d))), rel=1e-4)
    assert b.signal == pytest.approx(float(np.sum(w * (h @ w))), rel=1e-4)
    assert 0 < b.error_int8 < b.error_int4 / 20  # 8 bits per channel: far finer than 4 in blocks
    assert b.params == K * N
    assert b.gain_per_param == pytest.approx((b.error_int4 - b.error_int8) / b.signal / b.params)


def test_an_input_larger_throughout_does_not_change_a_layers_case(tmp_path):
    """Relative error: a layer whose input is 30x larger has 900x the output error and 900x the
    output, so the same case for 8 bits (an absolute error would rank it first)."""
    model = _model(tmp_path / "m.onnx", {"a": N, "b": N})
    plain = {r.node: r for r in int8_fallback.rank_layers(model, _plan(model), _hessians("ab"))}
    louder = int8_fallback.rank_layers(model, _plan(model), _hessians("ab", scaled="b"))
    loud = {r.node: r for r in louder}
    assert loud["b"].error_int4 == pytest.approx(900 * plain["b"].error_int4, rel=1e-3)
    assert loud["b"].gain_per_param == pytest.approx(plain["b"].gain_per_param, rel=1e-3)


def test_the_fallback_replans_the_chosen_layers_at_8_bits_and_reports_them(tmp_path):
    model = _model(tmp_path / "m.onnx", {"a": N, "b": N, "c": N, "d": N}, heavy="c")
    layout = _plan(model)
    hessians = _hessians("abcd")

    def replan(extra):
        return planning.plan(
            model, QuantizationSpec(**{**SPEC.__dict__, "overrides": tuple(extra)}), "minmax", "t"
        )

    fell = int8_fallback.apply_fallback(
        model, layout, Int8FallbackParams(ratio=0.75), hessians, replan
    )
    assert fell.entry["int8"] == ["c"]  # one layer of four: exactly 1 - 0.75 of the parameters
    assert fell.entry["params_4bit_share"] == pytest.approx(0.75)
    planned = {name: fell.layout.plan[name] for name in "abcd"}
    c = planned["c"].weight
    # the weight-only int8 of the int8-llm preset: per channel, symmetric, round to nearest
    assert (c.bits, c.granularity, c.symmetric, c.method) == (8, "per-channel", True, "minmax")
    assert planned["c"].activations == "float"
    assert all(planned[n].weight.bits == 4 for n in "abd")
    assert [r["node"] for r in fell.entry["ranking"]][0] == "c"
    # ratio 1: every layer stays 4-bit and the plan is the one given
    kept = int8_fallback.apply_fallback(
        model, layout, Int8FallbackParams(ratio=1.0), hessians, replan
    )
    assert kept.entry["int8"] == [] and kept.layout is layout


def test_the_share_kept_at_4_bits_is_at_least_the_ratio():
    def layer(node, params, gain):
        return int8_fallback.Ranked(node, "x", params, gain * params + 1.0, 1.0, 1.0)

    # ranked best first; the big second layer does not fit the allowance, the third does
    ranked = [layer("a", 100, 9.0), layer("big", 500, 8.0), layer("c", 100, 7.0)]
    ranked += [layer(f"r{i}", 100, 1.0) for i in range(7)]  # 1,300 parameters in all
    chosen = int8_fallback.choose(ranked, 0.8)  # allowance 260
    assert [r.node for r in chosen] == ["a", "c"]
    assert int8_fallback.choose(ranked, 1.0) == []
    assert len(int8_fallback.choose(ranked, 0.0)) == len(ranked)
    # a layer that 4 bits already hold exactly gains nothing and never falls back
    exact = [int8_fallback.Ranked("z", "x", 10, 0.0, 0.0, 1.0)]
    assert int8_fallback.choose(exact, 0.0) == []


def _recipe(tmp_path: Path, quantization: dict, extra: dict | None = None) -> Path:
    model = tmp_path / "m.onnx"
    _model(model, {"a": N})
    x = np.random.default_rng(0).normal(size=(8, K)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x_a=x)
    recipe = {
        "model": {"onnx": str(model)},
        "inputs": {"x_a": {"shape": [1, K]}},
        "calibration": {"data": {"npz": str(tmp_path / "calib.npz")}, "method": "minmax"},
        "quantization": quantization,
        "output": {"dir": str(tmp_path / "out")},
        **(extra or {}),
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize(
    ("quantization", "field", "message"),
    [
        (
            {"op_types": ["MatMul"], "algorithms": {"int8_fallback": {}}},
            "quantization.algorithms.int8_fallback",
            "no weight is 4-bit",
        ),
        (
            {"weights": {"bits": 4}, "algorithms": {"int8_fallback": {"ratio": 1.5}}},
            "quantization.algorithms.int8_fallback.ratio",
            r"must be in \[0, 1\]",
        ),
    ],
)
def test_bad_fallback_settings_name_the_field(tmp_path, cli, quantization, field, message):
    path = _recipe(tmp_path, quantization)
    result = cli("quantize", path, "--no-progress")
    assert result.exit_code == 2
    assert field in result.output and len(result.output.strip().splitlines()) == 1
    assert __import__("re").search(message, result.output)
    assert not (tmp_path / "out").exists()


def test_the_fallback_and_the_mixed_precision_search_do_not_combine(tmp_path, cli):
    quantization = {"weights": {"bits": 4}, "algorithms": {"int8_fallback": {}}}
    evaluation = {"evaluation": {"data": {"npz": str(tmp_path / "calib.npz")}, "min_cosine": 0.9}}
    path = _recipe(tmp_path, quantization, evaluation)
    result = cli("quantize", path, "--no-progress", "--auto")
    assert result.exit_code == 2
    assert "int8_fallback" in result.output and "use one of them" in result.output
    with pytest.raises(RecipeError):
        from qtool.app import quantize
        from qtool.config.recipe import load_recipe

        quantize.quantize(load_recipe(path), progress=False, auto=True)


def test_the_preset_keeps_the_ranked_layers_at_8_bits_in_the_written_model(tmp_path, cli):
    """`base: int4-mixed-llm` on the tiny KV-cache Llama: the layers the report names are
    8-bit MatMulNBits in the file, the rest 4-bit, and the 4-bit share is at least the ratio."""
    from tests.test_llm_kv_cache import quantize_with_preset

    data = Path(__file__).resolve().parent / "data" / "tiny_llama_dynamo.onnx"
    out = quantize_with_preset(cli, tmp_path, "int4-mixed-llm", data)
    report = json.loads((out / "report.json").read_text())
    entry = report["algorithms"]["int8_fallback"]
    preset = yaml.safe_load((presets.FOLDER / "int4-mixed-llm.yaml").read_text())
    ratio = preset["quantization"]["algorithms"]["int8_fallback"]["ratio"]
    assert entry["ratio"] == ratio and entry["int8"]
    assert entry["params_4bit_share"] >= ratio
    nodes = {n["name"]: n for n in report["nodes"]}
    for name in entry["int8"]:
        assert nodes[name]["precision"] == "int8" and nodes[name]["activations"] == "float"
    four = [r["node"] for r in entry["ranking"] if not r["int8"]]
    assert all(nodes[name]["precision"] == "int4" for name in four)
    written = {n.name: n for n in onnx.load(out / "model.int4.onnx").graph.node}
    four_bits = {
        n.name
        for n in written.values()
        if n.op_type == "MatMulNBits" and helper.get_node_attr_value(n, "bits") == 4
    }
    assert four_bits == set(four)
    for name in entry["int8"]:  # int8 per channel in the file; ORT forms 8-bit MatMulNBits
        assert written[name].op_type == "MatMul"
        assert nodes[name]["runtime"]["runs_as"] == "MatMulNBits"
        assert nodes[name]["tensors"][0]["dtype"] == "int8"
