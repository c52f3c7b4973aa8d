"""NCCL under torchrun, one rank per visible GPU: the same launcher and collectives that the gloo
tests run on the CPU (tests/test_distributed.py, tests/test_qat_ddp.py), on the device backend.

Calibration statistics travel through NCCL as CUDA tensors; the merge must still give the
single-process stats file byte for byte. QAT trains each rank on its GPU and rank 0 writes a
model that ONNX Runtime runs as the fake-quant model computed. A machine with one GPU runs a
world of one (NCCL still initialises and every collective still runs); with several, one rank
per device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
    reason="torch here has no CUDA device or no NCCL",
)


def _torchrun(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "QTOOL_DIST_BACKEND": "nccl"}
    env.pop("WORLD_SIZE", None)
    ranks = str(torch.cuda.device_count())
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", ranks,
        "-m", "qtool.cli", *map(str, args), "--no-progress",
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_nccl_calibration_writes_the_single_process_stats_file(digits_run, tmp_path):
    out = tmp_path / "out"
    done = _torchrun("calibrate", digits_run.recipe, "-o", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "stats.npz").read_bytes() == (digits_run.out / "stats.npz").read_bytes()


def test_nccl_qat_exports_the_model_it_trained(digits_dir, tmp_path):
    recipe = digits_dir / "nccl-qat.yaml"
    recipe.write_text(
        "base: recipe.yaml\n"
        "calibration: {max_samples: 101, method: minmax}\n"
        "quantization: {op_types: [Conv, Gemm]}\n"
        "qat: {epochs: 1, lr: 0.0001, optimizer: sgd, batch_size: 16}\n"
    )
    out = tmp_path / "qat"
    done = _torchrun("qat", recipe, "-o", out)
    assert done.returncode == 0, done.stdout + done.stderr
    block = json.loads((out / "report.json").read_text())["qat"]
    assert block["processes"] == torch.cuda.device_count()
    same = block["equivalence"]
    assert same["max_abs_diff_fused"] <= same["output_step"]
