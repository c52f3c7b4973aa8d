"""AdaRound: the learned roundings stay within one grid step of W / s on the weight format's
grid, lower each layer's output error on the calibration data (checked here with torch's own
conv and matmul on the written int8 weights, not with the algorithm's sums), keep ORT's 16-bit
pair sums safe on AVX2, give the same bytes twice, and are reported per node."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper

from qtool.algorithms.adaround import (
    Geometry,
    Grams,
    Rounding,
    confidence,
    fake_quantize,
    from_groups,
    input_rows,
    learn_rounding,
    single_thread,
    squared_error,
    toward_zero,
    weight_groups,
)
from qtool.app import settings
from qtool.app.quantize import quantize
from qtool.calibration.collect import save_with_extra_outputs
from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError
from qtool.ort.sessions import create_session
from qtool.plan.layout import WeightSlot
from qtool.write.params import WeightParams
from qtool.write.weight_format import (
    PAIR_LIMIT,
    can_saturate,
    pair_extremes,
    reduction_matrix,
    restore_pair_limit,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ITERATIONS = 150  # enough to beat nearest rounding on digits; keeps each run a few seconds


# ---------------------------------------------------------------- backend-free math


def _conv_case(groups: int, spatial: int, rng: np.random.Generator):
    channels, outputs = 4, 8
    kernel = (3,) * spatial
    geometry = Geometry(
        "conv",
        groups=groups,
        kernel=kernel,
        strides=(2,) * spatial,
        pads=(1,) * spatial + (0,) * spatial,  # asymmetric: begin 1, end 0
        dilations=(1,) * spatial,
    )
    x = torch.from_numpy(rng.normal(size=(3, channels) + (7,) * spatial).astype(np.float32))
    w = rng.normal(size=(outputs, channels // groups, *kernel)).astype(np.float32)
    return geometry, x, w


@pytest.mark.parametrize("groups,spatial", [(1, 2), (2, 2), (4, 2), (1, 1)])
def test_sums_give_the_output_error_torch_computes(groups, spatial) -> None:
    """The K x K sums reproduce ||conv(x, W) - conv(x̃, Ŵ)||² for grouped, strided, padded and
    1-D convolutions, and for a Gemm with transB and alpha."""
    rng = np.random.default_rng(groups * 10 + spatial)
    geometry, x, w = _conv_case(groups, spatial, rng)
    xq = fake_quantize(x, 0.03, 120, 0, 255)
    grams = Grams()
    grams.update(input_rows(x, geometry), input_rows(xq, geometry))
    w_hat = (np.rint(w * 20) / 20).astype(np.float32)
    conv = F.conv2d if spatial == 2 else F.conv1d
    pad = [1, 0] * spatial  # (begin, end) per spatial axis
    ref = conv(F.pad(x, pad), torch.from_numpy(w), stride=2, groups=groups)
    out = conv(F.pad(xq, pad), torch.from_numpy(w_hat), stride=2, groups=groups)
    direct = float(((ref.double() - out.double()) ** 2).sum())
    ours = squared_error(grams, weight_groups(w, geometry), weight_groups(w_hat, geometry))
    assert ours == pytest.approx(direct, rel=1e-5)
    assert np.array_equal(from_groups(weight_groups(w, geometry), w.shape, geometry), w)
    # Sampled positions: 2 per sample, each row one of the full set's.
    full = input_rows(x, geometry)
    some = input_rows(x, geometry, 2, torch.Generator().manual_seed(0))
    assert some.shape == (groups, 2 * x.shape[0], full.shape[2])
    for group in range(groups):
        same = (some[group][:, None, :] == full[group][None, :, :]).all(dim=2)
        assert bool(same.any(dim=1).all())

    gemm = Geometry("nk", alpha=0.5)
    a = torch.from_numpy(rng.normal(size=(5, 8)).astype(np.float32))
    b = rng.normal(size=(3, 8)).astype(np.float32)  # [N, K]: transB=1
    b_hat = (np.rint(b * 10) / 10).astype(np.float32)
    aq = fake_quantize(a, 0.05, 0, -128, 127)
    grams = Grams()
    grams.update(input_rows(a, gemm), input_rows(aq, gemm))
    direct = float(
        (
            (0.5 * a @ torch.from_numpy(b).T - 0.5 * aq @ torch.from_numpy(b_hat).T).double() ** 2
        ).sum()
    )
    ours = squared_error(grams, weight_groups(b, gemm), weight_groups(b_hat, gemm))
    assert ours == pytest.approx(direct, rel=1e-5)


def _hard_problem(seed: int = 0) -> tuple[Rounding, Grams, np.ndarray]:
    """A linear layer whose inputs are strongly correlated: rounding each weight to nearest
    leaves errors that add up along the correlated directions, which a joint choice cancels."""
    rng = np.random.default_rng(seed)
    k, n, rows = 32, 8, 2048
    basis = rng.normal(size=(4, k))
    x = (rng.normal(size=(rows, 4)) @ basis + 0.05 * rng.normal(size=(rows, k))).astype(np.float32)
    w = rng.normal(size=(k, n)).astype(np.float32)  # MatMul [K, N]
    geometry = Geometry("kn")
    grams = Grams()
    xt = torch.from_numpy(x)
    grams.update(input_rows(xt, geometry), input_rows(xt, geometry))
    groups = weight_groups(w, geometry)
    scale = np.broadcast_to((np.abs(groups).max(axis=2, keepdims=True) / 127), groups.shape)
    scale = np.ascontiguousarray(scale, np.float32)
    nearest = np.clip(np.rint(groups / scale), -127, 127).astype(np.int32)
    return Rounding(groups, scale, nearest, 127), grams, w


def test_rounding_is_floor_or_ceil_and_beats_nearest() -> None:
    problem, grams, _ = _hard_problem()
    with single_thread(0):
        values, soft = learn_rounding(problem, grams, 300)
    ratio = problem.weight / problem.scale
    assert np.all((values == np.floor(ratio)) | (values == np.ceil(ratio)))
    assert np.all(np.abs(values - ratio) < 1.0)
    assert np.all(np.abs(values) <= 127)
    before = squared_error(grams, problem.weight, problem.nearest * problem.scale)
    after = squared_error(grams, problem.weight, values * problem.scale)
    assert after < 0.5 * before, (before, after)
    assert int(np.count_nonzero(values != problem.nearest)) > 0
    # A weight whose other choice would leave the range (floor + 1 > 127) is never learned.
    frozen = np.floor(ratio) + 1 > 127
    assert np.all(np.isnan(soft[frozen])) and np.all(~np.isnan(soft[~frozen]))
    assert np.array_equal(values[frozen], problem.nearest[frozen])


def test_seven_bit_range_is_kept() -> None:
    problem, grams, _ = _hard_problem(1)
    scale = problem.scale * (127 / 63)
    nearest = np.clip(np.rint(problem.weight / scale), -63, 63).astype(np.int32)
    seven = Rounding(problem.weight, scale, nearest, 63)
    with single_thread(0):
        values, _ = learn_rounding(seven, grams, 200)
    assert np.abs(values).max() <= 63
    assert np.all(np.abs(values - seven.weight / seven.scale) < 1.0)


def test_pair_limit_is_restored_least_confident_first() -> None:
    slot = WeightSlot("w", 1, "k-rows")  # MatMul [K, N]: pairs are rows (0, 1), (2, 3)
    values = np.array([[65, -66], [64, -64], [10, -60], [3, 0]], np.int32)
    fallback = np.array([[64, -65], [63, -63], [10, -60], [3, 0]], np.int32)
    priority = np.array([[0.4, 0.3], [0.1, 0.2], [9, 9], [9, 9]], np.float32)
    out, moved = restore_pair_limit(values, fallback, priority, slot)
    # Column 0: 65 + 64 = 129: the less confident value (row 1) goes back to its fallback.
    # Column 1: |-66 - 64| = 130: over by 2, so both move, the less confident first.
    assert out.tolist() == [[65, -65], [63, -63], [10, -60], [3, 0]]
    assert moved == 3
    positive, negative = pair_extremes(reduction_matrix(out, slot).astype(np.float64))
    assert positive.max() <= PAIR_LIMIT and negative.max() <= PAIR_LIMIT


def test_pair_limit_refuses_an_infeasible_fallback() -> None:
    slot = WeightSlot("w", 1, "k-rows")
    values = np.array([[70], [70]], np.int32)
    with pytest.raises(ValueError, match="fallback"):
        restore_pair_limit(values, values, np.zeros((2, 1), np.float32), slot)


def test_toward_zero_and_confidence() -> None:
    problem = Rounding(
        np.array([[[0.6, -0.6, 2.0]]], np.float32),
        np.ones((1, 1, 3), np.float32),
        np.array([[[1, -1, 2]]], np.int32),
        127,
    )
    assert toward_zero(problem).tolist() == [[[0, 0, 2]]]
    soft = np.array([0.9, np.nan, 0.5], np.float32)
    assert confidence(soft)[1] == np.inf and confidence(soft)[2] == 0


# ---------------------------------------------------------------- the pipeline on digits


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adaround") / "digits"
    shutil.copytree(EXAMPLES / "digits", folder, ignore=shutil.ignore_patterns("out*", "__py*"))
    return folder


def _recipe(folder: Path, name: str, algorithms: str, extra: str = "", base="recipe.yaml"):
    """A digits recipe with `algorithms`; AdaRound's own checks are what these tests read, so
    the model-level comparison with plain min-max is off (tests/test_keep.py covers it)."""
    path = folder / name
    path.write_text(
        f"base: {base}\ntuning: {{baseline: none}}\n"
        f"quantization:\n{extra}  algorithms:\n{algorithms}"
    )
    return path


ADAROUND = f"    adaround: {{iterations: {ITERATIONS}, samples: 128}}\n"


@pytest.fixture(scope="module")
def runs(digits, tmp_path_factory):
    """digits quantized with nearest rounding and with AdaRound (twice), on this CPU and as for
    an AVX2 CPU without VNNI (pair-safe weights)."""
    out = tmp_path_factory.mktemp("adaround-runs")
    avx2 = "  cpu: avx2\n"
    recipes = {
        "nearest": _recipe(digits, "nearest.yaml", "    {}\n"),
        "adaround": _recipe(digits, "ada.yaml", ADAROUND),
        "nearest-avx2": _recipe(digits, "nearest-avx2.yaml", "    {}\n", avx2),
        "adaround-avx2": _recipe(digits, "ada-avx2.yaml", ADAROUND, avx2),
    }
    results = {}
    for name, recipe in [*recipes.items(), ("again", recipes["adaround"])]:
        quantize(load_recipe(recipe, output_dir=out / name), progress=False)
        results[name] = out / name
    return results


def _stored_weights(path: Path) -> dict[str, WeightParams]:
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or not node.input[0].endswith("_quantized"):
            continue
        values = inits.get(node.input[0])
        if values is None or values.dtype not in (np.int8, np.uint8) or values.ndim < 2:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), None)
        scale = inits[node.input[1]]
        zero = inits[node.input[2]]
        name = node.input[0].removesuffix("_quantized")
        out[name] = WeightParams(values, scale, axis if scale.ndim else None, zero)
    return out


def _float_weights(path: Path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


def _dequantized(params: WeightParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(signed values, per-element scale, dequantized weight)."""
    shape = params.values.shape
    view = [1] * len(shape)
    if params.axis is not None:
        view[params.axis] = -1
    scale = np.broadcast_to(np.asarray(params.scale, np.float32).reshape(view), shape)
    zero = np.asarray(params.zero_point, np.int32).reshape(view if params.axis is not None else ())
    signed = params.values.astype(np.int32) - zero
    return signed, scale, signed * scale


