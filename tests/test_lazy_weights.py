"""Weights that stream: the opset upgrade runs without them, a model over protobuf's limit is
quantized from its staged file one weight at a time, and no float copy of it stays in the output
folder unless the recipe asks (`output.float_model`).

Like tests/test_external_data.py, these lower EXTERNAL_DATA_THRESHOLD so that a ~200 KB model
takes the over-2-GB path (or STAGE_WEIGHTS_THRESHOLD: the path of a 256 MB-2 GB model, staged
for memory but written as usual); the memory it saves is measured by benchmarks/llm_memory.py,
not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import numpy_helper
from test_external_data import (
    LIMIT,
    assert_no_temporaries,
    cosine,
    mlp,
    run_ort,
    save_external,
    write_case,
)

from qtool.calibration import collect as collect_module
from qtool.errors import RecipeError
from qtool.model import external_data
from qtool.model.prepare import prepare_model
from qtool.pipeline.float_model import FloatModel


@pytest.fixture
def low_limit(monkeypatch):
    monkeypatch.setattr(external_data, "EXTERNAL_DATA_THRESHOLD", LIMIT)


def _large(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {
        t.name: numpy_helper.to_array(t)
        for t in model.graph.initializer
        if external_data.tensor_nbytes(t) >= external_data.MIN_EXTERNAL_BYTES
    }


@pytest.mark.parametrize("target", [17, 21])
def test_opset_upgrade_never_hands_the_weights_to_the_converter(target, monkeypatch, tmp_path):
    """The converter copies the whole proto: it must see references, not data; the prepared
    model computes what the source does and keeps every weight's values."""
    from onnx import version_converter

    convert = version_converter.convert_version
    seen: list[str] = []

    def checked(model, version):
        for tensor in model.graph.initializer:
            if external_data.tensor_nbytes(tensor) >= external_data.MIN_EXTERNAL_BYTES:
                seen.append(tensor.name)  # data the converter would have copied
        return convert(model, version)

    monkeypatch.setattr(version_converter, "convert_version", checked)
    source = mlp(opset=13)
    weights = _large(source)
    assert weights  # the case has weights the converter must not see
    prepared = prepare_model(source, min_opset=target)
    assert seen == []
    opset = {o.version for o in prepared.opset_import if o.domain in ("", "ai.onnx")}
    assert opset == {target}
    kept = {t.name: numpy_helper.to_array(t) for t in prepared.graph.initializer}
    for name, values in weights.items():
        np.testing.assert_array_equal(kept[name], values)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    paths = [tmp_path / "a.onnx", tmp_path / "b.onnx"]
    onnx.save(source, str(paths[0]))
    onnx.save(prepared, str(paths[1]))
    np.testing.assert_allclose(run_ort(paths[1], x), run_ort(paths[0], x), atol=1e-5)


def test_lazy_weight_is_read_without_touching_the_proto(tmp_path):
    source = save_external(mlp(), tmp_path / "m.onnx")
    model = onnx.load(str(source), load_external_data=False)
    external_data.make_lazy(model, tmp_path)
    full = onnx.load(str(source))
    expected = {t.name: numpy_helper.to_array(t) for t in full.graph.initializer}
    lazy = [t for t in model.graph.initializer if external_data.lazy_file(t) is not None]
    assert lazy and external_data.is_lazy(model)
    for tensor in lazy:
        np.testing.assert_array_equal(external_data.tensor_array(tensor), expected[tensor.name])
        assert tensor.data_location == onnx.TensorProto.EXTERNAL  # not loaded into the proto
        assert not tensor.HasField("raw_data")
    # writing it copies the lazy weights' bytes into the new data file
    written = tmp_path / "copy" / "m.onnx"
    written.parent.mkdir()
    external_data.save_model(model, written)
    x = np.ones((2, 64), np.float32)
    np.testing.assert_array_equal(run_ort(written, x), run_ort(source, x))


def _quantize(cli, recipe: Path) -> dict[str, bytes]:
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    out = recipe.parent / "out"
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "report.json"}


