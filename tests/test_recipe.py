"""Recipe validation: a good recipe becomes typed objects; every mistake names file and key path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError
from qtool.plan.settings import DEFAULT_OP_TYPES

MINIMAL = {
    "model": {"onnx": "model.onnx"},
    "inputs": {"x": [1, 4]},
    "calibration": {"data": {"synthetic": True}},
}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A recipe folder holding the files the minimal recipe and its variants point at."""
    (tmp_path / "model.onnx").write_bytes(b"only its existence is checked here")
    (tmp_path / "model.py").write_text("def make():\n    return None\n")
    (tmp_path / "calib.npz").write_bytes(b"")
    return tmp_path


def write(folder: Path, recipe: dict | str, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe))
    return path


def test_minimal_recipe_loads_with_defaults(folder: Path, monkeypatch) -> None:
    path = write(folder, MINIMAL)
    monkeypatch.chdir(folder.parent)  # relative paths resolve against the recipe, not the cwd
    recipe = load_recipe(path)
    assert recipe.path == path
    assert recipe.model.onnx == folder / "model.onnx"
    assert recipe.model.pytorch is None and recipe.model.weights is None
    assert recipe.model.opset == 17
    assert len(recipe.inputs) == 1
    (spec,) = recipe.inputs
    assert (spec.name, spec.shape, spec.dtype) == ("x", (1, 4), "float32")
    calibration = recipe.calibration
    assert calibration.data.kind == "synthetic" and calibration.data.synthetic
    assert calibration.data.samples == 64
    assert calibration.batch_size == 32 and calibration.max_samples is None
    assert calibration.method == "entropy"
    assert calibration.percentile == 99.99 and calibration.bins == 2048
    quantization = recipe.quantization
    assert quantization.target == "ort-cpu" and not quantization.symmetric_activations
    assert quantization.per_channel is True
    assert quantization.op_types == DEFAULT_OP_TYPES == ("Conv", "Gemm", "MatMul")
    assert quantization.exclude == ()
    assert recipe.evaluation is None
    assert recipe.seed == 0
    assert recipe.output_dir == folder / "out"
    assert recipe.quant_model_path == folder / "out" / "model.int8.onnx"


def test_full_recipe_reads_every_section(folder: Path) -> None:
    recipe = {
        "seed": 3,
        "model": {"pytorch": "model.py:make", "opset": 18},
        "inputs": {"ids": {"shape": [2, 16], "dtype": "int64"}, "x": [2, 3]},
        "calibration": {
            "data": {"npz": "calib.npz"},
            "batch_size": 8,
            "max_samples": 100,
            "method": "percentile",
            "percentile": 99.9,
            "bins": 512,
        },
        "quantization": {"target": "tensorrt", "per_channel": False, "exclude": ["/fc/Gemm"]},
        "evaluation": {"data": {"synthetic": True, "samples": 10}, "max_drop": 0.5},
        "output": {"dir": "results"},
    }
    loaded = load_recipe(write(folder, recipe))
    assert loaded.model.pytorch == f"{folder / 'model.py'}:make" and loaded.model.opset == 18
    assert [(i.name, i.shape, i.dtype) for i in loaded.inputs] == [
        ("ids", (2, 16), "int64"),
        ("x", (2, 3), "float32"),
    ]
    assert loaded.calibration.data.npz == folder / "calib.npz"
    assert loaded.calibration.data.kind == "npz"
    assert (loaded.calibration.batch_size, loaded.calibration.max_samples) == (8, 100)
    assert (loaded.calibration.method, loaded.calibration.percentile) == ("percentile", 99.9)
    assert loaded.quantization.symmetric_activations and not loaded.quantization.per_channel
    assert loaded.quantization.exclude == ("/fc/Gemm",)
    assert loaded.evaluation is not None and loaded.evaluation.max_drop == 0.5
    assert loaded.evaluation.data.samples == 10
    assert loaded.seed == 3
    assert loaded.output_dir == folder / "results"
    assert load_recipe(write(folder, recipe), output_dir="elsewhere").output_dir == Path(
        "elsewhere"
    )


def _set(recipe: dict, dotted: str, value) -> dict:
    recipe = copy.deepcopy(recipe)
    *parents, last = dotted.split(".")
    node = recipe
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return recipe


def _drop(recipe: dict, key: str) -> dict:
    recipe = copy.deepcopy(recipe)
    del recipe[key]
    return recipe


