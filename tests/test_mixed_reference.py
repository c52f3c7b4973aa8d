"""Never a plan larger than a passing uniform reference.

The model is built so that one-at-a-time penalties overstate what a uniform plan costs: two
MatMul branches read the same input with weights W and -W, and a third, float branch (a Gemm,
not in `op_types`) carries the signal; the output is their sum. Quantized alike, the branches
share one input QuantizeLinear and int8 rounds -W to exactly minus W's integers, so their errors
cancel to nothing; quantized alone, each adds its error to the output. The knapsack adds the two
one-at-a-time penalties, so with a budget between one and two of them it keeps one branch float
and verifies that plan (it passes); the all-int8 model, measured for comparison, passes too and
is smaller, so it is what the search must choose. The twin model of test_auto_mixed.py gives the
other case: no plan passes within max_iterations, and a passing reference is chosen over a
failure.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console

from qtool.app.analyze import analyze
from qtool.config.recipe import load_recipe
from qtool.search.budget import Budget
from qtool.search.knapsack import Choice
from qtool.search.mixed_report import summary_table
from qtool.search.penalties import PenaltyScale
from qtool.search.promote import Measured, measure_iteration, verify_and_promote
from qtool.search.reference import Reference, ceiling, prefer_reference

NODES = ("/plus/MatMul", "/minus/MatMul")


def _mirror_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 32)).astype(np.float32)
    signal = (rng.standard_normal((64, 32)) * 0.5).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["a"], name=NODES[0]),
            helper.make_node("MatMul", ["x", "w_neg"], ["b"], name=NODES[1]),
            helper.make_node("Gemm", ["x", "v"], ["c"], name="/signal/Gemm"),
            helper.make_node("Add", ["a", "b"], ["ab"], name="/cancel/Add"),
            helper.make_node("Add", ["ab", "c"], ["y"], name="/sum/Add"),
        ],
        "mirror",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32])],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(-weight, "w_neg"),
            numpy_helper.from_array(signal, "v"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("mirror")
    onnx.save(_mirror_model(), root / "model.onnx")
    pixels = (load_digits().data / 16.0).astype(np.float32)
    np.savez(root / "calib.npz", x=pixels[:256])
    np.savez(root / "eval.npz", x=pixels[256:512])
    return root


def _recipe(folder: Path, name: str, mixed: dict | None, **evaluation) -> Path:
    raw = {
        "model": {"onnx": "model.onnx", "opset": 21},
        "inputs": {"x": [1, 64]},
        "calibration": {"data": {"npz": "calib.npz"}, "batch_size": 64, "method": "minmax"},
        "quantization": {"op_types": ["MatMul"]},
        "evaluation": {"data": {"npz": "eval.npz"}, "batch_size": 64, **evaluation},
        "output": {"dir": f"out-{name}"},
    }
    if mixed is not None:
        raw["mixed_precision"] = mixed
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def single(folder) -> float:
    """1 - cosine of the output with one branch alone at int8 (both branches measure alike)."""
    recipe = load_recipe(_recipe(folder, "probe", None, min_cosine=0.5))
    result = analyze(
        recipe, modes=("one-at-a-time",), candidates=("int8",), samples=256, progress=False
    )
    penalties = [result.penalty(node, "int8") for node in NODES]
    assert penalties[0] == pytest.approx(penalties[1], rel=0.05) and penalties[0] > 0
    return max(penalties)


def test_a_passing_reference_smaller_than_the_verified_plan_is_chosen(folder, single, cli):
    mixed = {"budget": {"min_cosine": 1.0 - 1.5 * single}, "samples": 256}
    result = cli("quantize", _recipe(folder, "mirror", mixed), "--no-progress")
    assert result.exit_code == 0, result.output
    out = folder / "out-mirror"
    block = json.loads((out / "report.json").read_text())["mixed_precision"]
    first, last = block["iterations"][0], block["iterations"][-1]
    # The knapsack: both branches at int8 would add up to 2x the budget's 1.5x: one stays above.
    assert first["action"] == "knapsack plan" and first["passed"]
    assert first["counts"].get("float", 0) + first["counts"].get("int4", 0) >= 1
    assert first["predicted"]["penalty"] <= 1.5 * single
    int8 = block["references"]["int8"]
    assert int8["passed"] and int8["metric"] > 1.0 - 0.1 * single  # the errors cancel
    assert int8["size_bytes"] < first["measured"]["size_bytes"]
    # The smallest passing reference is verified as a plan and chosen.
    passing = {p: r for p, r in block["references"].items() if r.get("passed")}
    smallest = min(passing, key=lambda p: passing[p]["size_bytes"])
    assert block["chosen_reference"] == smallest and block["passed"]
    assert last["action"] == (
        f"all-{smallest} reference: meets the budget and is smaller than plan 1 "
        f"({first['measured']['size_bytes']} bytes)"
    )
    assert last["passed"] and block["chosen_iteration"] == last["iteration"]
    assert block["measured"]["size_bytes"] == passing[smallest]["size_bytes"]
    written = Path(block["files"]["model"])
    assert written.stat().st_size == block["measured"]["size_bytes"]
    note = f"chose the all-{smallest} reference ({passing[smallest]['size_bytes']} bytes)"
    assert any(n.startswith(note) for n in block["notes"])
    assert f"note: {note}" in " ".join(result.output.split())
    wide = Console(width=200, record=True)
    wide.print(summary_table(block))
    assert f"chosen (plan {last['iteration']}: all {smallest})" in wide.export_text()


def _fake_measure(sizes: dict[str, int], passing: set[str]):
    def measure(plan):
        key = ",".join(f"{n}={p}" for n, p in sorted(plan.items()))
        value = 100.0 if key in passing else 90.0
        return Measured(value, 100.0 - value, 30.0, 0.999, sizes[key])

    return measure


class _FakeAnalysis:
    """What next_promotion reads of a SensitivityResult: a ranking and no measured noise."""

    def ranking(self):
        return [type("Node", (), {"name": n})() for n in ("a", "b")]

    def node(self, name):
        return type("Node", (), {"one_at_a_time": {}})()


def test_promotion_stops_at_a_passing_reference_and_the_reference_is_taken():
    """A plan that misses at the size of a passing reference: promoting only adds bytes, so the
    loop stops there, and the reference is measured and chosen."""
    options = {
        n: [Choice("float", 400, 0.0), Choice("int8", 100, 0.1), Choice("int4", 50, 0.2)]
        for n in ("a", "b")
    }
    sizes = {"a=float,b=int4": 480, "a=int8,b=int8": 220}
    measure = _fake_measure(sizes, {"a=int8,b=int8"})
    budget = Budget("agreement", "max_drop", 1.0, "test")
    scale = PenaltyScale("points", 1.0)
    reference = Reference("int8", {"a": "int8", "b": "int8"}, 220, 220, 100.0, True)
    assert ceiling([reference], options) is reference
    assert ceiling([Reference("int4", {"a": "int2"}, 9, 9, 100.0, True)], {"a": []}) is None

    def verify(start, cap):
        return verify_and_promote(
            start, options, _FakeAnalysis(), budget, scale, 100.0, 800.0, measure, 8,
            "knapsack plan", ceiling=cap,
        )  # fmt: skip

    def again(index, action, plan):
        return measure_iteration(
            index, action, plan, options, options, scale, budget, 100.0, 800.0, measure
        )

    result = verify({"a": "float", "b": "int4"}, (reference.size, reference.label))
    assert len(result.iterations) == 1 and not result.passed
    assert "no smaller than the all-int8 reference (220 bytes)" in result.reason
    note = prefer_reference(result, reference, again, lambda it: None)
    assert result.passed and result.reference == "int8" and result.chosen.index == 2
    assert result.chosen.precisions == {"a": "int8", "b": "int8"}
    assert note == (
        "chose the all-int8 reference (220 bytes): it meets the budget and no plan verified did"
    )
    # A passing plan no larger than the reference keeps its place.
    kept = verify({"a": "int8", "b": "int8"}, (220, "all-int8"))
    assert prefer_reference(kept, reference, again, lambda it: None) is None
    assert kept.chosen.index == 1 and kept.reference is None and len(kept.iterations) == 1