def test_report_block_lists_every_layer_with_both_errors(runs) -> None:
    report = json.loads((runs["adaround"] / "report.json").read_text())
    entry = report["algorithms"]["adaround"]
    assert entry["parameters"] == {"samples": 128, "iterations": ITERATIONS}
    assert "float model's input" in entry["input"]
    assert sorted(entry["nodes"]) == [
        "/conv1/Conv",
        "/conv2/Conv",
        "/conv3/Conv",
        "/fc1/Gemm",
        "/fc2/Gemm",
    ]
    assert entry["skipped"] == {}
    for node, layer in entry["nodes"].items():
        assert layer["rows"] > 0 and layer["weights_learned"] > 0, node
        assert layer["held_out_rows"] > 0, node  # the tuning rows it is judged on
        if layer["kept"] == "adaround":
            assert layer["output_mse_adaround"] < layer["output_mse_nearest"], node
            assert layer["held_out_mse_adaround"] < layer["held_out_mse_nearest"], node
            assert layer["weights_changed"] > 0 and layer["reason"] is None
        else:
            assert layer["weights_changed"] == 0 and "kept" in layer["reason"]
    kept = [n for n in entry["nodes"].values() if n["kept"] == "adaround"]
    assert len(kept) >= 4 and entry["applied"] is True and entry["reason"] is None
    assert 0 < entry["output_mse_after"] < entry["output_mse_before"]