@pytest.mark.parametrize("bits", [8, 4])
def test_lazy_weights_write_the_same_model(bits, low_limit, cli, tmp_path, monkeypatch):
    """Quantizing from the staged file one weight at a time (the default without the search)
    writes the bytes that reading the whole float model back writes, and never reads it whole."""
    from qtool.app import quantize as quantize_app

    models = {}
    prepare = quantize_app.prepare
    for lazy in (True, False):
        folder = tmp_path / ("lazy" if lazy else "whole")
        folder.mkdir()
        recipe, _ = write_case(folder, mlp())
        if bits == 4:
            spec = yaml.safe_load(recipe.read_text())
            spec["quantization"] = {"weights": {"bits": 4, "block_size": 32}}
            recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
        monkeypatch.setattr(
            quantize_app, "prepare", lambda r, lazy_weights, keep=lazy: prepare(r, keep)
        )
        load = external_data.StagedModel.load
        if lazy:

            def refuse(self, skip=()):
                raise AssertionError("the lazy path read the whole float model back")

            monkeypatch.setattr(external_data.StagedModel, "load", refuse)
        models[lazy] = _quantize(cli, recipe)
        monkeypatch.setattr(external_data.StagedModel, "load", load)
        monkeypatch.setattr(quantize_app, "prepare", prepare)
    tag = f"model.int{bits}.onnx"
    assert f"{tag}.data" in models[True]
    assert models[True][f"{tag}.data"] == models[False][f"{tag}.data"]
    assert models[True][tag] == models[False][tag]


def test_float_copy_over_the_limit_only_when_asked(low_limit, cli, tmp_path):
    """`output.float_model: auto` (the default): no model.fp32.onnx(.data) for a model over the
    limit, nothing temporary left; evaluate compares against the recipe's source model."""
    recipe, x = write_case(tmp_path, mlp(), float_model="auto")
    out = tmp_path / "out"
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == ["model.int8.onnx", "model.int8.onnx.data", "report.json", "stats.npz"]
    assert_no_temporaries(out)
    report = json.loads((out / "report.json").read_text())
    assert report["files"]["float_model"] is None
    reference = run_ort(tmp_path / "source.onnx", x)
    assert cosine(run_ort(out / "model.int8.onnx", x), reference) > 0.99

    evaluation = tmp_path / "eval.json"
    result = cli("evaluate", recipe, "--json", evaluation, "--no-progress")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(evaluation.read_text())
    assert summary["provenance"]["status"] == "match: source model"

    # `always` writes it, and the quantized model is the same either way
    before = (out / "model.int8.onnx.data").read_bytes()
    spec = yaml.safe_load(recipe.read_text())
    spec["output"]["float_model"] = "always"
    recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    assert (out / "model.fp32.onnx.data").is_file()
    assert (out / "model.int8.onnx.data").read_bytes() == before


def test_float_model_key_is_validated(tmp_path):
    from qtool.config.recipe import load_recipe

    recipe, _ = write_case(tmp_path, mlp(), float_model="never")
    with pytest.raises(RecipeError, match="output.float_model"):
        load_recipe(recipe)


def test_materialize_reads_the_weights_back(low_limit, tmp_path):
    """A lazy FloatModel handed to a stage that needs the whole float model reads it in."""
    from qtool.pipeline.float_model import freeze

    model = mlp()
    frozen: FloatModel = freeze(model, tmp_path / "model.fp32.onnx", "source")
    try:
        assert frozen.lazy and external_data.is_lazy(frozen.model)
        frozen.materialize()
        assert not frozen.lazy and not external_data.is_lazy(frozen.model)
        expected = _large(model)
        got = {t.name: numpy_helper.to_array(t) for t in frozen.model.graph.initializer}
        for name, values in expected.items():
            np.testing.assert_array_equal(got[name], values)
    finally:
        frozen.discard()


def test_int4_signed_scales_in_chunks_give_the_same_weights(monkeypatch):
    """The signed-scale choice runs on column chunks to bound its memory: same bytes as whole."""
    from qtool.write import int4

    rng = np.random.default_rng(3)
    weight = rng.standard_normal((96, 200)).astype(np.float32)
    weight[:, 7] *= 40.0  # an outlier column, so the two grids disagree somewhere
    whole = int4.quantize_blockwise(weight, block_size=32, signed_scales=True)
    monkeypatch.setattr(int4, "_CHUNK_ELEMENTS", 96 * 13)  # 13 columns per chunk, uneven tail
    chunked = int4.quantize_blockwise(weight, block_size=32, signed_scales=True)
    assert np.array_equal(whole.values, chunked.values)
    assert whole.scale.tobytes() == chunked.scale.tobytes()
    assert (whole.scale < 0).any() and (whole.scale > 0).any()  # both grids were chosen


