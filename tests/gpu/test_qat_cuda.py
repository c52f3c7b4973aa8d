"""One QAT step on CUDA against the same step on the CPU: the examples/digits CNN (its trained
weights, real scikit-learn digits), fake-quantized as `qtool qat` does it (per-channel int8
weights in the writer's stored form, uint8 activations at every module output and the input;
with learned scales, fc1 as a 4-bit blocked weight with LSQ scales), then forward + backward +
one SGD step with the same seed and batch on "cpu" and on "cuda".

The two cannot agree bit for bit: cuDNN and cuBLAS add the products of a convolution or a matrix
product in other orders than the CPU's kernels, so activations differ by float32 rounding
(relative ~1e-7). Fake quantization then rounds x / s: where a value lies within that rounding of
a .5 boundary the two devices round it to neighbouring levels, one quantization step apart, and
that step travels through the rest of the network; LSQ's scale gradients are sums of such terms
that largely cancel, so they are compared by where the scale ends up, not by their update. How
far apart two correct steps end up was measured on the CPU, with no GPU: the same step with
oneDNN's convolutions against torch's own (another correct float32 summation order) differs by
2.5e-6 in the loss, 2.2e-4 in the worst update, and in 2 of 640 logits by one step after it.
The tolerances are about ten times that, far under what a real error gives: TF32 instead of
float32, a lost fake quantizer, a wrong rounding or a missing straight-through gradient are 1e-3
to 1e0 apart.

`deterministic` (qtool/qat/train.py) switches TF32 off for cuDNN and cuBLAS; without it the
convolutions alone would be ~1e-3 apart. When QTOOL_GPU_RESULTS names a folder (tests/gpu/run.sh),
the measured differences are written there as qat_step.json. The step itself lives in
tests/gpu/qat_step.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qtool.qat.train import deterministic  # noqa: E402


def _helpers():
    """tests/gpu/qat_step.py, loaded by path (no `tests` package to import it through)."""
    path = Path(__file__).resolve().parent / "qat_step.py"
    spec = importlib.util.spec_from_file_location("qtool_gpu_qat_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step = _helpers()

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@cuda_only
@pytest.mark.parametrize("loss_name", ["distillation", "cross_entropy"])
@pytest.mark.parametrize("learn", [False, True], ids=["fixed-scales", "learned-scales"])
def test_one_qat_step_on_cuda_matches_the_cpu_step(learn: bool, loss_name: str) -> None:
    cpu = step.one_step("cpu", learn, loss_name)
    gpu = step.one_step("cuda", learn, loss_name)
    diff = step.compare(cpu, gpu)
    step.record(f"{loss_name}/{'learned' if learn else 'fixed'}", diff)
    assert sorted(gpu["grads"]) == sorted(cpu["grads"])
    step.check_close(diff)
    # the trained module exports the same learned 4-bit scales from either device
    for name, scale in cpu["learned_scales"].items():
        np.testing.assert_allclose(gpu["learned_scales"][name], scale, rtol=1e-5)


@cuda_only
def test_deterministic_turns_tf32_off_and_restores_it() -> None:
    before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    with deterministic(0):
        assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cuda.matmul.allow_tf32 is False
        conv = getattr(torch.backends.cudnn, "conv", None)
        if conv is not None and hasattr(conv, "fp32_precision"):  # torch >= 2.9 agrees
            assert conv.fp32_precision != "tf32"
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == before