def test_a_model_made_worse_as_a_whole_keeps_the_nearest_rounding(
    digits, tmp_path, runs, monkeypatch
) -> None:
    """Each layer improves, but if the model's outputs on the tuning rows got worse, no weight
    changes and the report says why."""
    from qtool.algorithms import adaround_apply

    errors = iter([1.0, 2.0])  # before, after
    monkeypatch.setattr(adaround_apply, "output_error", lambda *args: next(errors))
    result = quantize(load_recipe(digits / "ada.yaml", output_dir=tmp_path), progress=False)
    entry = result.report["algorithms"]["adaround"]
    assert entry["applied"] is False and "raised the model's output error" in entry["reason"]
    assert (entry["output_mse_before"], entry["output_mse_after"]) == (1.0, 2.0)
    assert all(
        n["kept"] == "nearest" and n["weights_changed"] == 0 for n in entry["nodes"].values()
    )
    reference = _stored_weights(runs["nearest"] / "model.int8.onnx")
    written = _stored_weights(tmp_path / "model.int8.onnx")
    assert written and all(
        np.array_equal(p.values, reference[n].values) for n, p in written.items()
    )


def test_every_weight_is_within_one_step_of_its_float_value(runs) -> None:
    floats = _float_weights(runs["adaround"] / "model.fp32.onnx")
    nearest = _stored_weights(runs["nearest"] / "model.int8.onnx")
    learned = _stored_weights(runs["adaround"] / "model.int8.onnx")
    assert set(learned) == set(nearest) and learned
    changed = 0
    for name, params in learned.items():
        signed, scale, _ = _dequantized(params)
        ratio = floats[name] / scale
        assert np.all((signed == np.floor(ratio)) | (signed == np.ceil(ratio))), name
        assert np.array_equal(params.scale, nearest[name].scale), name  # same grid
        changed += int(np.count_nonzero(params.values != nearest[name].values))
    assert changed > 0


