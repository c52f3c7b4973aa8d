"""One QAT step of the examples/digits CNN, fake-quantized as `qtool qat` does it, on a given
device, and how far two such steps land apart. Shared by tests/gpu/test_qat_cuda.py (CUDA against
the CPU) and tests/test_qat_step.py (two CPU convolution implementations: the baseline the CUDA
tolerances come from, checked wherever the tests run).

Why two correct steps differ at all, and why the tolerances are what they are: see
tests/gpu/test_qat_cuda.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import torch

from qtool.qat.instrument import FakeQuantModel
from qtool.qat.mapping import Site
from qtool.qat.train import deterministic, make_loss, make_optimizer, train_step
from qtool.write import int4
from qtool.write.params import activation_params, quantize_weight

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"
BATCH = 64
LR = 0.01
SEED = 0
# Tolerances of the CUDA step against the CPU step (see tests/gpu/test_qat_cuda.py). Measured
# CPU against CPU with oneDNN's and torch's own convolutions: loss 2.5e-6, moved 2.8e-6, update
# 2.2e-4, logits 2 of 640 one step apart.
LOSS_RTOL = 1e-4  # |loss_cuda - loss_cpu| / |loss_cpu|
MOVED_RTOL = 1e-4  # max |p_cuda - p_cpu| after the step / max |p| before, every parameter tensor
UPDATE_RTOL = 2e-3  # ||update_cuda - update_cpu|| / ||update_cpu||, weights and biases
LOGITS_STEPS = 1.001  # logits after the step: at most one quantization step apart ...
LOGITS_SHARE = 0.02  # ... on at most this share of them

# (tensor name, module path or None for the graph input): what activation_sites gives for the
# digits CNN's exported graph (relu2's output is the pool's input, both quantized).
SITES = [
    Site("image", None, 0),
    Site("relu1_out", "relu1"),
    Site("relu2_out", "relu2"),
    Site("pool_out", "pool"),
    Site("relu3_out", "relu3"),
    Site("relu4_out", "relu4"),
    Site("logits", "fc2"),
]
WEIGHTS = ["conv1.weight", "conv2.weight", "conv3.weight", "fc1.weight", "fc2.weight"]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _net() -> torch.nn.Module:
    net = _load(DIGITS / "model.py", "digits_model").make_model()
    net.load_state_dict(torch.load(DIGITS / "weights.pt", map_location="cpu", weights_only=True))
    return net.eval()


def digits_batches() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(calibration images, one training batch, its labels) from the example's training split."""
    x_train, _, y_train, _ = _load(DIGITS / "data.py", "digits_data").load_split()
    return x_train[:256], x_train[256 : 256 + BATCH], y_train[256 : 256 + BATCH]


def _activation_ranges(net: torch.nn.Module, images: np.ndarray) -> dict:
    """Min/max calibration of every site on the calibration images (float model)."""
    seen: dict[str, np.ndarray] = {"image": images}
    hooks = [
        net.get_submodule(site.module).register_forward_hook(
            lambda _m, _i, out, name=site.tensor: seen.__setitem__(name, out.detach().numpy())
        )
        for site in SITES
        if site.module is not None
    ]
    with torch.no_grad():
        net(torch.from_numpy(images))
    for hook in hooks:
        hook.remove()
    return {
        name: activation_params(float(v.min()), float(v.max()), symmetric=False)
        for name, v in seen.items()
    }


def _store_int8(w: np.ndarray):
    return quantize_weight(w, axis=0)


def _store_int4(w: np.ndarray):
    """fc1 as qtool writes a Linear's 4-bit weight: the transpose (MatMul's [K, N]) in blocks of
    32 along K, MSE-searched scales."""
    return int4.quantize_blockwise(np.ascontiguousarray(w.T), block_size=32, method="mse")


def build_fake(learn: bool, ranges: dict) -> FakeQuantModel:
    """The fake-quant digits CNN, on the CPU; identical on every call."""
    net = _net()
    stores = {name: (_store_int8, False) for name in WEIGHTS}
    learned = frozenset()
    if learn:
        stores["fc1.weight"] = (_store_int4, True)
        learned = frozenset({"fc1.weight"})
    return FakeQuantModel(net, SITES, ranges, stores, learn, learned)


