"""Held-out discipline: the calibration/tuning split, the `tuning:` recipe keys, and the
model-level rule that keeps plain min-max where the recipe's model is not better on the tuning
rows (qtool/data/split.py, qtool/pipeline/tuning.py, qtool/pipeline/keep.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.app import settings
from qtool.app.quantize import quantize
from qtool.config.fingerprint import recipe_sha256
from qtool.config.recipe import load_recipe
from qtool.data.source import BatchSource
from qtool.data.spec import DataSpec, InputSpec
from qtool.data.split import SampleSplit
from qtool.errors import RecipeError
from qtool.pipeline.keep import MINMAX, RECIPE, Scores, choose

VEC = (InputSpec("x", (1, 3)),)


def _source(tmp_path: Path, samples: int = 60) -> DataSpec:
    """A python source yielding sample i as x = [i, -i, 2i], label i, in uneven chunks."""
    path = tmp_path / "source.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import numpy as np

            def batches():
                start = 0
                for size in (7, {samples - 10}, 3):
                    ids = np.arange(start, start + size)
                    yield {{"x": np.stack([ids, -ids, 2 * ids], 1).astype(np.float32)}}, ids
                    start += size
            """
        )
    )
    return DataSpec("calibration.data", python=f"{path}:batches")


def _ids(source: BatchSource, batch_size: int | None = None, limit: int | None = None):
    return np.concatenate([b.labels for b in source.batches(batch_size, limit)]).tolist()


@pytest.mark.parametrize("batch_size", [1, 5, 16, 64])
def test_split_is_disjoint_complete_and_independent_of_batching(tmp_path, batch_size):
    spec = _source(tmp_path)
    split = SampleSplit(every=4, limit=10, part="calibration")
    calibration = BatchSource(spec, VEC, batch_size, split=split)
    tuning = BatchSource(spec, VEC, batch_size, split=split.other())
    cal, tune = _ids(calibration), _ids(tuning)
    assert tune == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]  # every 4th, the first 10 of them
    assert not set(cal) & set(tune)
    assert sorted(cal + tune) == list(range(60))  # past the 10th tuning row, all calibrate
    assert cal == sorted(cal)
    assert calibration.samples_hint() is None or calibration.samples_hint() == len(cal)
    # the same rows whatever the batch size, and `limit` counts samples of the part
    assert _ids(calibration, 7) == cal and _ids(calibration, 3, limit=5) == cal[:5]


def test_split_applies_to_the_first_max_samples_of_the_source(tmp_path):
    spec = _source(tmp_path)
    split = SampleSplit(every=3, limit=100, part="tuning")
    tuning = BatchSource(spec, VEC, 8, max_samples=20, split=split)
    assert _ids(tuning) == [2, 5, 8, 11, 14, 17]
    assert split.count(20) == 6 and split.other().count(20) == 14


@pytest.mark.parametrize(
    ("every", "limit", "part"), [(1, 5, "tuning"), (4, 0, "tuning"), (4, 5, "held-out")]
)
def test_split_refuses_meaningless_settings(every, limit, part):
    with pytest.raises(ValueError):
        SampleSplit(every, limit, part)


# ---------------------------------------------------------------- recipes


