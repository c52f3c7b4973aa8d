"""benchmarks/accuracy.py's run plan (which method x algorithm cells run, which are n/a) and
benchmarks/peers.py's memory cap, without quantizing anything: a wrong plan silently drops or
mislabels rows of the README's tables, and a missing cap lets a peer take a shared machine down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import accuracy, peers

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_every_example_has_a_kind_and_a_recipe():
    assert set(accuracy.KINDS) == set(accuracy.EXAMPLES)
    for recipe in accuracy.EXAMPLES.values():
        assert recipe.is_file(), recipe
    # every peers example is an accuracy example of the same kind
    for example in peers.QTOOL_RUNS:
        assert peers.KINDS[example] == accuracy.KINDS[example]


def test_default_algorithm_sets_follow_the_kind():
    cnn = accuracy.default_algorithm_sets("cnn")
    assert cnn[0] == ()
    assert ("cross_layer_equalization",) in cnn and ("bias_correction",) in cnn
    assert ("adaround",) in cnn
    assert cnn[-1] == ("cross_layer_equalization", "adaround", "bias_correction")  # run order
    assert all("smoothquant" not in s for s in cnn)
    assert accuracy.default_algorithm_sets("transformer") == [(), ("smoothquant",)]


def test_explicit_algorithm_sets_apply_to_every_example():
    args = accuracy.parse_args(["--algorithms", "none,adaround+cross_layer_equalization"])
    want = [(), ("cross_layer_equalization", "adaround")]
    assert accuracy.algorithm_sets("minilm", args) == want
    assert accuracy.algorithm_sets("digits", args) == want
    default = accuracy.parse_args([])
    assert accuracy.algorithm_sets("minilm_tables", default) == [(), ("smoothquant",)]


def test_smoothquant_with_another_method_is_not_applicable(tmp_path: Path):
    assert accuracy.unsupported("minmax", ("smoothquant",)) is None
    assert accuracy.unsupported("entropy", ()) is None
    reason = accuracy.unsupported("mse", ("smoothquant",))
    assert reason is not None and reason.startswith("n/a")
    run = accuracy.run_qtool_set("minilm", "mse", ("smoothquant",), None, tmp_path, None)
    assert run["status"] == reason  # refused before anything is loaded or quantized


def test_ort_percentile_on_effnet_is_skipped_not_run(tmp_path: Path):
    run = accuracy.run_ort_method("effnet_lite", "percentile", None, None, tmp_path, None)
    assert run["status"].startswith("n/a") and "memory" in run["status"]
    assert accuracy.run_ort_method("digits", "mse", None, None, tmp_path, None)["status"] == (
        "n/a: ORT has no mse calibrator"
    )


def test_a_peer_past_the_memory_cap_is_killed_and_reported():
    grow = "import time; x = bytearray(400 * 2**20); time.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", grow])
    with pytest.raises(RuntimeError, match="resident memory"):
        peers.wait_capped(process, timeout=60, max_rss=100 * 2**20, poll=0.05)
    assert process.returncode is not None  # killed, reaped


def test_a_peer_within_the_cap_reports_its_peak():
    process = subprocess.Popen(
        [sys.executable, "-c", "x = bytearray(50 * 2**20); import time; time.sleep(0.5)"]
    )
    peak = peers.wait_capped(process, timeout=60, max_rss=2**34, poll=0.05)
    assert process.returncode == 0 and peak > 40 * 2**20


def test_a_short_peak_between_samples_is_still_reported():
    """The sampler reads the high-water mark: a 200 MB peak freed long before the next sample."""
    brief = "import time; time.sleep(1.2); x = b'1' * (200 * 2**20); del x; time.sleep(1.5)"
    process = subprocess.Popen([sys.executable, "-c", brief])
    peak = peers.wait_capped(process, timeout=60, max_rss=2**34, poll=1.0)
    assert process.returncode == 0 and peak > 180 * 2**20


def _run(method: str, quantizer: str, algorithms: list[str], **extra) -> dict:
    scores = {
        v: {"accuracy": None, "agreement": 0.9, "cosine": 0.99735, "sqnr_db": 22.8}
        for v in ("fused", "unfused")
    }
    run = {"example": "minilm", "method": method, "quantizer": quantizer}
    run.update(algorithms=algorithms, status="ok", scores=scores, size_bytes=23_500_000)
    run.update(quantize_s=40.0, quantize_cpu_s=27.3, **extra)
    return run


def test_markdown_tables_keep_one_cell_per_score_and_name_the_cpu():
    fp32 = {"accuracy": None, "size_bytes": 90_400_000, "samples": 98, "labels": False}
    report = {
        "versions": {"cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512_vnni"], "cpu_count": 2},
        "examples": {"minilm": {}},
        "runs": [
            _run("minmax", "qtool", ["smoothquant"], fp32=fp32),
            {
                "example": "minilm",
                "method": "mse",
                "quantizer": "qtool",
                "algorithms": [],
                "status": "n/a: smoothquant needs minmax ranges",
            },
        ],
    }
    text = accuracy.markdown_tables(report)
    assert "AMD EPYC (avx2, avx512_vnni)" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    widths = {ln.replace("\\|", "").count("|") for ln in rows}
    assert len(widths) == 1  # header, rule, FP32, a scored row and an n/a row: same columns
    assert "| minmax | qtool SmoothQuant | " in text and "0.99735 \\| 0.99735" in text
    assert "| 23.50 | 27.3 |" in text and "| 90.40 |" in text  # MB above 10 MB of FP32
    assert "n/a: smoothquant needs minmax ranges" in text


def test_a_rejected_algorithm_is_named_so_in_the_table(tmp_path: Path):
    report = {
        "algorithms": {
            "cross_layer_equalization": {"pairs": [{"first": "a", "second": "b"}]},
            "adaround": {"applied": False, "reason": "raised the held-out error"},
            "bias_correction": {"applied": True},
        }
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    outcomes = accuracy.algorithm_outcomes(tmp_path / "report.json")
    assert outcomes == {
        "cross_layer_equalization": True,
        "adaround": False,
        "bias_correction": True,
    }
    assert accuracy.algorithm_outcomes(tmp_path / "missing.json") == {}
    names = ("cross_layer_equalization", "adaround", "bias_correction")
    assert accuracy.short_label(names, outcomes) == "CLE + AdaRound (rejected) + BC"
    run = {"quantizer": "qtool", "algorithms": list(names), "model": str(tmp_path / "m.onnx")}
    assert accuracy._quantizer(run) == "qtool CLE + AdaRound (rejected) + BC"  # read from report
    assert accuracy._quantizer({**run, "applied": {}}) == "qtool CLE + AdaRound + BC"


def test_runs_are_scored_against_the_float_model_without_algorithms(tmp_path: Path):
    """A run whose algorithms changed the float model (CLE) is scored against the original,
    and says so; one whose float model is the original is scored as it is."""
    from qtool.config.recipe import load_recipe

    recipe = load_recipe(accuracy.EXAMPLES["digits"], output_dir=tmp_path / "out")
    original = accuracy.original_float_model(recipe, tmp_path / "original.fp32.onnx")
    same, changed = tmp_path / "same.onnx", tmp_path / "changed.onnx"
    same.write_bytes(original.read_bytes())
    changed.write_bytes(original.read_bytes() + b"\x00")  # any other bytes
    run: dict = {}
    assert accuracy.score_against(run, same, original) == (original, False)
    assert run["float_model_changed"] is False
    assert accuracy.score_against(run, changed, original) == (original, True)
    assert run["float_model_changed"] is True and run["own_fp32_model"] == str(changed)
    assert accuracy.score_against({}, changed, None) == (changed, False)