def test_speed_check_skips_a_float_model_over_the_limit(low_limit, cli, tmp_path, monkeypatch):
    """The FP32 speed session of a float model over the limit (512 MB) would hold it again: not
    run, and report.json and the command's output say so."""
    from qtool.pipeline import finish

    recipe, _ = write_case(tmp_path, mlp(), float_model="auto")
    spec = yaml.safe_load(recipe.read_text())
    spec["quantization"] = {"weights": {"bits": 4, "block_size": 32}}
    recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
    monkeypatch.setattr(finish, "SPEED_CHECK_MAX_BYTES", LIMIT)  # the staged model is over it
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["runtime"]["low_bit_speed"] == {"not_measured": finish.SPEED_NOT_MEASURED}
    assert "not measured: the float model is over 512 MB" in result.stdout


def test_speed_check_skips_an_inline_float_model_over_the_limit(cli, tmp_path, monkeypatch):
    """The rule reads the float model's size, not how it is stored: a model held in memory
    (under protobuf's limit) over SPEED_CHECK_MAX_BYTES is not timed either, and one under it
    is."""
    from qtool.pipeline import finish

    recipe, _ = write_case(tmp_path, mlp(), float_model="auto")
    spec = yaml.safe_load(recipe.read_text())
    spec["quantization"] = {"weights": {"bits": 4, "block_size": 32}}
    recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
    monkeypatch.setattr(finish, "SPEED_CHECK_MAX_BYTES", 1024)
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["runtime"]["low_bit_speed"] == {"not_measured": finish.SPEED_NOT_MEASURED}
    monkeypatch.setattr(finish, "SPEED_CHECK_MAX_BYTES", 1 << 40)
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["runtime"]["low_bit_speed"]["speedup"] > 0


@pytest.fixture
def low_staging(monkeypatch):
    """A ~340 KB float model is 'large' (staged, read weight by weight) while protobuf's limit
    stays where it is: the path of a 256 MB-2 GB model."""
    monkeypatch.setattr(external_data, "STAGE_WEIGHTS_THRESHOLD", LIMIT)


def _content(path: Path) -> bytes:
    """The model's bytes without qtool's provenance metadata (it names the float model's
    fingerprint, which is the staged files' hash on one path and the file's on the other)."""
    model = onnx.load(str(path))
    kept = [p for p in model.metadata_props if not p.key.startswith("qtool.")]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    return model.SerializeToString(deterministic=True)


@pytest.mark.parametrize("bits", [8, 4, "4-llm"])
def test_a_large_model_under_the_limit_is_staged_and_written_as_usual(
    bits, cli, tmp_path, monkeypatch
):
    """Staged for its size, not for protobuf's limit: quantize reads its weights from the
    staged file, writes the same quantized model as one file (no .data beside it), keeps the
    float copy under `output.float_model: auto` (as the model and its data file), and
    calibrate, quantize --stats, evaluate and the search agree on its fingerprint."""
    contents = {}
    parts: list[int] = []
    split = collect_module.split_model

    def counted(*args):
        result = split(*args)
        parts.append(0 if result is None else len(result))
        return result

    for staged in (False, True):
        folder = tmp_path / ("staged" if staged else "memory")
        folder.mkdir()
        if staged:
            monkeypatch.setattr(external_data, "STAGE_WEIGHTS_THRESHOLD", LIMIT)
            # calibrated part by part, as a decoder is: the same statistics, the same model
            monkeypatch.setattr(collect_module, "PART_BYTES", 64 << 10)
            monkeypatch.setattr(collect_module, "split_model", counted)
        recipe, _ = write_case(folder, mlp(), float_model="auto")
        spec = yaml.safe_load(recipe.read_text())
        # fc2 stays float: its weight is a lazy one read back into the inline quantized model
        spec["quantization"] = {"overrides": [{"nodes": "/fc2/MatMul", "precision": "float"}]}
        if bits in (4, "4-llm"):
            spec["quantization"]["weights"] = {"bits": 4, "block_size": 32}
        if bits == "4-llm":  # the LLM presets' algorithms read the staged weights one by one
            spec["quantization"]["weights"]["method"] = "gptq"
            spec["quantization"]["algorithms"] = {
                "awq": {"grid": 4},
                "scale_estimation": {"steps": 2},
                "gptq": {"act_order": True},
            }
        recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
        calibrated = cli("calibrate", recipe, "--no-progress")
        assert calibrated.exit_code == 0, calibrated.stderr
        with monkeypatch.context() as patch:
            if staged and bits == "4-llm":  # quantize builds from the staged weights
                patch.setattr(FloatModel, "materialize", _no_materialize)
            stats = str(folder / "out/stats.npz")
            result = cli("quantize", recipe, "--no-progress", "--stats", stats)
        assert result.exit_code == 0, result.stderr
        out = folder / "out"
        (written,) = out.glob("model.int*.onnx")
        assert not list(out.glob("model.int*.onnx.data"))
        assert (out / "model.fp32.onnx.data").exists() == staged
        report = json.loads((out / "report.json").read_text())
        assert report["files"]["float_model"] == str(out / "model.fp32.onnx")
        contents[staged] = _content(written)
        evaluated = cli("evaluate", recipe, "--no-progress", "--latency-runs", "1")
        assert evaluated.exit_code == 0, evaluated.stderr
        assert_no_temporaries(out)
    assert all(count >= 2 for count in parts)
    assert parts or bits == 4  # 4-bit round-to-nearest reads no calibration data
    assert contents[True] == contents[False]