CALIB_DATA = "calibration.data"
BAD_RECIPES = {
    "unknown top-level key": (_set(MINIMAL, "modle", {}), "modle"),
    "unknown nested key": (_set(MINIMAL, "calibration.methd", "minmax"), "calibration.methd"),
    "wrong type": (_set(MINIMAL, "calibration.batch_size", "32"), "calibration.batch_size"),
    "bad method": (_set(MINIMAL, "calibration.method", "kl"), "calibration.method"),
    "bad percentile": (_set(MINIMAL, "calibration.percentile", 120), "calibration.percentile"),
    "bad target": (_set(MINIMAL, "quantization.target", "gpu"), "quantization.target"),
    "missing inputs": (_drop(MINIMAL, "inputs"), "inputs"),
    "missing model file": (_set(MINIMAL, "model.onnx", "nope.onnx"), "model.onnx"),
    "missing data file": (_set(MINIMAL, CALIB_DATA, {"npz": "missing.npz"}), f"{CALIB_DATA}.npz"),
    "onnx and pytorch": (_set(MINIMAL, "model.pytorch", "model.py:make"), "model"),
    "two data sources": (
        _set(MINIMAL, CALIB_DATA, {"npz": "calib.npz", "synthetic": True}),
        CALIB_DATA,
    ),
    "no data source": (_set(MINIMAL, CALIB_DATA, {}), CALIB_DATA),
    "samples without synthetic": (
        _set(MINIMAL, CALIB_DATA, {"npz": "calib.npz", "samples": 8}),
        f"{CALIB_DATA}.samples",
    ),
    "zero batch size": (_set(MINIMAL, "calibration.batch_size", 0), "calibration.batch_size"),
    "bad shape entry": (_set(MINIMAL, "inputs.x", [1, "four"]), "inputs.x[1]"),
    "unsupported op type": (
        _set(MINIMAL, "quantization.op_types", ["Conv", "Relu"]),
        "quantization.op_types[1]",
    ),
    "missing base preset": (_set(MINIMAL, "base", "presets/none.yaml"), "base"),
}


@pytest.mark.parametrize("case", list(BAD_RECIPES), ids=list(BAD_RECIPES))
def test_bad_recipe_names_file_and_key_path(folder: Path, case: str) -> None:
    recipe, key_path = BAD_RECIPES[case]
    path = write(folder, recipe)
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    message = str(caught.value)
    assert str(path) in message
    assert f" {key_path}:" in message, message
    assert "\n" not in message


def test_malformed_yaml_names_the_line(folder: Path) -> None:
    text = "model:\n  onnx: model.onnx\ninputs:\n\tx: [1, 4]\n"
    path = write(folder, text)
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    message = str(caught.value)
    assert str(path) in message and "line 4" in message, message
    assert "\n" not in message


def test_missing_recipe_file_is_a_recipe_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(RecipeError, match="absent.yaml"):
        load_recipe(path)


def test_empty_recipe_reports_the_first_missing_required_key(folder: Path) -> None:
    path = write(folder, "")
    with pytest.raises(RecipeError, match=r" (calibration|inputs|model): is required"):
        load_recipe(path)


def test_base_preset_is_merged_under_the_recipe_key_by_key(folder: Path) -> None:
    presets = folder / "presets"
    presets.mkdir()
    preset = {
        "calibration": {"method": "percentile", "percentile": 99.5, "batch_size": 8},
        "quantization": {"target": "tensorrt", "op_types": ["MatMul"]},
    }
    write(presets, preset, "p.yaml")
    recipe = _set(_set(MINIMAL, "base", "presets/p.yaml"), "calibration.batch_size", 4)
    loaded = load_recipe(write(folder, recipe))
    assert loaded.calibration.method == "percentile" and loaded.calibration.percentile == 99.5
    assert loaded.calibration.batch_size == 4  # the recipe's own value wins
    assert loaded.calibration.data.kind == "synthetic"  # nested keys merge, not replace
    assert loaded.quantization.target == "tensorrt"
    assert loaded.quantization.op_types == ("MatMul",)
    assert loaded.model.onnx == folder / "model.onnx"


def test_base_presets_that_include_each_other_are_an_error(folder: Path) -> None:
    write(folder, {"base": "b.yaml", "seed": 1}, "a.yaml")
    write(folder, {"base": "a.yaml"}, "b.yaml")
    path = write(folder, _set(MINIMAL, "base", "a.yaml"))
    with pytest.raises(RecipeError, match=r" base: .*loop"):
        load_recipe(path)


CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_presets_work_as_base(folder: Path, preset: Path) -> None:
    loaded = load_recipe(write(folder, _set(MINIMAL, "base", str(preset))))
    settings = yaml.safe_load(preset.read_text())
    calibration = settings.get("calibration", {})
    quantization = settings.get("quantization", {})
    assert loaded.calibration.method == calibration.get("method", "entropy")
    assert loaded.quantization.target == quantization.get("target", "ort-cpu")
    if "op_types" in quantization:
        assert loaded.quantization.op_types == tuple(quantization["op_types"])
