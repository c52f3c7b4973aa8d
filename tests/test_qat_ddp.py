"""`qtool qat` data-parallel under torchrun: 2 gloo processes with batch B train as one process
with batch 2B, rank 0 alone writes, and --resume continues a distributed run.

The digits example at a tiny size (101 calibration images, distillation, INT8 activations and
4-bit blocked weights with LSQ scales learned for both, SGD, 2 epochs of 4 steps; the last global
batch of 5 splits 3 + 2, so the per-rank loss weights are exercised). One in-process run and two
torchrun launches (the first stops after epoch 1, the second resumes it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qtool.ort.sessions import create_session

REPO = Path(__file__).resolve().parent.parent

RECIPE = """
base: recipe.yaml
calibration: {{max_samples: 101, method: minmax}}
quantization:
  op_types: [Conv, Gemm]
  activations: int8
  weights: {{bits: 4, block_size: 16, method: minmax}}
qat: {{epochs: {epochs}, lr: 0.0001, optimizer: sgd, batch_size: {batch}, learn_scales: true}}
"""


def _recipe(folder: Path, name: str, epochs: int, batch: int) -> Path:
    path = folder / name
    path.write_text(RECIPE.format(epochs=epochs, batch=batch))
    return path


def _torchrun(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "QTOOL_DIST_BACKEND": "gloo"}
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "qtool.cli", "qat", *map(str, args), "--no-progress",
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _outputs(model: Path, feeds: np.ndarray) -> np.ndarray:
    return create_session(model.read_bytes()).run(None, {"image": feeds})[0]


@pytest.fixture(scope="module")
def runs(digits_dir: Path, cli):
    one, two = digits_dir / "ddp-one", digits_dir / "ddp-two"
    single = cli("qat", _recipe(digits_dir, "qat-b32.yaml", 2, 32), "-o", one, "--no-progress")
    assert single.exit_code == 0, single.output
    first = _torchrun(_recipe(digits_dir, "qat-b16-e1.yaml", 1, 16), "-o", two)
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = _torchrun(_recipe(digits_dir, "qat-b16.yaml", 2, 16), "-o", two, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return digits_dir, one, two, first, resumed


def test_two_processes_with_batch_16_train_as_one_with_batch_32(runs):
    _, one, two, _, resumed = runs
    a = json.loads((one / "report.json").read_text())["qat"]
    b = json.loads((two / "report.json").read_text())["qat"]
    assert (a["processes"], b["processes"]) == (1, 2)
    assert a["global_batch_size"] == b["global_batch_size"] == 32
    assert b["resumed_after_epoch"] == 1 and b["epochs"] == 2
    assert b["activation_scales_changed"] > 0 and b["learned_weight_scales"]
    # The same steps on the same global batches, gradients averaged by DDP: equal up to the
    # float rounding of summing two half-batch means instead of one mean (measured: 3e-7
    # relative; a larger lr lets such rounding flip a fake-quant code, and the runs drift apart).
    np.testing.assert_allclose(b["epoch_losses"], a["epoch_losses"], rtol=1e-5)
    model = "model.int4.onnx"
    stored = {
        folder: {
            t.name: numpy_helper.to_array(t) for t in onnx.load(folder / model).graph.initializer
        }
        for folder in (one, two)
    }
    assert stored[one].keys() == stored[two].keys()
    scales = [name for name in stored[one] if name.endswith("_scale")]
    assert len(scales) > 10  # weights (per channel, per block) and activations
    for name, value in stored[one].items():
        if value.dtype == np.float32:  # learned scales and trained biases
            np.testing.assert_allclose(stored[two][name], value, rtol=1e-5, err_msg=name)
        else:  # every 4-bit code and zero point the same
            np.testing.assert_array_equal(stored[two][name], value, err_msg=name)
    # The exported models load in ONNX Runtime and agree on the evaluation images.
    feeds = np.concatenate([b.inputs["image"] for b in _evaluation(runs[0])])
    step = b["equivalence"]["output_step"]
    diff = np.abs(_outputs(two / model, feeds) - _outputs(one / model, feeds)).max()
    assert diff <= 2 * step, (diff, step)
    assert b["accuracy"]["exported_fused"] == pytest.approx(a["accuracy"]["exported_fused"], abs=1)
    assert resumed.stdout.count("trained 2 epochs") == 1  # rank 0 reports, rank 1 does not


def _evaluation(folder: Path):
    from qtool.config.recipe import load_recipe
    from qtool.data.batches import iter_batches

    recipe = load_recipe(folder / "qat-b16.yaml")
    return list(iter_batches(recipe.evaluation.data, recipe.inputs, 64))


def test_rank_0_alone_writes_one_set_of_outputs(runs):
    _, one, two, first, _ = runs
    assert _files(two) == _files(one)  # no per-rank copies, no stray temporary files
    assert (two / "qat" / "epoch-002.pt").is_file()
    # Sharded calibration merges exactly: the stats file is the single-process one.
    assert (two / "stats.npz").read_bytes() == (one / "stats.npz").read_bytes()
    assert "2 processes" in first.stdout


def test_resume_in_another_number_of_processes_is_refused(runs, cli):
    folder, _, two, _, _ = runs
    result = cli("qat", folder / "qat-b16.yaml", "-o", two, "--resume", "--no-progress")
    assert result.exit_code == 2
    assert "checkpoint of a run in 2 processes" in " ".join(result.output.split())


def test_qat_with_stats_reuses_a_calibrate_run_and_writes_the_same_model(runs, cli):
    folder, one, _, _, _ = runs
    recipe = folder / "qat-b32.yaml"
    calibrated = cli("calibrate", recipe, "-o", folder / "cal", "--no-progress")
    assert calibrated.exit_code == 0, calibrated.output
    stats = folder / "cal" / "stats.npz"
    result = cli("qat", recipe, "--stats", stats, "-o", folder / "reuse", "--no-progress")
    assert result.exit_code == 0, result.output
    assert not (folder / "reuse" / "stats.npz").exists()  # read, not written again
    report = json.loads((folder / "reuse" / "report.json").read_text())
    assert report["files"]["stats"] == str(stats)
    assert (folder / "reuse" / "model.int4.onnx").read_bytes() == (
        one / "model.int4.onnx"
    ).read_bytes()