def _mlp(path: Path) -> None:
    """x [N, 16] -> MatMul -> Relu -> MatMul -> y [N, 8]."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.3, (16, 32)).astype(np.float32)
    w2 = rng.normal(0, 0.3, (32, 8)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], "fc1"),
            helper.make_node("Relu", ["h"], ["r"], "relu"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], "fc2"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tuning")
    _mlp(root / "mlp.onnx")
    rng = np.random.default_rng(1)
    np.savez(root / "calib.npz", x=rng.standard_t(3, (256, 16)).astype(np.float32))
    np.savez(root / "tune.npz", x=rng.standard_t(3, (64, 16)).astype(np.float32))
    return root


def _recipe(folder: Path, name: str, calibration: str = "", extra: str = "") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(
        "model: {onnx: mlp.onnx}\n"
        "inputs: {x: [1, 16]}\n"
        f"calibration: {{data: {{npz: calib.npz}}, batch_size: 32{calibration}}}\n"
        "quantization: {op_types: [MatMul]}\n"
        f"output: {{dir: out-{name}}}\n" + extra
    )
    return path


@pytest.mark.parametrize(
    ("tuning", "message"),
    [
        ("{every: 1}", "tuning.every: must be >= 2, got 1"),
        ("{every: 4, data: {npz: tune.npz}}", "tuning.every: splits the calibration set"),
        ("{max_samples: 0}", "tuning.max_samples: must be >= 1, got 0"),
        ("{baseline: fp32}", "tuning.baseline: must be one of minmax, none, got 'fp32'"),
        ("{rows: 3}", "tuning.rows: unknown key"),
        ("{data: {npz: missing.npz}}", "tuning.data.npz: file not found"),
        ("[4]", "tuning: must be a mapping"),
    ],
)
def test_tuning_keys_are_validated_with_one_line_errors(folder, tuning, message):
    path = _recipe(folder, "bad", extra=f"tuning: {tuning}\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_split_is_taken_only_when_something_is_scored_on_it(folder):
    plain = load_recipe(_recipe(folder, "plain", ", method: minmax"))
    assert settings.calibration_data(plain).split is None
    assert settings.tuning_data(plain) is None
    entropy = load_recipe(_recipe(folder, "entropy", ", method: entropy"))
    split = settings.calibration_data(entropy).split
    assert split == SampleSplit(4, 128, "calibration")
    assert settings.tuning_data(entropy).split == split.other()
    off = load_recipe(_recipe(folder, "off", ", method: entropy", "tuning: {baseline: none}\n"))
    assert settings.calibration_data(off).split is None and settings.tuning_data(off) is None
    own = load_recipe(
        _recipe(folder, "own", ", method: entropy", "tuning: {data: {npz: tune.npz}}\n")
    )
    assert settings.calibration_data(own).split is None  # calibration keeps every sample
    assert settings.tuning_data(own).spec.npz == folder / "tune.npz"
    # a recipe without `tuning:` hashes as it did before the section existed
    assert recipe_sha256(plain) != recipe_sha256(off)
    spelled = load_recipe(_recipe(folder, "spelled", ", method: minmax", "tuning: {}\n"))
    assert recipe_sha256(spelled) == recipe_sha256(plain)


def test_a_recipe_model_worse_than_min_max_on_the_tuning_rows_is_not_shipped(folder):
    """Percentile 60 clips most of every heavy-tailed activation: worse than min-max on rows
    it never saw, so plain min-max (on the same calibration rows) is written, and the report
    says so with both scores."""
    recipe = load_recipe(_recipe(folder, "clip", ", method: percentile, percentile: 60"))
    result = quantize(recipe, progress=False)
    choice = result.report["model_choice"]
    assert choice["kept"] == MINMAX and choice["metric"] == "sqnr"
    assert choice["tuning_samples"] == 64  # every 4th of 256
    scores = choice["scores"]
    assert scores[MINMAX]["sqnr_db"] > scores[RECIPE]["sqnr_db"] + 3
    assert "not applied" in choice["reason"] and choice["recipe_model"]["method"] == "percentile"
    assert result.report["method"] == "minmax"
    # the input's range written is the min-max of exactly the calibration rows
    x = np.load(folder / "calib.npz")["x"]
    rows = x[np.arange(len(x)) % 4 != 3]
    inits = {
        i.name: numpy_helper.to_array(i) for i in onnx.load(result.model_path).graph.initializer
    }
    scale = float(inits["x_scale"])
    assert scale == pytest.approx((rows.max() - rows.min()) / 255, rel=1e-6)
    # deterministic: the same recipe writes the same bytes
    again = quantize(load_recipe(recipe.path, output_dir=folder / "again"), progress=False)
    assert again.model_path.read_bytes() == result.model_path.read_bytes()


def test_the_comparison_scores_the_evaluation_gates_metric_or_is_off(folder):
    gated = _recipe(
        folder,
        "gated",
        ", method: percentile, percentile: 60",
        "evaluation: {data: {npz: tune.npz}, min_cosine: 0.9}\n",
    )
    choice = quantize(load_recipe(gated), progress=False).report["model_choice"]
    assert choice["metric"] == "cosine" and choice["output"] == "y"
    assert choice["kept"] == MINMAX
    assert choice["scores"][MINMAX]["cosine"] > choice["scores"][RECIPE]["cosine"]
    off = _recipe(
        folder, "nocompare", ", method: percentile, percentile: 60", "tuning: {baseline: none}\n"
    )
    report = quantize(load_recipe(off), progress=False).report
    assert "model_choice" not in report and report["method"] == "percentile"


def test_ties_keep_the_simpler_model():
    same = Scores(30.0, 0.99, 1.0, None)
    assert choose({RECIPE: same, MINMAX: same}, "agreement") == MINMAX
    better_sqnr = Scores(31.0, 0.99, 1.0, None)
    assert choose({RECIPE: better_sqnr, MINMAX: same}, "agreement") == RECIPE


# --------------------------------------------------------------------------- --auto and analyze


def _numbered(sizes: tuple[int, ...]) -> list:
    from qtool.data.batches import Batch

    batches, start = [], 0
    for size in sizes:
        ids = np.arange(start, start + size)
        batches.append(Batch({"x": ids[:, None].astype(np.float32)}, ids))
        start += size
    return batches


@pytest.mark.parametrize(
    ("sizes", "samples", "analysis"),
    [((3, 5), 4, 4), ((3, 5), 3, 3), ((3, 5), 100, 4), ((2,), 1, 1), ((4, 4, 4), 5, 5)],
)
def test_auto_verifies_on_the_evaluation_rows_its_analysis_did_not_measure(
    sizes, samples, analysis
):
    from qtool.search.mixed import split_rows

    batches = _numbered(sizes)
    total = sum(sizes)
    count, rest = split_rows(batches, samples, "evaluation.data")
    assert count == analysis  # the first `samples`, at most half of the set
    rows = np.concatenate([b.inputs["x"][:, 0] for b in rest])
    labels = np.concatenate([b.labels for b in rest])
    # The verification rows: exactly the samples after the analysis's, labels with them.
    assert rows.tolist() == list(range(analysis, total))
    assert labels.tolist() == list(range(analysis, total))


def test_auto_refuses_an_evaluation_set_too_small_to_split():
    from qtool.errors import DataError
    from qtool.search.mixed import split_rows

    with pytest.raises(DataError, match="evaluation.data: mixed precision needs at least 2"):
        split_rows(_numbered((1,)), 128, "evaluation.data")


def test_same_source_ignores_the_key_the_data_sits_under(tmp_path):
    from qtool.data.spec import same_source

    a = DataSpec("calibration.data", npz=tmp_path / "a.npz")
    assert same_source(a, DataSpec("evaluation.data", npz=tmp_path / "a.npz"))
    assert not same_source(a, DataSpec("evaluation.data", npz=tmp_path / "b.npz"))
    assert not same_source(a, DataSpec("evaluation.data", python=f"{tmp_path}/a.py:f"))


def test_a_weight_only_recipe_is_not_compared_with_the_same_model(folder, monkeypatch):
    """Weight-only: no range is read, so another range method writes plain min-max's very
    model. The build says so instead of building and scoring it twice, and writes the bytes the
    min-max recipe writes."""
    from qtool.pipeline import keep

    def weight_only(name: str, method: str) -> Path:
        path = folder / f"{name}.yaml"
        path.write_text(
            "model: {onnx: mlp.onnx}\n"
            "inputs: {x: [1, 16]}\n"
            f"calibration: {{data: {{npz: calib.npz}}, batch_size: 32, method: {method}}}\n"
            "quantization: {op_types: [MatMul], activations: float}\n"
            f"output: {{dir: out-{name}}}\n"
        )
        return path

    monkeypatch.setattr(keep, "score_models", lambda *a, **k: pytest.fail("scored"))
    result = quantize(load_recipe(weight_only("wo", "percentile")), progress=False)
    choice = result.report["model_choice"]
    assert choice["kept"] == RECIPE and "nothing was compared" in choice["reason"]
    plain = quantize(load_recipe(weight_only("wo-minmax", "minmax")), progress=False)

    def graph(path: Path) -> bytes:
        return onnx.load(path).graph.SerializeToString(deterministic=True)

    assert graph(result.model_path) == graph(plain.model_path)
