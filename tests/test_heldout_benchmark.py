"""benchmarks/heldout.py's parts that decide what is measured: which presets run, the recipe a
`+tuning-data` row writes, and the held-out texts' sentence filter (benchmarks/heldout_texts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks import heldout, heldout_texts


def test_only_cpu_presets_are_rows():
    names = heldout.cpu_presets()
    assert "int8-transformer" in names and "int8" in names
    assert not [n for n in names if "tensorrt" in n]  # FP8/FP16 types this CPU does not run


def test_a_tuning_data_row_names_the_cases_third_source(tmp_path):
    case = heldout.cases(tmp_path)["swin"]
    rows = heldout.qtool_rows(case)
    entry = tmp_path / "entry.py"
    text = heldout.recipe_text(case, rows["int8-transformer+tuning-data"], tmp_path / "o", entry)
    recipe = yaml.safe_load(text)
    assert recipe["base"] == "int8-transformer"
    assert recipe["tuning"] == {"data": {"python": f"{entry}:swin_tuning"}}
    assert recipe["calibration"]["data"] == {"python": f"{entry}:swin_calibration"}
    # The row's own settings are not changed by writing a recipe from them.
    assert rows["int8-transformer+tuning-data"]["tuning"] == {"data": "TUNING"}
    plain = yaml.safe_load(heldout.recipe_text(case, rows["minmax"], tmp_path / "o", entry))
    assert "tuning" not in plain and plain["calibration"]["method"] == "minmax"


def test_sentences_keep_prose_and_drop_markup():
    text = (
        "Title\n=====\n\nThis sentence has more than six words in it. Short one.\n"
        ":param x: a field line that must not glue into a sentence\n\n"
        "Another paragraph that is long enough to be kept as prose here!\n"
    )
    assert heldout_texts.sentences(text) == [
        "This sentence has more than six words in it.",
        "Another paragraph that is long enough to be kept as prose here!",
    ]


def test_held_out_sources_are_disjoint_from_the_calibration_text():
    calibration = set(
        Path(heldout.REPO / "examples" / "minilm" / "sentences.txt").read_text().splitlines()
    )
    texts = heldout_texts.heldout_sentences(per_source=16)
    assert set(texts) == set(heldout_texts.SOURCES)
    for sentences in texts.values():
        assert len(sentences) == 16 and not calibration & set(sentences)


@pytest.mark.skipif(
    not heldout_texts.FORTUNES.is_dir(),
    reason=f"the tuning source {heldout_texts.FORTUNES} is absent (apt-get install fortunes)",
)
def test_the_tuning_source_is_disjoint_from_the_calibration_text():
    calibration = set(
        Path(heldout.REPO / "examples" / "minilm" / "sentences.txt").read_text().splitlines()
    )
    tuning = heldout_texts.tuning_sentences(16)
    assert len(tuning) == 16 and not calibration & set(tuning)
    assert not set(tuning) & {s for v in heldout_texts.heldout_sentences(16).values() for s in v}
