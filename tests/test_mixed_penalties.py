"""Continuous penalties for max_drop budgets: the flip model, and a head that the analysis subset
cannot see is sensitive.

The model is a body MatMul and a 4-class head MatMul. Inputs are built so that the float logits
are chosen exactly (x = logits M^+ plus a part M maps to zero, M = W1 W2): the first 64
evaluation samples, the analysis subset, have wide top-1 margins, and the other 64 have narrow
ones. The head at int4 moves the margins by about its own width: it changes none of the analysis
subset's predictions (a measured drop of exactly 0, which the old knapsack took as free) but
many of the evaluation set's. The body's weights lie on the int4 grid, so its int4 form is
nearly exact.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.app.analyze import analyze
from qtool.config.recipe import load_recipe
from qtool.errors import DataError
from qtool.search.budget import Budget
from qtool.search.flips import FlipModel, poisson_cdf, poisson_median_mean
from qtool.search.knapsack import Choice, solve
from qtool.search.penalties import PenaltyScale, penalty_scale

K, H, C = 32, 64, 4
BODY, HEAD = "/body/MatMul", "/head/MatMul"
WIDE, NARROW = 0.3, 0.1  # top-1 margins as a fraction of the top logit (10)
SUBSET = 64


def _weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    body = rng.integers(-7, 8, size=(K, H)).astype(np.float32)
    body[0, :] = 7.0  # each column's int4 scale is exactly 0.05: the grid holds every value
    head = rng.standard_normal((H, C)).astype(np.float32)
    return body * np.float32(0.05), head


def _inputs(body: np.ndarray, head: np.ndarray, margins: np.ndarray, seed: int) -> np.ndarray:
    """Inputs whose float logits have top score 10 and runner-up 10 (1 - margin)."""
    rng = np.random.default_rng(seed)
    m = body.astype(np.float64) @ head.astype(np.float64)
    pinv = np.linalg.pinv(m)
    n = len(margins)
    logits = rng.uniform(-10.0, 0.0, size=(n, C))
    top = rng.integers(0, C, size=n)
    runner = (top + 1 + rng.integers(0, C - 1, size=n)) % C
    logits[np.arange(n), top] = 10.0
    logits[np.arange(n), runner] = 10.0 * (1.0 - margins)
    null = rng.standard_normal((n, K)) @ (np.eye(K) - m @ pinv)
    return (logits @ pinv + null).astype(np.float32)


def _model(body: np.ndarray, head: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name=BODY),
            helper.make_node("MatMul", ["h", "w2"], ["y"], name=HEAD),
        ],
        "body_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", C])],
        [numpy_helper.from_array(body, "w1"), numpy_helper.from_array(head, "w2")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("penalties")
    body, head = _weights()
    onnx.save(_model(body, head), root / "model.onnx")
    np.savez(root / "calib.npz", x=_inputs(body, head, np.full(256, WIDE), 1))
    margins = np.concatenate([np.full(SUBSET, WIDE), np.full(64, NARROW)])
    np.savez(root / "eval.npz", x=_inputs(body, head, margins, 2))
    return root


def _recipe(folder: Path, name: str, max_drop: float) -> Path:
    raw = {
        "model": {"onnx": "model.onnx", "opset": 21},
        "inputs": {"x": [1, K]},
        "calibration": {"data": {"npz": "calib.npz"}, "batch_size": 64, "method": "minmax"},
        "quantization": {"op_types": ["MatMul"]},
        "evaluation": {"data": {"npz": "eval.npz"}, "batch_size": 64},
        "mixed_precision": {
            "samples": SUBSET,
            "budget": {"metric": "agreement", "max_drop": max_drop},
        },
        "output": {"dir": f"out-{name}"},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _run(folder: Path, name: str, max_drop: float, cli) -> tuple[dict, str]:
    result = cli("quantize", _recipe(folder, name, max_drop), "--no-progress")
    assert result.exit_code == 0, result.output
    block = json.loads((folder / f"out-{name}" / "report.json").read_text())["mixed_precision"]
    return block, " ".join(result.output.split())


@pytest.fixture(scope="module")
def tight(folder, cli) -> tuple[dict, str]:
    return _run(folder, "tight", 1.0, cli)


def test_the_head_at_int4_changes_no_prediction_of_the_subset_but_moves_its_margins(folder, tight):
    recipe = load_recipe(folder / "tight.yaml", folder / "out-tight")
    result = analyze(recipe, modes=("one-at-a-time",), samples=SUBSET, progress=False)
    assert result.metric.name == "agreement"
    assert result.penalty(HEAD, "int4") == 0.0  # a step metric sees nothing
    assert result.margin_noise(HEAD, "int4") > 10 * result.margin_noise(HEAD, "int8") > 0
    assert result.margin_noise(HEAD, "int4") > 10 * result.margin_noise(BODY, "int4")


def test_tight_budget_keeps_the_head_above_int4_where_step_penalties_did_not(tight):
    block, _ = tight
    nodes = {n["name"]: n for n in block["nodes"]}
    # The old knapsack: the analysis' step penalties (all 0) against the budget: everything
    # int4, which is the all-int4 reference, and the evaluation set shows it misses.
    old = {
        name: [Choice(p, c["bytes"], c["penalty"]) for p, c in node["choices"].items()]
        for name, node in nodes.items()
    }
    old_plan = {n: c.precision for n, c in solve(old, block["budget"]["limit"]).items()}
    assert old_plan == {BODY: "int4", HEAD: "int4"}
    assert not block["references"]["int4"]["passed"]
    # The new one: the head's margin noise at int4 predicts far more than the budget.
    head = nodes[HEAD]["choices"]["int4"]
    assert head["penalty"] == 0.0 and head["predicted_drop"] > 5 * block["budget"]["limit"]
    first = block["iterations"][0]
    assert first["action"] == "knapsack plan" and first["passed"]
    assert nodes[HEAD]["precision"] in ("int8", "float") and nodes[BODY]["precision"] == "int4"
    assert block["chosen_iteration"] == 1 and block["chosen_reference"] is None
    # The prediction is in the budget's unit and within it.
    assert 0.0 <= first["predicted"]["penalty"] <= block["budget"]["limit"]
    assert block["penalties"]["unit"] == "top-1 margin noise"


def test_a_zero_budget_takes_what_likely_changes_no_prediction(folder, tight, cli):
    """max_drop 0 admits no changed prediction; the knapsack's capacity is the noise at which
    that is still more likely than not (an expected ln 2 changes), not zero noise (all float)."""
    block, output = _run(folder, "zero", 0.0, cli)
    assert block["penalties"]["admitted_changes"] == 0
    first = block["iterations"][0]
    assert first["action"] == "knapsack plan" and first["passed"]
    assert first["predicted"]["pass_probability"] >= 0.5
    assert first["counts"] != {"float": 2}
    nodes = {n["name"]: n["precision"] for n in block["nodes"]}
    assert nodes[HEAD] != "int4"
    assert "passing with p" in output


def test_flip_model_inverts_its_expected_drop_and_counts_only_what_the_metric_counts():
    rng = np.random.default_rng(0)
    logits = [rng.normal(size=(50, 5)) * 3 for _ in range(2)]
    agreement = FlipModel.from_outputs(logits, None)
    assert agreement.predictions == agreement.counted == 100
    for drop in (0.01, 0.5, 3.0, 20.0):
        noise = agreement.noise_for(drop)
        assert agreement.expected_drop(noise) == pytest.approx(drop, rel=1e-6)
        assert agreement.expected_drop(noise * 1.01) > drop
    assert agreement.noise_for(0.0) == 0.0
    assert agreement.noise_for(50.0) == math.inf  # a coin toss on every prediction costs 50
    noises = [1e-4, 1e-2, 1.0, 100.0]
    drops = [agreement.expected_drop(n) for n in noises]
    assert drops == sorted(drops) and drops[0] > 0
    # Accuracy: only predictions float gets right can be lost.
    labels = [np.argmax(batch, axis=-1) for batch in logits]
    labels[0][:10] = (labels[0][:10] + 1) % 5
    accuracy = FlipModel.from_outputs(logits, labels)
    assert accuracy.counted == 90 and accuracy.predictions == 100
    assert accuracy.expected_drop(1.0) < agreement.expected_drop(1.0)
    # The gate: k whole changes admitted; capacity where P(Poisson(lambda) <= k) is one half.
    assert poisson_median_mean(0) == pytest.approx(math.log(2.0))
    assert poisson_cdf(1, poisson_median_mean(1)) == pytest.approx(0.5)
    assert 2.0 < poisson_median_mean(2) < 3.0
    assert agreement.admitted(2.0) == 2 and agreement.admitted(1.99) == 1
    for limit in (0.0, 1.0, 2.5):
        noise = agreement.capacity(limit)
        assert agreement.pass_probability(noise, limit) == pytest.approx(0.5, abs=1e-6)
        assert agreement.pass_probability(noise * 1.01, limit) < 0.5
    with pytest.raises(DataError, match="class axis of 2 or more"):
        FlipModel.from_outputs([np.ones((3, 1))], None)
    # The Gaussian model against a brute-force count of changed predictions.
    flat = np.concatenate(logits)
    sigma = 0.7
    trials = rng.normal(size=(2000, 100)) * sigma
    margins = np.sort(flat, axis=1)[:, -1] - np.sort(flat, axis=1)[:, -2]
    empirical = 100.0 * float(np.mean(trials < -margins))
    assert agreement.expected_drop(sigma**2) == pytest.approx(empirical, abs=0.3)


class _Measured:
    """What PenaltyScale.penalty reads of a SensitivityResult: step penalty and margin noise."""

    def __init__(self, table: dict[tuple[str, str], tuple[float, float]]) -> None:
        self.table = table

    def penalty(self, node, precision):
        return 0.0 if precision == "float" else self.table[(node, precision)][0]

    def margin_noise(self, node, precision):
        return 0.0 if precision == "float" else self.table[(node, precision)][1]


def test_a_drop_seen_on_the_subset_is_never_discounted_and_nan_never_fits():
    rng = np.random.default_rng(1)
    flips = FlipModel.from_outputs([rng.normal(size=(200, 10)) * 3], None)
    scale = penalty_scale_for(flips, limit=1.0)
    analysis = _Measured(
        {
            ("quiet", "int4"): (0.0, 1e-3),  # changed nothing: its noise counts
            ("seen", "int4"): (2.0, 1e-3),  # changed 2 points' worth: at least that noise
            ("broken", "int4"): (math.nan, math.nan),
        }
    )
    assert scale.penalty(analysis, "quiet", "int4") == 1e-3
    seen = scale.penalty(analysis, "seen", "int4")
    assert seen == pytest.approx(flips.noise_for(2.0)) and seen > 1e-3
    assert flips.expected_drop(seen) == pytest.approx(2.0, rel=1e-6)
    assert scale.penalty(analysis, "broken", "int4") == math.inf
    assert scale.penalty(analysis, "quiet", "float") == 0.0
    # The capacity is where the gate passes half the time, and the sum is reported in points.
    assert scale.pass_probability(scale.capacity) == pytest.approx(0.5, abs=1e-6)
    assert scale.predicted(seen) == pytest.approx(2.0, rel=1e-6)
    additive = PenaltyScale("cosine penalty (additive)", 0.01)
    assert additive.penalty(analysis, "seen", "int4") == 2.0
    assert additive.predicted(0.004) == 0.004 and additive.pass_probability(0.004) is None


def penalty_scale_for(flips: FlipModel, limit: float) -> PenaltyScale:
    return PenaltyScale("top-1 margin noise", flips.capacity(limit), flips, limit)


def test_a_perplexity_budget_adds_its_rises_where_a_step_metric_counts_flips():
    """Perplexity moves continuously: its max_drop budget adds each node's measured rise (in
    percent) like cosine's, where its NaN margin noise (no class axis to flip) had made every
    quantized choice infinite and the knapsack kept the whole model float."""
    logits = [np.random.default_rng(2).normal(size=(64, 10))]
    perplexity = penalty_scale(Budget("perplexity", "max_drop", 3.0, "test"), logits, None)
    assert perplexity.flips is None and perplexity.capacity == 3.0
    analysis = _Measured({("down", "int4"): (1.25, math.nan), ("up", "int8"): (-0.01, math.nan)})
    assert perplexity.penalty(analysis, "down", "int4") == 1.25
    # an improvement on the analysis rows reaches the knapsack as is; the knapsack counts it as 0
    assert perplexity.penalty(analysis, "up", "int8") == -0.01
    chosen = solve({"up": [Choice("float", 2.0, 0.0), Choice("int8", 1.0, -0.01)]}, 0.0)
    assert chosen is not None and chosen["up"].precision == "int8"
    agreement = penalty_scale(Budget("agreement", "max_drop", 3.0, "test"), logits, None)
    assert agreement.flips is not None