def one_step(device: str, learn: bool, loss_name: str) -> dict:
    """Loss, parameters before and after, and the gradients of one step on `device`."""
    calibration, batch, labels = digits_batches()
    ranges = _activation_ranges(_net(), calibration)
    fake = build_fake(learn, ranges)
    if loss_name == "distillation":  # qat's default: MSE to the float model's outputs
        with torch.no_grad():
            targets = [_net()(torch.from_numpy(batch)).numpy()]
        loss_fn, _ = make_loss(None, distill=True)
    else:
        targets = labels
        loss_fn, _ = make_loss("cross_entropy", distill=False)
    before = {n: p.detach().clone() for n, p in fake.named_parameters()}
    with deterministic(SEED):
        fake.to(device).train()
        parameters = [p for p in fake.parameters() if p.requires_grad]
        optimizer = make_optimizer(parameters, "sgd", LR)
        loss = train_step(fake, optimizer, loss_fn, [batch], targets, device=device)
        fake.eval()
        with torch.no_grad():
            logits = fake(torch.from_numpy(batch).to(device)).cpu()
        learned = {k: v.scale for k, v in fake.learned_weights().items()}
        logits_step = fake.quantizers["logits"].scale.detach().cpu()
    after = {n: p.detach().cpu() for n, p in fake.named_parameters()}
    grads = {n: p.grad.detach().cpu() for n, p in fake.named_parameters() if p.grad is not None}
    return {
        "loss": loss, "before": before, "after": after, "grads": grads, "logits": logits,
        "learned_scales": learned, "logits_step": logits_step,
    }  # fmt: skip


def compare(a: dict, b: dict) -> dict:
    """How far step b landed from step a: the losses; per parameter tensor, the largest
    difference after the step relative to the tensor's largest value, and for weights and biases
    the difference of the two updates relative to a's update; the logits after the step in
    quantization steps of the logits' fake quantizer."""
    moved, updates = {}, {}
    for name, before in a["before"].items():
        scale = float(before.abs().max()) or 1.0
        moved[name] = float((a["after"][name] - b["after"][name]).abs().max()) / scale
        if "scale" in name:  # LSQ step sizes: their gradients cancel, compared by `moved`
            continue
        ua = (a["after"][name] - before).double()
        ub = (b["after"][name] - before).double()
        updates[name] = float((ub - ua).norm()) / max(float(ua.norm()), 1e-30)
    step = float(a["logits_step"])
    logits = (a["logits"] - b["logits"]).abs()
    return {
        "loss_a": a["loss"],
        "loss_b": b["loss"],
        "loss_rel_diff": abs(a["loss"] - b["loss"]) / abs(a["loss"]),
        "moved_rel_diff": moved,
        "worst_moved_rel_diff": max(moved.values()),
        "update_rel_diff": updates,
        "worst_update_rel_diff": max(updates.values()),
        "logits_max_diff_steps": float(logits.max()) / step,
        "logits_differing": int((logits > 0).sum()),
        "logits_total": int(logits.numel()),
        "unchanged_by_a": sorted(n for n in a["before"] if torch.equal(a["after"][n],
                                                                        a["before"][n])),
    }  # fmt: skip


def check_close(diff: dict) -> None:
    """The tolerances above, on a `compare` result; every weight and bias must have moved."""
    assert not [n for n in diff["unchanged_by_a"] if "scale" not in n], diff["unchanged_by_a"]
    assert diff["loss_rel_diff"] <= LOSS_RTOL, diff
    assert diff["worst_moved_rel_diff"] <= MOVED_RTOL, diff
    assert diff["worst_update_rel_diff"] <= UPDATE_RTOL, diff
    assert diff["logits_max_diff_steps"] <= LOGITS_STEPS, diff
    assert diff["logits_differing"] <= LOGITS_SHARE * diff["logits_total"], diff


def record(key: str, value: dict) -> None:
    """Adds `value` to $QTOOL_GPU_RESULTS/qat_step.json when that folder is set (run.sh)."""
    folder = os.environ.get("QTOOL_GPU_RESULTS")
    if not folder:
        return
    path = Path(folder) / "qat_step.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2) + "\n")
