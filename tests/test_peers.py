"""benchmarks/peers.py without any peer venv: the .npz hand-off, and a whole run on the digits
example with ONNX Runtime's own quantize_static as the stand-in peer (a real subprocess through
the same runner contract, evaluated by qtool's code), plus a runner failure reported, not raised."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import peers
from benchmarks.peer_runners import _handoff

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    sizes = (4, 4, 3)  # the last batch shorter, as a reader may make it
    return [
        {
            "input ids/0": rng.integers(0, 30522, (n, 7), dtype=np.int64),
            "mask.x": rng.standard_normal((n, 2, 3)).astype(np.float32),
        }
        for n in sizes
    ]


def test_calibration_batches_survive_the_npz_hand_off(tmp_path: Path):
    batches = _batches()
    path = tmp_path / "sub" / "calibration.npz"
    _handoff.save_batches(path, batches)
    back = _handoff.load_batches(path)
    assert len(back) == len(batches)
    for original, loaded in zip(batches, back, strict=True):
        assert list(loaded) == list(original)  # input order kept
        for name in original:
            assert loaded[name].dtype == original[name].dtype
            np.testing.assert_array_equal(loaded[name], original[name])
    assert _handoff.sample_count(back) == 11
    singles = _handoff.split_samples(back)
    assert len(singles) == 11 and singles[4]["mask.x"].shape == (1, 2, 3)
    np.testing.assert_array_equal(singles[4]["input ids/0"][0], batches[1]["input ids/0"][0])
    reader = _handoff.BatchReader(back)
    assert reader.get_first() is back[0]
    assert [reader.get_next() is b for b in back] == [True] * 3 and reader.get_next() is None
    reader.rewind()
    assert reader.get_next() is back[0]


def test_batches_with_different_inputs_are_refused(tmp_path: Path):
    batches = _batches()
    batches[1] = {"mask.x": batches[1]["mask.x"]}
    with pytest.raises(ValueError, match="batch 1"):
        _handoff.save_batches(tmp_path / "x.npz", batches)


def test_a_failing_runner_is_a_reason_not_an_exception(tmp_path: Path):
    data = tmp_path / "calibration.npz"
    _handoff.save_batches(data, _batches())
    stand_in = peers.PEERS["ort"]
    with pytest.raises(RuntimeError, match="missing.onnx"):
        peers.run_runner(
            stand_in, Path(sys.executable), tmp_path / "missing.onnx", data, tmp_path, "cnn", 120
        )
    result = json.loads((tmp_path / "runner.json").read_text())
    assert result["status"].startswith("failed: ") and result["calibration_samples"] == 11


def test_digits_against_the_ort_stand_in(tmp_path: Path, capsys):
    out = tmp_path / "peers.json"
    argv = ["--examples", "digits", "--peers", "ort", "--qtool", "first", "--latency-runs", "1"]
    code = peers.main([*argv, "--json", str(out), "--work", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0, [r["status"] for r in report["runs"]]
    qtool_run, ort_run = report["runs"]
    assert qtool_run["quantizer"] == "qtool" and ort_run["quantizer"] == "ort"
    assert ort_run["fp32_sha256"] == qtool_run["fp32_sha256"]  # the same float graph
    assert ort_run["calibration_samples"] == report["examples"]["digits"]["calibration_samples"]
    assert ort_run["settings"]["calibration"] == "MinMax"
    assert peers.version_text(ort_run)  # onnxruntime or onnxruntime-gpu
    assert ort_run["quantize_cpu_s"] > 0 and ort_run["size_bytes"] > 0
    assert ort_run["peak_rss_bytes"] > 10 * 2**20  # sampled from outside while it ran
    for run in (qtool_run, ort_run):
        for variant in ("fused", "unfused"):
            assert run["scores"][variant]["accuracy"] > 0.9
    assert "ORT quantize_static" in printed and "qtool recipe (mse)" in printed
    assert report["versions"]["cpu"]
