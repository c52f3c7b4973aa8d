"""The quantized model names what it was made from, so evaluate can refuse a mixed-up pair."""

from __future__ import annotations

import onnx

from qtool import __version__
from qtool.config.fingerprint import recipe_sha256
from qtool.config.recipe import load_recipe
from qtool.model import provenance


def test_quantized_model_carries_its_provenance(digits_run) -> None:
    out = digits_run.out
    stamped = provenance.read(onnx.load(str(out / "model.int8.onnx")))
    assert set(stamped) == set(provenance.KEYS)
    assert stamped[provenance.VERSION] == __version__
    assert stamped[provenance.FLOAT_MODEL_SHA256] == provenance.sha256_file(out / "model.fp32.onnx")
    # the resolved recipe (presets merged), not the file's bytes (docs/recipe.md)
    assert stamped[provenance.RECIPE_SHA256] == recipe_sha256(load_recipe(digits_run.recipe))
    weights = provenance.sha256_file(digits_run.folder / "weights.pt")
    assert stamped[provenance.SOURCE_MODEL_SHA256] != weights  # factory and weights together
    assert len(stamped[provenance.CALIBRATION_DATA_SHA256]) == 64


def test_calibration_fingerprint_ignores_batch_size_but_not_data(digits_run, cli, tmp_path):
    recipe = digits_run.recipe.read_text()
    fingerprints = []
    for name, text in (
        ("batch1", recipe.replace("batch_size: 32", "batch_size: 1")),
        ("fewer", recipe.replace("max_samples: 512", "max_samples: 500")),
    ):
        folder = tmp_path / name
        folder.mkdir()
        path = digits_run.folder / f"recipe-{name}.yaml"
        path.write_text(text)
        result = cli("quantize", path, "-o", folder, "--no-progress")
        assert result.exit_code == 0, result.output
        model = onnx.load(str(folder / "model.int8.onnx"))
        fingerprints.append(provenance.read(model)[provenance.CALIBRATION_DATA_SHA256])
    original = provenance.read(onnx.load(str(digits_run.out / "model.int8.onnx")))
    assert fingerprints[0] == original[provenance.CALIBRATION_DATA_SHA256]
    assert fingerprints[1] != original[provenance.CALIBRATION_DATA_SHA256]
