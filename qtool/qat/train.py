"""The QAT loop: deterministic for a seed on CPU, one checkpoint per epoch, resumable, and
data-parallel (DDP) under torchrun.

The training set is held in memory and shuffled per epoch by a generator seeded from (seed,
epoch), so a run resumed after epoch k draws the same batches as one that never stopped, and
its weights end byte-identical (tests/test_qat.py proves it). Torch runs single-threaded with
deterministic algorithms while training: a CPU reduction split across threads may sum in
another order between runs.

Under torchrun (W processes) every rank draws the same global batch of W x batch_size rows and
trains on its W-th of it, as DistributedSampler does, and DDP averages the gradients (learned
LSQ scales included). Each rank's loss is weighted by its share of the global batch, so the
averaged gradient is the one the global batch gives in one process: W processes with batch B
train as one with batch W x B, up to float rounding (tests/test_qat_ddp.py). The loss must be a
mean over the batch (cross_entropy, mse and distillation are). Rank 0 alone writes checkpoints;
a resume reads rank 0's and sends it to the others, so machines need no shared disk.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from qtool.distributed import Group
from qtool.errors import DataError, ModelError, RecipeError
from qtool.io import commit_files
from qtool.model.load import load_entry_point
from qtool.progress import bars

CHECKPOINT_DIR = "qat"


@dataclass
class TrainingSet:
    inputs: dict[str, np.ndarray]
    targets: np.ndarray | list[np.ndarray]  # labels, or the FP32 teacher's outputs
    distill: bool

    def __len__(self) -> int:
        return len(next(iter(self.inputs.values())))


@dataclass
class History:
    epochs_done: int = 0
    losses: list[float] = field(default_factory=list)  # mean loss per epoch
    resumed_from: int | None = None


def outputs_tuple(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _on(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """`array` as a tensor on the device of `like` (a CUDA rank's outputs under NCCL)."""
    return torch.from_numpy(array).to(like.device)


def make_loss(loss: str | None, distill: bool) -> tuple[Callable, str]:
    """The loss function (outputs tuple, targets) -> scalar and its name for the report."""
    if distill:
        return (
            lambda outs, targets: sum(
                F.mse_loss(o, _on(t, o)) for o, t in zip(outs, targets, strict=True)
            ),
            "distillation (MSE to the FP32 outputs)",
        )
    if loss == "cross_entropy":
        return lambda outs, labels: F.cross_entropy(outs[0], _on(labels, outs[0])), loss
    if loss == "mse":
        return (
            lambda outs, labels: F.mse_loss(outs[0], _on(labels, outs[0]).to(outs[0].dtype)),
            loss,
        )
    function = load_entry_point(loss, "qat loss")
    return lambda outs, labels: function(outs[0], _on(labels, outs[0])), loss


@contextlib.contextmanager
def _ieee_float32() -> Iterator[None]:
    """float32 convolutions and matrix products in full float32 on CUDA, not TF32 (cuDNN's
    default for convolutions): TF32 rounds the operands to 10-bit mantissas, so a CUDA rank would
    train another function than the float32 model ONNX Runtime runs, ~1e-3 apart instead of
    float32 rounding. Set through the allow_tf32 flags, which every torch has and which newer
    ones (>= 2.9) keep consistent with their per-backend fp32_precision settings; where the
    process has set those apart (reading allow_tf32 is then an error), through them instead."""
    backends = torch.backends
    try:
        saved = (backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # torch >= 2.9 with conv / rnn precisions set apart
        flags = [backends.cudnn.conv, backends.cudnn.rnn, backends.cuda.matmul]
        precisions = [f.fp32_precision for f in flags]
        for f in flags:
            f.fp32_precision = "ieee"
        try:
            yield
        finally:
            for f, value in zip(flags, precisions, strict=True):
                f.fp32_precision = value
        return
    backends.cudnn.allow_tf32 = backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32 = saved


@contextlib.contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Seeded, single-threaded, deterministic torch in full float32 (no TF32 on CUDA); the
    previous settings come back after."""
    # cuBLAS refuses deterministic mode without a fixed workspace (a CUDA rank under NCCL)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    threads = torch.get_num_threads()
    was = torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with _ieee_float32():
            yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.set_num_threads(threads)


def make_optimizer(parameters: list, name: str, lr: float) -> torch.optim.Optimizer:
    """The recipe's optimizer: SGD with momentum 0.9, or Adam."""
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    return torch.optim.Adam(parameters, lr=lr)


def batch_loss(forward, loss_fn: Callable, feeds: list[np.ndarray], targets, device=None):
    """The loss of one batch (numpy feeds, moved to `device` when given; targets follow the
    outputs' device in loss_fn)."""
    tensors = [torch.from_numpy(f) for f in feeds]
    if device is not None:
        tensors = [t.to(device) for t in tensors]
    return loss_fn(outputs_tuple(forward(*tensors)), targets)


def apply_step(optimizer: torch.optim.Optimizer, loss, weight: float = 1.0) -> None:
    """Backward of `loss` (times a DDP rank's `weight`, see rank_rows) and one optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    (loss if weight == 1.0 else loss * weight).backward()
    optimizer.step()


def train_step(
    forward, optimizer: torch.optim.Optimizer, loss_fn: Callable, feeds: list[np.ndarray],
    targets, device=None,
) -> float:  # fmt: skip
    """One training step as `train` takes it, on the device the model is on (`device`: where the
    feeds go): forward, loss, backward, optimizer step. Returns the loss. The same step on "cpu"
    and "cuda" is what tests/gpu/test_qat_cuda.py compares."""
    loss = batch_loss(forward, loss_fn, feeds, targets, device)
    if not torch.isfinite(loss):
        raise RecipeError(f"qat: the loss became {float(loss)} (lower qat.lr)")
    apply_step(optimizer, loss)
    return float(loss.detach())


def batch_order(size: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(size, generator=generator).numpy()
    return [order[i : i + batch_size] for i in range(0, size, batch_size)]


def rank_rows(rows: np.ndarray, group: Group) -> tuple[np.ndarray, float]:
    """This rank's part of a global batch and the weight of its loss: the part's share of the
    batch times W, so DDP's mean of the W weighted losses' gradients is the global batch's. A
    last batch with fewer rows than ranks leaves some ranks none: they run one row with weight
    0, because every rank must take part in each gradient all-reduce."""
    if group.world == 1:
        return rows, 1.0
    mine = np.array_split(rows, group.world)[group.rank]
    if len(mine) == 0:
        return rows[:1], 0.0
    return mine, group.world * len(mine) / len(rows)


def _targets(data: TrainingSet, rows: np.ndarray):
    if data.distill:
        return [t[rows] for t in data.targets]
    return data.targets[rows]


def checkpoint_path(output_dir: Path, epoch: int) -> Path:
    return output_dir / CHECKPOINT_DIR / f"epoch-{epoch:03d}.pt"


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = sorted((output_dir / CHECKPOINT_DIR).glob("epoch-*.pt"))
    return found[-1] if found else None


def _save(path: Path, model, optimizer, history: History, identity: dict) -> None:
    """Rank 0's checkpoint; the state of the unwrapped model (no DDP "module." prefix), so a
    checkpoint does not depend on how many processes wrote it."""
    buffer = io.BytesIO()
    torch.save(
        {
            "identity": identity,
            "epochs_done": history.epochs_done,
            "losses": history.losses,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
        },
        buffer,
    )
    commit_files({path: buffer.getvalue()})


def _read_checkpoint(output_dir: Path, group: Group) -> tuple[Path, bytes]:
    """Rank 0 reads its latest checkpoint and sends it to every rank; a missing one is the
    same error on every rank."""
    found = None
    if group.primary:
        path = latest_checkpoint(output_dir)
        found = None if path is None else (str(path), path.read_bytes())
    found = group.broadcast_object(found)
    if found is None:
        raise ModelError(
            f"{output_dir / CHECKPOINT_DIR}: no checkpoint to resume from (run without "
            "--resume first)"
        )
    return Path(found[0]), found[1]


def _load(path: Path, content: bytes, model, optimizer, identity: dict) -> History:
    try:
        state = torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelError(f"{path}: not a qtool qat checkpoint ({type(exc).__name__})") from None
    if not isinstance(state, dict) or not isinstance(state.get("identity"), dict):
        raise ModelError(f"{path}: not a qtool qat checkpoint (no identity)")
    theirs = state["identity"]
    same_but_world = {**theirs, "processes": identity["processes"]} == identity
    if "processes" in theirs and theirs != identity and same_but_world:
        raise ModelError(
            f"{path}: checkpoint of a run in {theirs['processes']} processes, this one has "
            f"{identity['processes']}: the global batch is batch_size x processes; resume with "
            "as many (torchrun --nproc-per-node) or drop --resume"
        )
    if theirs != identity:
        raise ModelError(
            f"{path}: checkpoint of another model or qat setup than this recipe's "
            "(delete it or drop --resume)"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return History(int(state["epochs_done"]), list(state["losses"]), int(state["epochs_done"]))


def _data_parallel(model, group: Group):
    """`model` wrapped in DDP (the forward to train through), or itself in one process."""
    if group.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    if group.device is not None:
        return DistributedDataParallel(model, device_ids=[group.device])
    return DistributedDataParallel(model)


def train(
    model,
    data: TrainingSet,
    loss_fn: Callable,
    *,
    epochs: int,
    lr: float,
    optimizer_name: str,
    batch_size: int,
    seed: int,
    output_dir: Path,
    identity: dict,
    resume: bool,
    progress: bool,
    group: Group | None = None,
    device=None,
) -> History:
    """Train `model` in place for the epochs not done yet; checkpoint after each one. Under
    torchrun, `group`'s ranks split each global batch of batch_size x W rows (see top) on their
    CUDA device under NCCL; in one process `device` ("cuda") trains there instead of the CPU.
    The model is back on the CPU when this returns."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn

    group = group or Group()
    if len(data) == 0:
        raise DataError("qat: the training data holds no samples")
    device = group.device if group.device is not None else device
    if device is not None:
        model.to(device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(parameters, optimizer_name, lr)
    history = History()
    if resume:
        path, content = _read_checkpoint(output_dir, group)
        history = _load(path, content, model, optimizer, identity)
    forward = _data_parallel(model, group)
    names = list(data.inputs)
    global_batch = batch_size * group.world
    steps = -(-len(data) // global_batch)
    with (
        bars(
            progress and group.primary,
            TextColumn("[bold]qat[/] epoch {task.fields[epoch]}/{task.fields[epochs]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            line="qat epoch {epoch}/{epochs}: {count} steps, loss {loss}",
            transient=False,
        ) as bar,
    ):
        for epoch in range(history.epochs_done, epochs):
            task = bar.add_task("", total=steps, epoch=epoch + 1, epochs=epochs, loss="-")
            model.train()
            total, count = 0.0, 0
            for batch in batch_order(len(data), global_batch, seed, epoch):
                rows, weight = rank_rows(batch, group)
                feeds = [data.inputs[n][rows] for n in names]
                loss = batch_loss(forward, loss_fn, feeds, _targets(data, rows), device)
                if not torch.isfinite(loss):
                    raise RecipeError(
                        f"qat: the loss became {float(loss)} in epoch {epoch + 1}"
                        f"{group.describe()} (lower qat.lr)"
                    )
                apply_step(optimizer, loss, 1.0 if group.world == 1 else weight)
                if weight:
                    total += float(loss.detach()) * len(rows)
                    count += len(rows)
                bar.update(task, advance=1, loss=f"{total / max(count, 1):.5f}")
            total, count = group.all_reduce(np.array([total, count], np.float64), "sum")
            history.epochs_done = epoch + 1
            history.losses.append(float(total / count))
            model.eval()
            if group.primary:
                _save(checkpoint_path(output_dir, epoch + 1), model, optimizer, history, identity)
            group.barrier("waiting for rank 0's checkpoint")
    if device is not None:
        model.cpu()
    return history