def _layer_inputs(run: Path, recipe: Path, tensors: list[str]) -> list[dict[str, np.ndarray]]:
    """The float model's inputs to layers on the first 128 calibration samples (the
    calibration part of the recipe's split: what AdaRound learned on), via ORT."""
    loaded = load_recipe(recipe, output_dir=run)
    model = onnx.load(str(run / "model.fp32.onnx"))
    path = run / "with-outputs.onnx"
    save_with_extra_outputs(model, tensors, path)
    session = create_session(path, optimize=False)
    feeds = list(settings.calibration_data(loaded).first_inputs(128, 64))
    return [dict(zip(tensors, session.run(tensors, f), strict=True)) for f in feeds]


def _activation(run: Path, tensor: str) -> tuple[float, int]:
    inits = _float_weights(run / "model.int8.onnx")
    return float(inits[f"{tensor}_scale"]), int(inits[f"{tensor}_zero_point"])


def test_layer_output_error_is_lower_than_nearest_as_torch_measures_it(runs, digits) -> None:
    """Independent of the algorithm's sums: torch's conv2d / matmul with the stored weights on
    the quantized float inputs, against the float layer, on the calibration samples."""
    run = runs["adaround"]
    model = onnx.load(str(run / "model.fp32.onnx"))
    nodes = {n.name: n for n in model.graph.node}
    floats = _float_weights(run / "model.fp32.onnx")
    conv2, fc1 = nodes["/conv2/Conv"], nodes["/fc1/Gemm"]
    inputs = _layer_inputs(run, digits / "ada.yaml", [conv2.input[0], fc1.input[0]])
    entry = json.loads((run / "report.json").read_text())["algorithms"]["adaround"]["nodes"]
    for node, call in (
        (conv2, lambda x, w: F.conv2d(x, w, padding=1)),
        (fc1, lambda x, w: x @ w.T),
    ):
        scale, zero = _activation(run, node.input[0])
        errors = {}
        for label in ("nearest", "adaround"):
            params = _stored_weights(runs[label] / "model.int8.onnx")[node.input[1]]
            w_hat = torch.from_numpy(_dequantized(params)[2].astype(np.float32))
            w = torch.from_numpy(np.array(floats[node.input[1]]))
            total, count = 0.0, 0
            for feed in inputs:
                x = torch.from_numpy(feed[node.input[0]])
                xq = fake_quantize(x, scale, zero, 0, 255)
                diff = call(x, w).double() - call(xq, w_hat).double()
                total += float((diff**2).sum())
                count += diff.numel()
            errors[label] = total / count
        assert errors["adaround"] < errors["nearest"], (node.name, errors)
        reported = entry[node.name]
        assert errors["nearest"] == pytest.approx(reported["output_mse_nearest"], rel=1e-3)
        assert errors["adaround"] == pytest.approx(reported["output_mse_adaround"], rel=1e-3)