def test_a_staged_model_is_compared_with_plain_minmax(low_staging, cli, tmp_path):
    """A range method other than min-max builds the plain min-max model too and scores both
    on the tuning rows. Built from a staged float model, both keep lazy float weights (fc2
    stays float); the files ONNX Runtime scores read them in, since it refuses their absolute
    locations (examples/smollm failed there: 'Absolute path not allowed')."""
    recipe, _ = write_case(tmp_path, mlp(), float_model="auto")
    spec = yaml.safe_load(recipe.read_text())
    spec["calibration"]["method"] = "percentile"
    spec["quantization"] = {"overrides": [{"nodes": "/fc2/MatMul", "precision": "float"}]}
    recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["model_choice"]["kept"] in ("recipe", "minmax")
    assert report["model_choice"]["tuning_samples"] > 0
    assert_no_temporaries(tmp_path / "out")


def _no_materialize(self) -> None:
    raise AssertionError("the build read the whole staged float model in")


def test_the_search_holds_a_staged_model_under_the_limit_as_bytes(low_staging, cli, tmp_path):
    """`--auto` hands the float model to many sessions as bytes: a model staged for its size
    is read back and searched; only one over protobuf's limit is refused."""
    recipe, _ = write_case(tmp_path, mlp(), float_model="auto")
    spec = yaml.safe_load(recipe.read_text())
    spec["evaluation"]["min_cosine"] = 0.9
    spec["mixed_precision"] = {"samples": 16, "max_iterations": 2}
    # an algorithm: each plan the search measures is built from the staged float model, which
    # lets go of its proto (plan.yaml then reads the graph from the staged file)
    spec["quantization"] = {"algorithms": {"bias_correction": {"samples": 16}}}
    spec["tuning"] = {"data": {"npz": "data.npz"}}
    recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
    calibrated = cli("calibrate", recipe, "--no-progress")  # its stats serve the search
    assert calibrated.exit_code == 0, calibrated.stderr
    analyzed = cli("analyze", recipe, "--no-progress", "--samples", "8", "--mode", "one-at-a-time")
    assert analyzed.exit_code == 0, analyzed.stderr
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    assert (out / "plan.yaml").is_file() and (out / "model.fp32.onnx.data").is_file()
    evaluated = cli("evaluate", recipe, "--no-progress", "--latency-runs", "1")
    assert evaluated.exit_code == 0, evaluated.stderr  # the float model it names is its own
    assert_no_temporaries(out)


def test_lazy_weights_read_back_are_the_inline_model_byte_for_byte(tmp_path):
    """A staged model's weights read back into the proto leave no trace of having been
    external (no data_location field): the same bytes as the model that was never staged."""
    model = mlp()
    onnx.save(mlp(), str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data")
    staged = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    external_data.make_lazy(staged, tmp_path)
    assert external_data.is_lazy(staged)
    external_data.read_lazy_weights(staged)
    assert not external_data.is_lazy(staged)
    assert not any(t.HasField("data_location") for t in staged.graph.initializer)
    assert staged.SerializeToString(deterministic=True) == model.SerializeToString(
        deterministic=True
    )
