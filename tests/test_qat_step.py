"""The baseline of tests/gpu/test_qat_cuda.py's tolerances, wherever the tests run: one QAT step
of the fake-quantized digits CNN with oneDNN's convolutions and with torch's own (two correct
float32 summation orders, as the CPU's and cuDNN's are) lands within the tolerances the CUDA
step is held to, and a repeat of the same step is bit-identical."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parent / "gpu" / "qat_step.py"
_SPEC = importlib.util.spec_from_file_location("qtool_cpu_qat_step", _PATH)
step = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(step)


@pytest.mark.parametrize("loss_name", ["distillation", "cross_entropy"])
@pytest.mark.parametrize("learn", [False, True], ids=["fixed-scales", "learned-scales"])
def test_two_cpu_convolutions_step_within_the_cuda_tolerances(learn: bool, loss_name: str) -> None:
    onednn = step.one_step("cpu", learn, loss_name)
    with torch.backends.mkldnn.flags(enabled=False):
        native = step.one_step("cpu", learn, loss_name)
    diff = step.compare(onednn, native)
    step.check_close(diff)
    # the two are really different computations (else this baseline would prove nothing)
    assert diff["worst_update_rel_diff"] > 0.0


def test_the_same_step_twice_is_bit_identical() -> None:
    a, b = step.one_step("cpu", True, "distillation"), step.one_step("cpu", True, "distillation")
    assert a["loss"] == b["loss"]
    assert all(torch.equal(a["after"][n], b["after"][n]) for n in a["after"])