def test_same_recipe_gives_byte_identical_models(runs) -> None:
    first = (runs["adaround"] / "model.int8.onnx").read_bytes()
    assert first == (runs["again"] / "model.int8.onnx").read_bytes()
    assert first != (runs["nearest"] / "model.int8.onnx").read_bytes()


def test_pair_safe_weights_stay_pair_safe_on_avx2(runs) -> None:
    report = json.loads((runs["adaround-avx2"] / "report.json").read_text())
    plan = {n["name"]: n for n in report["nodes"]}
    entry = report["algorithms"]["adaround"]["nodes"]
    formats = {plan[n]["weight"]["format"] for n in entry}
    assert "s8-pairsafe" in formats  # digits has weights that could overflow on AVX2
    model = onnx.load(str(runs["adaround-avx2"] / "model.fp32.onnx"))
    layer = {n.input[1]: n for n in model.graph.node if n.op_type in ("Conv", "Gemm")}
    stored = _stored_weights(runs["adaround-avx2"] / "model.int8.onnx")
    nearest = _stored_weights(runs["nearest-avx2"] / "model.int8.onnx")
    for name, params in stored.items():
        node = layer[name]
        if node.op_type == "Conv":
            slot = WeightSlot(name, 0, "conv")
        else:
            transposed = any(a.name == "transB" and a.i for a in node.attribute)
            slot = WeightSlot(name, 0 if transposed else 1, "k-cols" if transposed else "k-rows")
        assert not can_saturate(params, slot).any(), name
        assert np.array_equal(params.scale, nearest[name].scale), name
    for node, layer_entry in entry.items():
        assert isinstance(layer_entry["pair_limit_lowered"], int), node
    # Some learned roundings did break a pair and were lowered again: the rule is exercised.
    assert sum(n["pair_limit_lowered"] for n in entry.values()) > 0
    assert any(stored[name].values.tobytes() != nearest[name].values.tobytes() for name in stored)


