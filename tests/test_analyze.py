"""`qtool analyze` on the digits example (a real trained CNN exported by qtool, real held-out
images): the three modes, the metric, the cache, plan.yaml and the CLI's bad-input errors.

The example's recipe runs at opset 21 here (`model: {opset: 21}`) so that int4 is a candidate
for its three Convs and two Gemms; analyses use a subset of the evaluation images to stay fast.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import onnx
import pytest
import yaml

from qtool.app import settings
from qtool.app.analyze import analysis_batches, analyze
from qtool.app.common import prepare
from qtool.calibration.stats_file import load_stats
from qtool.config.recipe import load_recipe
from qtool.data.spec import DataSpec
from qtool.errors import DataError
from qtool.metrics.evaluate import evaluate_models
from qtool.metrics.spec import EvaluationSpec
from qtool.plan.node_settings import _matches
from qtool.plan.settings import exact_pattern
from qtool.search.plan_file import plan_overrides
from qtool.search.scoring import choose_metric
from qtool.search.variants import Assembler

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NODES = ["/conv1/Conv", "/conv2/Conv", "/conv3/Conv", "/fc1/Gemm", "/fc2/Gemm"]
SAMPLES = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("analyze") / "digits"
    shutil.copytree(EXAMPLES / "digits", dest, ignore=shutil.ignore_patterns("out*", "__py*"))
    (dest / "recipe21.yaml").write_text("base: recipe.yaml\nmodel: {opset: 21}\n")
    return dest


@pytest.fixture(scope="module")
def first_run(folder, cli):
    """The CLI once, every mode, calibrating first (no stats file yet)."""
    result = cli(
        "analyze",
        folder / "recipe21.yaml",
        "--samples",
        SAMPLES,
        "--no-progress",
        "-o",
        folder / "out",
    )
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def recipe21(folder, first_run):
    recipe = load_recipe(folder / "recipe21.yaml", folder / "out")
    return recipe, prepare(recipe)


def _report(folder: Path) -> dict:
    return json.loads((folder / "out" / "sensitivity.json").read_text())


def test_cli_measures_every_node_at_every_candidate_and_says_which_metric(folder, first_run):
    text = " ".join(first_run.output.split())
    assert "metric: accuracy of output 'output' (the evaluation data has labels)" in text
    assert "Sensitivity of 5 nodes" in text and "Layer by layer" in text
    assert "s per node" in text
    report = _report(folder)
    assert report["metric"]["name"] == "accuracy" and report["samples"] == SAMPLES
    assert report["candidates"] == ["int8", "int4"]
    assert sorted(n["name"] for n in report["nodes"]) == sorted(NODES)
    assert report["ranking"] == [n["name"] for n in report["nodes"]]
    for node in report["nodes"]:
        for candidate in ("int8", "int4"):
            measured = node["one_at_a_time"][candidate]
            assert measured["seconds"] > 0
            assert measured["delta_vs_float"] == pytest.approx(
                measured["metric"] - report["float"]["metric"]
            )
            assert measured["penalty"] == pytest.approx(-measured["delta_vs_float"])
        assert node["all_but_one"]["delta_vs_full"] == pytest.approx(
            node["all_but_one"]["metric"] - report["full_plan"]["metric"]
        )
        assert math.isfinite(node["layer"]["sqnr_out_db"])
    assert report["cost"]["variants"] == 1 + 5 * 2 + 5
    assert report["cost"]["seconds_per_node"] > 0
    assert (folder / "out" / "stats.npz").is_file()  # calibrated first, where calibrate writes


def test_int4_alone_is_noisier_than_int8_alone(folder, first_run):
    """4-bit weights carry 16x the rounding step of 8-bit ones: on every node the output with
    that node alone at int4 is further from float than with it alone at int8."""
    for node in _report(folder)["nodes"]:
        alone = node["one_at_a_time"]
        assert alone["int4"]["sqnr_db"] < alone["int8"]["sqnr_db"] - 6.0, node["name"]


def test_ranking_is_deterministic(recipe21):
    recipe, prepared = recipe21
    runs = [
        analyze(
            recipe,
            modes=("one-at-a-time",),
            samples=SAMPLES,
            progress=False,
            use_cache=False,
            prepared=prepared,
        )
        for _ in range(2)
    ]
    assert [n.name for n in runs[0].ranking()] == [n.name for n in runs[1].ranking()]
    for a, b in zip(runs[0].nodes, runs[1].nodes, strict=True):
        for candidate in ("int8", "int4"):
            assert a.one_at_a_time[candidate].value == b.one_at_a_time[candidate].value
            assert a.one_at_a_time[candidate].sqnr_db == b.one_at_a_time[candidate].sqnr_db
    assert not runs[0].cached and not runs[1].cached


def test_layer_sqnr_of_the_last_node_is_the_model_output_sqnr(recipe21, tmp_path):
    recipe, prepared = recipe21
    result = analyze(recipe, modes=("layer",), samples=SAMPLES, progress=False, prepared=prepared)
    layers = [n.layer for n in result.nodes]
    assert [layer.node for layer in layers] == NODES  # graph order
    for layer in layers:
        assert math.isfinite(layer.sqnr_out_db) and math.isfinite(layer.sqnr_in_db)
    assert layers[0].input == "image"  # the first conv reads the quantized image
    assert layers[-1].output == "output"  # the last Gemm writes the model output

    # The full plan written out and compared by `qtool evaluate`'s own code, same samples.
    stats, _ = load_stats(recipe.output_dir / "stats.npz")
    assembler = Assembler(settings.build_settings(recipe), prepared.model.model, stats)
    (tmp_path / "fp32.onnx").write_bytes(prepared.model.serialized)
    onnx.save(assembler.build(assembler.layout()), tmp_path / "q.onnx")
    batches = analysis_batches(recipe, SAMPLES)
    evaluated = evaluate_models(
        tmp_path / "fp32.onnx",
        tmp_path / "q.onnx",
        ((b.inputs, b.labels) for b in batches),
        latency_runs=1,
        progress=False,
    )
    # evaluate runs the float model optimized, the layer run unfused: float rounding apart.
    expected = evaluated.outputs[0].unfused.sqnr_db
    assert layers[-1].sqnr_out_db == pytest.approx(expected, rel=1e-6)


def test_cache_hit_on_rerun_measures_nothing(folder, first_run, cli):
    before = (folder / "out" / "sensitivity.json").read_bytes()
    result = cli(
        "analyze",
        folder / "recipe21.yaml",
        "--samples",
        SAMPLES,
        "--no-progress",
        "-o",
        folder / "out",
    )
    assert result.exit_code == 0, result.output
    assert "read every number from the cache" in " ".join(result.output.split())
    assert (folder / "out" / "sensitivity.json").read_bytes() == before


def test_cache_invalidates_when_the_stats_change(recipe21, tmp_path):
    recipe, prepared = recipe21
    other = load_recipe(
        # Beside the recipe: a recipe's paths are read from its own folder.
        _write(
            recipe.path.parent / "fewer.yaml",
            "base: recipe21.yaml\ncalibration: {max_samples: 64}\n",
        ),
        tmp_path / "fewer",
    )
    from qtool.app.calibrate import calibrate

    calibrate(other, prepare(other), progress=False)
    measured = []
    result = analyze(
        recipe,
        stats_path=other.stats_path,
        modes=("one-at-a-time",),
        candidates=("int8",),
        samples=SAMPLES,
        progress=False,
        prepared=prepared,
        cache_dir=recipe.output_dir,
        on_variant=lambda variant, _: measured.append(variant),
    )
    assert not result.cached and len(measured) == 1 + 5
    again = analyze(
        recipe,
        modes=("one-at-a-time",),
        candidates=("int8",),
        samples=SAMPLES,
        progress=False,
        prepared=prepared,
        on_variant=lambda variant, _: measured.append(variant),
    )
    assert again.cached and len(measured) == 1 + 5  # the recipe's own stats: all cached
    assert again.key != result.key


def test_cache_invalidates_when_the_model_changes(folder, recipe21, tmp_path):
    import torch

    recipe, _ = recipe21
    changed = tmp_path / "digits"
    shutil.copytree(folder, changed, ignore=shutil.ignore_patterns("out*", "__py*"))
    weights = torch.load(changed / "weights.pt", weights_only=True)
    weights["fc2.weight"] = weights["fc2.weight"] * 1.01
    torch.save(weights, changed / "weights.pt")
    other = load_recipe(changed / "recipe21.yaml")
    measured = []
    result = analyze(
        other,
        modes=("one-at-a-time",),
        candidates=("int8",),
        samples=SAMPLES,
        progress=False,
        cache_dir=recipe.output_dir,  # the first run's cache: nothing in it may be reused
        on_variant=lambda variant, _: measured.append(variant),
    )
    assert not result.cached and len(measured) == 1 + 5


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


MIXED = (
    "quantization:\n"
    "  overrides:\n"
    "    - {op_types: Gemm, precision: int4}\n"
    "    - {nodes: '/fc2/*', precision: float}\n"
    "    - {nodes: '/conv1/*', weights: {bits: 8}, activations: float}\n"
)


def _plan_rows(recipe) -> list[dict]:
    """Every node's plan without the words that say why (an override's name differs)."""
    rows = []
    for node in prepare(recipe).layout.plan.to_list():
        node.pop("reason"), node.pop("source")
        if "weight" in node:
            node["weight"] = {k: v for k, v in node["weight"].items() if k != "reason"}
        rows.append(node)
    return rows


@pytest.mark.parametrize("base", ["recipe.yaml", "recipe-int4.yaml", "mixed"])
def test_plan_overrides_reproduce_the_plan(folder, base):
    if base == "mixed":
        base = _write(folder / "recipe-mixed.yaml", "base: recipe.yaml\n" + MIXED).name
    recipe = load_recipe(folder / base)
    prepared = prepare(recipe)
    entries = plan_overrides(prepared.model.model, recipe.quantization, prepared.layout.plan)
    assert [e["nodes"] for e in entries] == NODES
    pinned = _write(
        folder / f"pinned-{base}",
        f"base: {base}\n" + yaml.safe_dump({"quantization": {"overrides": entries}}),
    )
    assert _plan_rows(load_recipe(pinned)) == _plan_rows(recipe)
    if base == "recipe-mixed.yaml":
        by_name = {e["nodes"]: e for e in entries}
        assert by_name["/fc1/Gemm"] == {"nodes": "/fc1/Gemm", "precision": "int4"}
        assert by_name["/fc2/Gemm"] == {"nodes": "/fc2/Gemm", "precision": "float"}
        assert by_name["/conv1/Conv"]["activations"] == "float"


def test_plan_yaml_is_a_preset_a_recipe_takes_as_base(folder, first_run):
    """out/plan.yaml as the `base:` of a copy of the recipe (which has no overrides)."""
    text = (folder / "out" / "plan.yaml").read_text()
    entries = yaml.safe_load(text)["quantization"]["overrides"]
    assert entries == [{"nodes": name, "precision": "int8"} for name in NODES]
    own = (folder / "recipe.yaml").read_text()
    pinned = _write(folder / "pinned-by-base.yaml", "base: out/plan.yaml\n" + own)
    recipe = load_recipe(pinned)
    assert len(recipe.quantization.overrides) == 5
    assert _plan_rows(recipe) == _plan_rows(load_recipe(folder / "recipe.yaml"))


def test_exact_pattern_matches_only_its_node():
    names = ["a*b", "axxb", "c[1]", "c1", "plain"]
    for name in names:
        pattern = exact_pattern(name)
        assert [n for n in names if _matches(n, pattern)] == [name]


def test_weight_only_stats_skip_the_int8_variants_and_say_why(folder, cli):
    """recipe-int4.yaml is weight-only: its stats file has no activation ranges, so `int8 alone`
    (int8 activations) cannot be built from it; the int4 and all-but-one variants can."""
    out = folder / "out-int4"
    assert cli("calibrate", folder / "recipe-int4.yaml", "-o", out, "--no-progress").exit_code == 0
    recipe = load_recipe(folder / "recipe-int4.yaml", out)
    result = analyze(
        recipe,
        stats_path=out / "stats.npz",
        modes=("one-at-a-time",),
        samples=SAMPLES,
        progress=False,
        use_cache=False,
    )
    for node in result.nodes:
        assert "no statistics for tensor" in node.one_at_a_time["int8"].skipped
        assert node.one_at_a_time["int4"].skipped is None
        assert result.penalty(node.name, "int8") is None
        assert result.penalty(node.name, "int4") == node.one_at_a_time["int4"].penalty
    assert any("not measured" in note for note in result.notes)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "bogus"], "--mode: 'bogus' is not one of one-at-a-time, all-but-one"),
        (["--candidates", "int2"], "--candidates: 'int2' is not one of int8, int4"),
        (["--candidates", "float"], "float is the reference, not a candidate"),
        (
            ["--metric", "f1"],
            "--metric: must be one of accuracy, agreement, perplexity, cosine, sqnr",
        ),
    ],
)
def test_bad_options_exit_2(folder, cli, args, message):
    result = cli("analyze", folder / "recipe.yaml", *args, "--no-progress", "-o", folder / "x")
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not (folder / "x").exists()


def test_int4_candidate_on_an_opset_17_recipe_exits_2(folder, cli):
    result = cli(
        "analyze",
        folder / "recipe.yaml",
        "--candidates",
        "int4",
        "--no-progress",
        "-o",
        folder / "x17",
    )
    assert result.exit_code == 2
    assert "--candidates int4: 4-bit weights need opset 21" in " ".join(result.output.split())


def test_metric_follows_the_gate_evaluate_judges():
    data = DataSpec("evaluation.data", synthetic=True)
    assert choose_metric(EvaluationSpec(data), True, "y").name == "accuracy"
    assert choose_metric(EvaluationSpec(data), False, "y").name == "agreement"
    cosine = choose_metric(EvaluationSpec(data, min_cosine=0.99), True, "y")
    assert (cosine.name, cosine.source) == ("cosine", "evaluation.min_cosine")
    assert choose_metric(EvaluationSpec(data, min_sqnr=30.0), False, "y").name == "sqnr"
    gated = EvaluationSpec(data, max_drop=1.0, min_cosine=0.99)
    assert choose_metric(gated, True, "y").name == "accuracy"  # max_drop's metric first
    assert choose_metric(EvaluationSpec(data, metric="agreement"), True, "y").name == "agreement"
    assert choose_metric(EvaluationSpec(data), True, "y", "sqnr").source == "--metric"
    with pytest.raises(DataError, match="accuracy needs labels"):
        choose_metric(EvaluationSpec(data, metric="accuracy"), False, "y")


def test_sqnr_penalty_is_the_noise_to_signal_ratio():
    metric = choose_metric(EvaluationSpec(DataSpec("d", synthetic=True)), False, "y", "sqnr")
    assert metric.penalty(20.0, math.inf) == pytest.approx(0.01)
    assert metric.penalty(math.inf, math.inf) == 0.0


def test_plot_png_when_matplotlib_is_installed(recipe21):
    pytest.importorskip("matplotlib")
    from qtool.search.plot import plot_png

    recipe, prepared = recipe21
    result = analyze(recipe, samples=SAMPLES, progress=False, prepared=prepared)
    png = plot_png(result)
    assert png.startswith(b"\x89PNG") and plot_png(result) == png


def test_without_matplotlib_a_note_says_how_to_get_it(folder, first_run, cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    plot = folder / "out" / "no-plot.png"
    result = cli(
        "analyze",
        folder / "recipe21.yaml",
        "--samples",
        SAMPLES,
        "--no-progress",
        "-o",
        folder / "out",
        "--plot",
        plot,
    )
    assert result.exit_code == 0, result.output
    assert "note: no plot: matplotlib is not installed (pip install 'qtool[plot]')" in " ".join(
        result.output.split()
    )
    assert not plot.exists()


def test_algorithms_the_variants_do_not_apply_are_named(folder, recipe21):
    _, prepared = recipe21
    path = _write(
        folder / "recipe-bc.yaml",
        "base: recipe21.yaml\nquantization: {algorithms: [bias_correction]}\n",
    )
    recipe = load_recipe(path, folder / "out")
    result = analyze(recipe, modes=("layer",), samples=SAMPLES, progress=False, prepared=prepared)
    assert any("bias_correction) are not applied" in note for note in result.notes)
