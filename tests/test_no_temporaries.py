"""No temporary file survives any exit path of any command (issue 21, item 3).

Each command is made to fail late, after its outputs were staged beside their targets: a stage
near the end raises a QtoolError (exit 2) or KeyboardInterrupt (Ctrl-C, exit 130). Then no
qtool temporary may be left in any folder (the outputs', the source's, the system temporary
folder), and no output may exist that the failed run wrote. The model is stored with external
data under a lowered threshold, so both models really are staged as files before the commit
(the path a 2 GB model takes); one inline case covers the float model staged for calibration.
A Ctrl-C between two renames of the commit itself leaves the previous outputs as they were.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.model import external_data

FEATURES, HIDDEN, CLASSES = 64, 256, 10
LIMIT = 64 << 10  # the ~340 KB float model and its ~85 KB int8 version both go to external data


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> TensorProto:
        values = rng.standard_normal(shape) / np.sqrt(shape[0])
        return numpy_helper.from_array(values.astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="/fc1/MatMul"),
        helper.make_node("Relu", ["h1"], ["a1"], name="/act1/Relu"),
        helper.make_node("MatMul", ["a1", "w2"], ["h2"], name="/fc2/MatMul"),
        helper.make_node("Relu", ["h2"], ["a2"], name="/act2/Relu"),
        helper.make_node("Gemm", ["a2", "w3"], ["logits"], name="/head/Gemm"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        [weight("w1", FEATURES, HIDDEN), weight("w2", HIDDEN, HIDDEN), weight("w3", HIDDEN, 10)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch) -> Path:
    """The system temporary folder of this test: checked to be empty at the end."""
    folder = tmp_path / "system-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _case(folder: Path) -> Path:
    """The MLP with its weights in source.onnx.data, calibration and evaluation data, a recipe."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(_mlp(), str(folder / "source.onnx"), save_as_external_data=True)
    x = np.random.default_rng(1).standard_normal((64, FEATURES)).astype(np.float32)
    np.savez(folder / "data.npz", x=x)
    recipe = {
        "model": {"onnx": "source.onnx"},
        "inputs": {"x": [1, FEATURES]},
        "calibration": {"data": {"npz": "data.npz"}, "batch_size": 16, "method": "minmax"},
        "evaluation": {"data": {"npz": "data.npz"}, "batch_size": 32, "min_sqnr": 10.0},
        "output": {"dir": "out"},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def temporaries(*folders: Path) -> list[str]:
    """Every qtool temporary (file or folder) under `folders`: `.name.qtoolPID.xxxxxxxx.tmp`
    beside an output, `qtool-*` folders in the system temporary folder, any `*.tmp`."""
    found = []
    for folder in folders:
        if not folder.exists():
            continue
        for path in folder.rglob("*"):
            if ".qtool" in path.name or path.name.startswith("qtool-") or path.suffix == ".tmp":
                found.append(str(path.relative_to(folder)))
    return sorted(found)


def _files(folder: Path) -> dict[str, bytes]:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _raise(exc: BaseException):
    def fail(*_args, **_kwargs):
        raise exc

    return fail


FAILURES = {
    "error": (QtoolError("failed on purpose"), 2),
    "ctrl-c": (KeyboardInterrupt(), 130),
}


def _check_failed(result, expected_code: int) -> None:
    assert result.exit_code == expected_code, (result.exit_code, result.output)
    if expected_code == 2:
        assert result.stderr.strip().splitlines()[-1] == "error: failed on purpose"


# Each command, its arguments after the recipe, a stage near its end that runs after its
# outputs were staged (the float model by calibration, the quantized one by finish), and whether
# the model is stored as external data (mixed precision refuses that: it runs inline).
LATE_STAGES = {
    "calibrate": (["calibrate"], "qtool.app.calibrate.commit_files", True),
    "quantize": (["quantize"], "qtool.pipeline.finish.verify", True),
    "quantize-report": (["quantize"], "qtool.app.quantize.report_bytes", True),
    "quantize-auto": (["quantize", "--auto"], "qtool.app.quantize.report_bytes", False),
    "analyze": (
        ["analyze", "--mode", "one-at-a-time", "--samples", "32"],
        "qtool.app.analyze.plot_png",
        False,
    ),
}
# What a failed run keeps by design, each file whole: `analyze` and `quantize --auto` commit
# their calibration (what `qtool calibrate` writes) before they analyse, so one pass serves every
# variant and the next run, and the analysis cache after each variant, so a rerun measures only
# what is missing.
KEPT = {
    "analyze": ["analysis-cache/*.json", "model.fp32.onnx", "stats.npz"],
    "quantize-auto": ["analysis-cache/*.json", "model.fp32.onnx", "stats.npz"],
}


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("command", LATE_STAGES)
def test_a_late_failure_leaves_no_temporaries_and_no_outputs(
    tmp_path, scratch, cli, monkeypatch, command, failure
) -> None:
    recipe = _case(tmp_path / "case")
    args, target, external = LATE_STAGES[command]
    if external:
        monkeypatch.setattr(external_data, "EXTERNAL_DATA_THRESHOLD", LIMIT)
    exc, code = FAILURES[failure]
    monkeypatch.setattr(target, _raise(exc))
    result = cli(args[0], recipe, *args[1:], "--no-progress")
    _check_failed(result, code)
    assert temporaries(tmp_path) == []
    left = sorted(_files(tmp_path / "case" / "out"))
    kept = KEPT.get(command, [])
    assert len(left) == len(kept) and all(map(fnmatch.fnmatch, left, kept)), left


def test_the_inline_float_model_staged_for_calibration_is_removed(
    tmp_path, scratch, cli, monkeypatch
) -> None:
    """Under the real limit the float model is inline, staged as model.fp32.onnx's temporary
    while ONNX Runtime calibrates (FloatModel.release): a failure after it removes it."""
    recipe = _case(tmp_path / "case")
    staged: list[Path] = []
    from qtool.io import Staged

    real_discard = Staged.discard

    def discard(self) -> None:
        staged.append(self.path)
        real_discard(self)

    monkeypatch.setattr(Staged, "discard", discard)
    monkeypatch.setattr("qtool.pipeline.finish.verify", _raise(KeyboardInterrupt()))
    result = cli("quantize", recipe, "--no-progress")
    _check_failed(result, 130)
    assert any(p.name.startswith(".model.fp32.onnx.qtool") for p in staged), staged
    assert temporaries(tmp_path) == []
    assert _files(tmp_path / "case" / "out") == {}


@pytest.fixture
def quantized(tmp_path, cli) -> Path:
    recipe = _case(tmp_path / "case")
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    return recipe


@pytest.mark.parametrize("failure", FAILURES)
def test_evaluate_writes_both_reports_or_neither(
    quantized, tmp_path, scratch, cli, monkeypatch, failure
) -> None:
    reports = tmp_path / "reports"
    exc, code = FAILURES[failure]
    monkeypatch.setattr("qtool.app.evaluate.junit_xml", _raise(exc))  # after the JSON is made
    args = ["--json", reports / "eval.json", "--junit", reports / "eval.xml", "--latency-runs", "1"]
    result = cli("evaluate", quantized, *args, "--no-progress")
    _check_failed(result, code)
    assert _files(reports) == {}
    assert temporaries(tmp_path) == []


def _interrupt_rename(monkeypatch, name: str) -> list[str]:
    """Ctrl-C as os.replace renames a temporary into `name`: after the renames before it."""
    real = os.replace
    renamed: list[str] = []

    def replace(src, dst):
        if Path(dst).name == name and ".qtool" in Path(src).name:
            raise KeyboardInterrupt
        renamed.append(Path(dst).name)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return renamed


def test_ctrl_c_between_the_commits_renames_keeps_the_previous_outputs(
    quantized, tmp_path, scratch, cli, monkeypatch
) -> None:
    out = tmp_path / "case" / "out"
    before = _files(out)
    assert "report.json" in before
    renamed = _interrupt_rename(monkeypatch, "report.json")
    result = cli("quantize", quantized, "--no-progress")
    _check_failed(result, 130)
    assert "model.int8.onnx" in renamed  # a file was replaced before the interrupt: restored
    assert _files(out) == before
    assert temporaries(tmp_path) == []


def test_evaluate_ctrl_c_between_its_two_reports(
    quantized, tmp_path, scratch, cli, monkeypatch
) -> None:
    reports = tmp_path / "reports"
    _interrupt_rename(monkeypatch, "eval.xml")
    args = ["--json", reports / "eval.json", "--junit", reports / "eval.xml", "--latency-runs", "1"]
    result = cli("evaluate", quantized, *args, "--no-progress")
    _check_failed(result, 130)
    assert _files(reports) == {}
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("failure", FAILURES)
def test_stats_merge_failures(tmp_path, scratch, cli, monkeypatch, failure) -> None:
    recipe = _case(tmp_path / "case")
    shards = []
    for index in range(2):
        out = tmp_path / f"shard{index}"
        result = cli("calibrate", recipe, "-o", out, "--shard", f"{index}/2", "--no-progress")
        assert result.exit_code == 0, result.output
        shards.append(out / "stats.npz")
    merged = tmp_path / "merged" / "stats.npz"
    exc, code = FAILURES[failure]
    monkeypatch.setattr("qtool.calibration.merge.merge_stats", _raise(exc))
    _check_failed(cli("stats", "merge", *shards, "-o", merged), code)
    assert _files(merged.parent) == {}
    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    merged.parent.mkdir()
    merged.write_bytes(b"the previous merge")
    _interrupt_rename(monkeypatch, "stats.npz")
    _check_failed(cli("stats", "merge", *shards, "-o", merged), 130)
    assert _files(merged.parent) == {"stats.npz": b"the previous merge"}
    assert temporaries(tmp_path) == []


QAT_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    """
)


@pytest.mark.parametrize("failure", FAILURES)
def test_qat_late_failure(tmp_path, scratch, cli, monkeypatch, failure) -> None:
    """After training and the staged export, the check against the fake-quant model fails:
    the model files are gone; the epoch checkpoints stay (they are what --resume reads)."""
    folder = tmp_path / "case"
    _case(folder)
    (folder / "net.py").write_text(QAT_MODEL)
    recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
    recipe["model"] = {"pytorch": "net.py:make"}
    recipe["qat"] = {"epochs": 1, "batch_size": 32, "lr": 0.001}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setattr(external_data, "EXTERNAL_DATA_THRESHOLD", LIMIT)
    exc, code = FAILURES[failure]
    monkeypatch.setattr("qtool.qat.export.ort_outputs", _raise(exc))
    result = cli("qat", folder / "recipe.yaml", "--no-progress")
    _check_failed(result, code)
    assert temporaries(tmp_path) == []
    left = sorted(_files(folder / "out"))
    assert left and all(name.startswith("qat/") for name in left), left


def test_a_staged_file_dropped_uncommitted_goes_with_its_handle(tmp_path) -> None:
    """A run that fails between staging an output (the Hessian file, hundreds of MB on a
    decoder) and the commit drops its handle: the temporary goes with it; a committed one stays."""
    import gc

    from qtool.io import commit_files, stage

    dropped = stage(tmp_path / "hessians.npz", lambda handle: handle.write(b"x"))
    temporary = dropped.path
    assert temporary.is_file()
    del dropped
    gc.collect()
    assert not temporary.exists()
    kept = stage(tmp_path / "stats.npz", lambda handle: handle.write(b"y"))
    commit_files({tmp_path / "stats.npz": kept})
    del kept
    gc.collect()
    assert (tmp_path / "stats.npz").read_bytes() == b"y" and temporaries(tmp_path) == []
