"""Empirical bias correction on the real digits CNN: the shift each layer's quantization adds
is measured on calibration data and absorbed by its bias, for int8 and for 4-bit weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qtool.algorithms.bias_correction import bias_targets, measure_shifts
from qtool.algorithms.spec import AdaRoundParams
from qtool.app import settings
from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bias-correction") / "digits"
    shutil.copytree(EXAMPLES / "digits", folder, ignore=shutil.ignore_patterns("out*", "__py*"))
    return folder


def _recipe(folder: Path, base: str, name: str, cpu: str | None = None) -> Path:
    path = folder / name
    pinned = f"  cpu: {cpu}\n" if cpu else ""
    path.write_text(f"base: {base}\nquantization:\n  algorithms: [bias_correction]\n{pinned}")
    return path


# The weights written depend on the deployment CPU (pair-safe int8 without VNNI, full-range with
# it), and so does the shift bias correction can remove; the error is measured on the unfused QDQ
# semantics, so pinning `quantization.cpu` makes each case the same on every host. Measured on
# digits' tuning rows (rows the shifts were not measured on): avx2 0.0058 -> 0.0041 (pair-safe
# rounding is biased; 0.0057 -> 0.0034 when it was judged on the rows it measured), avx512-vnni
# (conv filters keep their sums in rounding, sum_rounding.py: less shift is left to remove).
@pytest.mark.parametrize(
    ("base", "cpu", "ratio"),
    [
        ("recipe.yaml", "avx2", 0.8),
        ("recipe.yaml", "avx512-vnni", 0.95),
        ("recipe-int4.yaml", None, 0.7),
    ],
)
def test_bias_correction_lowers_the_output_error_and_reports_each_layer(
    digits, cli, tmp_path, base, cpu, ratio
):
    recipe = _recipe(digits, base, f"bc-{cpu}-{base}", cpu)
    plain, corrected = tmp_path / "plain", tmp_path / "corrected"
    assert cli("quantize", digits / base, "-o", plain, "--no-progress").exit_code == 0
    result = cli("quantize", recipe, "-o", corrected, "--no-progress")
    assert result.exit_code == 0, result.output
    entry = json.loads((corrected / "report.json").read_text())["algorithms"]["bias_correction"]
    assert entry["applied"] is True
    assert entry["output_mse_after"] < ratio * entry["output_mse_before"]
    assert sorted(entry["nodes"]) == [
        "/conv1/Conv",
        "/conv2/Conv",
        "/conv3/Conv",
        "/fc1/Gemm",
        "/fc2/Gemm",
    ]
    assert all(n["mean_abs_shift_removed"] > 0 for n in entry["nodes"].values())

    # Measured again on the corrected model, every layer's own shift is (almost) gone.
    loaded = load_recipe(recipe, output_dir=corrected)
    float_model = onnx.load(str(corrected / "model.fp32.onnx"))
    quant_name = "model.int4.onnx" if "int4" in base else "model.int8.onnx"
    quantized = onnx.load(str(corrected / quant_name))
    targets = bias_targets(float_model, entry["nodes"])
    # on the samples the shifts were measured on: the calibration part of the recipe's split
    feeds = list(settings.calibration_data(loaded).first_inputs(256, 64))
    again = measure_shifts(float_model, quantized, targets, feeds)
    for residual in again:
        removed = entry["nodes"][residual.target.node]["mean_abs_shift_removed"]
        assert residual.before < 0.05 * removed + 1e-6, residual.target.node

    # The float model written beside it is the original, not the corrected one.
    before = {
        i.name: numpy_helper.to_array(i)
        for i in onnx.load(str(plain / "model.fp32.onnx")).graph.initializer
    }
    after = {i.name: numpy_helper.to_array(i) for i in float_model.graph.initializer}
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_unknown_algorithms_and_bad_values_are_recipe_errors(digits):
    bad = digits / "bad-algo.yaml"
    bad.write_text("base: recipe.yaml\nquantization:\n  algorithms: [bias_corection]\n")
    with pytest.raises(RecipeError, match=r"quantization.algorithms.bias_corection: unknown"):
        load_recipe(bad)
    bad.write_text("base: recipe.yaml\nquantization:\n  algorithms: [adaround]\n")
    assert load_recipe(bad).algorithms.adaround == AdaRoundParams(samples=256, iterations=1000)
    bad.write_text(
        "base: recipe.yaml\nquantization:\n  algorithms: {bias_correction: {samples: 0}}\n"
    )
    with pytest.raises(RecipeError, match=r"bias_correction.samples: must be >= 1"):
        load_recipe(bad)