def test_adaround_then_bias_correction(digits, cli, tmp_path, runs) -> None:
    both = "    bias_correction: {samples: 128}\n" + ADAROUND
    recipe = _recipe(digits, "both.yaml", both)
    assert load_recipe(recipe).algorithms.names()[0] == "adaround"
    result = cli("quantize", recipe, "-o", tmp_path, "--no-progress")
    assert result.exit_code == 0, result.output
    algorithms = json.loads((tmp_path / "report.json").read_text())["algorithms"]
    assert set(algorithms) == {"adaround", "bias_correction"}
    # Bias correction changes biases only: the weights are AdaRound's.
    with_bc = _stored_weights(tmp_path / "model.int8.onnx")
    alone = _stored_weights(runs["adaround"] / "model.int8.onnx")
    assert all(np.array_equal(with_bc[n].values, alone[n].values) for n in alone)


@pytest.mark.parametrize("policy,fmt", [("reduce-range", "s7"), ("uint8-weights", "u8")])
def test_seven_bit_and_uint8_formats(digits, cli, tmp_path, policy, fmt) -> None:
    extra = f"  cpu: avx2\n  saturation: {policy}\n"
    recipe = _recipe(digits, f"{policy}.yaml", ADAROUND, extra)
    result = cli("quantize", recipe, "-o", tmp_path, "--no-progress")
    assert result.exit_code == 0, result.output
    entry = json.loads((tmp_path / "report.json").read_text())["algorithms"]["adaround"]
    formats = {n["weight"]: n["format"] for n in entry["nodes"].values()}
    assert fmt in formats.values()
    floats = _float_weights(tmp_path / "model.fp32.onnx")
    stored = _stored_weights(tmp_path / "model.int8.onnx")
    for name, weight_format in formats.items():
        signed, scale, _ = _dequantized(stored[name])
        assert np.all(np.abs(signed - floats[name] / scale) < 1.0), name
        if weight_format == "s7":
            assert np.abs(signed).max() <= 63, name
        if weight_format == "u8":
            assert stored[name].values.dtype == np.uint8, name
            assert np.all(stored[name].zero_point == 128) and signed.min() >= -127, name
    assert any(n["kept"] == "adaround" for n in entry["nodes"].values() if n["format"] == fmt)


# ---------------------------------------------------------------- refusals and validation


def test_four_bit_weights_are_refused_naming_the_node(digits, cli, tmp_path) -> None:
    recipe = _recipe(digits, "int4.yaml", ADAROUND, base="recipe-int4.yaml")
    result = cli("quantize", recipe, "-o", tmp_path, "--no-progress")
    assert result.exit_code == 2
    message = result.output.strip()
    assert "quantization.algorithms.adaround: node '/" in message
    assert "4-bit" in message and len(message.splitlines()) == 1
    assert not (tmp_path / "model.int4.onnx").exists()


@pytest.mark.parametrize(
    "params,match",
    [
        ("{iterations: 0}", r"quantization.algorithms.adaround.iterations: must be >= 1"),
        ("{iterations: 1000001}", r"adaround.iterations: must be <= 100000"),
        ("{samples: -3}", r"quantization.algorithms.adaround.samples: must be >= 1"),
        ("{samples: many}", r"adaround.samples: must be an integer"),
        ("{iterations: 1.5}", r"adaround.iterations: must be an integer"),
        ("{lr: 0.1}", r"quantization.algorithms.adaround"),
    ],
)
def test_bad_parameters_are_one_line_recipe_errors(digits, cli, params, match) -> None:
    recipe = _recipe(digits, "bad.yaml", f"    adaround: {params}\n")
    with pytest.raises(RecipeError, match=match):
        load_recipe(recipe)
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1


def test_defaults_and_order() -> None:
    from qtool.algorithms.spec import ALGORITHM_ORDER, ALGORITHM_PARAMS, AdaRoundParams

    assert ALGORITHM_PARAMS["adaround"]() == AdaRoundParams(samples=256, iterations=1000)
    assert ALGORITHM_ORDER.index("adaround") < ALGORITHM_ORDER.index("bias_correction")
