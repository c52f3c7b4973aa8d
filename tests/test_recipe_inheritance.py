"""`base:` inheritance as docs/recipe.md states it, and the resolved recipe's hash that
provenance stamps into every quantized model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from qtool.algorithms.spec import SmoothQuantParams
from qtool.config import presets
from qtool.config.fingerprint import recipe_sha256
from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError

OWN = {
    "model": {"onnx": "model.onnx"},
    "inputs": {"x": [1, 4]},
    "calibration": {"data": {"synthetic": True}},
}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A recipe folder outside the checkout: presets by name must not need a path into it."""
    (tmp_path / "model.onnx").write_bytes(b"only its existence is checked here")
    return tmp_path


def write(folder: Path, recipe: dict, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_a_preset_by_name_works_from_any_folder(folder: Path, monkeypatch) -> None:
    monkeypatch.chdir(folder)
    loaded = load_recipe(write(folder, {"base": "int8-cnn", **OWN}))
    assert loaded.calibration.method == "mse"
    assert loaded.algorithms.names() == ("bias_correction",)
    assert "int8-cnn" in presets.names() and presets.FOLDER.is_dir()


def test_an_unknown_preset_name_lists_the_presets(folder: Path) -> None:
    with pytest.raises(
        RecipeError, match=r"base: no preset named 'int8-cnm' \(presets: .*int8-cnn"
    ):
        load_recipe(write(folder, {"base": "int8-cnm", **OWN}))


def test_inputs_replace_the_base_inputs(folder: Path) -> None:
    write(folder, {**OWN, "inputs": {"a": [1, 4], "b": [1, 4]}}, "base.yaml")
    loaded = load_recipe(write(folder, {"base": "base.yaml", "inputs": {"x": [2, 8]}}))
    assert [(i.name, i.shape) for i in loaded.inputs] == [("x", (2, 8))]


def test_mappings_merge_key_by_key_and_lists_replace(folder: Path) -> None:
    base = {**OWN, "calibration": {"data": {"synthetic": True}, "method": "minmax"}}
    base["quantization"] = {"op_types": ["Conv", "Gemm"], "exclude": ["a", "b"]}
    write(folder, base, "base.yaml")
    derived = {"base": "base.yaml", "calibration": {"batch_size": 4}}
    derived["quantization"] = {"op_types": ["MatMul"]}
    loaded = load_recipe(write(folder, derived))
    assert loaded.calibration.method == "minmax" and loaded.calibration.batch_size == 4
    assert loaded.quantization.op_types == ("MatMul",)  # replaced, not appended
    assert loaded.quantization.exclude == ("a", "b")  # not named: kept


def test_null_removes_what_the_base_set(folder: Path) -> None:
    base = {**OWN, "calibration": {"data": {"synthetic": True}, "max_samples": 16}}
    write(folder, base, "base.yaml")
    assert load_recipe(folder / "base.yaml").calibration.max_samples == 16
    loaded = load_recipe(write(folder, {"base": "base.yaml", "calibration": {"max_samples": None}}))
    assert loaded.calibration.max_samples is None


def test_empty_algorithms_remove_the_presets_algorithms(folder: Path) -> None:
    loaded = load_recipe(write(folder, {"base": "int8-transformer", **OWN}))
    assert loaded.algorithms.names() == ("smoothquant",)
    off = {"base": "int8-transformer", **OWN, "quantization": {"algorithms": {}}}
    assert load_recipe(write(folder, off, "off.yaml")).algorithms.names() == ()
    # a mapping naming one algorithm merges into the preset's (it tunes, not replaces)
    tuned = {"base": "int8-transformer", **OWN}
    tuned["quantization"] = {"algorithms": {"smoothquant": {"alpha": 0.5}}}
    tuned_recipe = load_recipe(write(folder, tuned, "tuned.yaml"))
    assert tuned_recipe.algorithms.smoothquant == SmoothQuantParams(alpha=0.5, objective="block")


def test_the_hash_is_of_the_resolved_recipe(folder: Path, tmp_path_factory) -> None:
    write(folder, {"calibration": {"method": "minmax"}}, "preset.yaml")
    via_base = write(folder, {"base": "preset.yaml", **OWN}, "a.yaml")
    spelled = {**OWN, "calibration": {"data": {"synthetic": True}, "method": "minmax"}}
    written_out = write(folder, spelled, "b.yaml")
    first = load_recipe(via_base)
    # the same settings, however they are written, in any output folder
    assert recipe_sha256(first) == recipe_sha256(load_recipe(written_out))
    assert recipe_sha256(first) == recipe_sha256(load_recipe(via_base, output_dir="elsewhere"))
    # a change in the base changes it; so does a change made in code
    write(folder, {"calibration": {"method": "entropy"}}, "preset.yaml")
    assert recipe_sha256(load_recipe(via_base)) != recipe_sha256(first)
    changed = dataclasses.replace(first, seed=first.seed + 1)
    assert recipe_sha256(changed) != recipe_sha256(first)


def test_the_hash_does_not_depend_on_where_the_checkout_is(tmp_path: Path, monkeypatch) -> None:
    hashes = []
    for name in ("one", "two"):
        place = tmp_path / name / "deeper" if name == "two" else tmp_path / name
        place.mkdir(parents=True)
        (place / "model.onnx").write_bytes(b"x")
        recipe = write(place, OWN)
        monkeypatch.chdir(place.parent)
        hashes.append(recipe_sha256(load_recipe(recipe.relative_to(place.parent))))
    assert hashes[0] == hashes[1]
