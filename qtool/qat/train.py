"""The QAT loop: deterministic for a seed on CPU, one checkpoint per epoch, resumable.

The training set is held in memory and shuffled per epoch by a generator seeded from (seed,
epoch), so a run resumed after epoch k draws the same batches as one that never stopped, and
its weights end byte-identical (tests/test_qat.py proves it). Torch runs single-threaded with
deterministic algorithms while training: a CPU reduction split across threads may sum in
another order between runs.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from qtool.errors import DataError, ModelError, RecipeError
from qtool.io import commit_files
from qtool.models import load_entry_point

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


def make_loss(loss: str | None, distill: bool) -> tuple[Callable, str]:
    """The loss function (outputs tuple, targets) -> scalar and its name for the report."""
    if distill:
        return (
            lambda outs, targets: sum(
                F.mse_loss(o, torch.from_numpy(t)) for o, t in zip(outs, targets, strict=True)
            ),
            "distillation (MSE to the FP32 outputs)",
        )
    if loss == "cross_entropy":
        return lambda outs, labels: F.cross_entropy(outs[0], torch.from_numpy(labels)), loss
    if loss == "mse":
        return (
            lambda outs, labels: F.mse_loss(outs[0], torch.from_numpy(labels).to(outs[0].dtype)),
            loss,
        )
    function = load_entry_point(loss, "qat loss")
    return lambda outs, labels: function(outs[0], torch.from_numpy(labels)), loss


@contextlib.contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Seeded, single-threaded, deterministic torch; the previous settings come back after."""
    threads = torch.get_num_threads()
    was = torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.set_num_threads(threads)


def batch_order(size: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(size, generator=generator).numpy()
    return [order[i : i + batch_size] for i in range(0, size, batch_size)]


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


def _load(path: Path, model, optimizer, identity: dict) -> History:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelError(f"{path}: not a qtool qat checkpoint ({type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("identity") != identity:
        raise ModelError(
            f"{path}: checkpoint of another model or qat setup than this recipe's "
            "(delete it or drop --resume)"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return History(int(state["epochs_done"]), list(state["losses"]), int(state["epochs_done"]))


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
) -> History:
    """Train `model` in place for the epochs not done yet; checkpoint after each one."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    parameters = [p for p in model.parameters() if p.requires_grad]
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(parameters, lr=lr)
    history = History()
    if resume:
        path = latest_checkpoint(output_dir)
        if path is None:
            raise ModelError(
                f"{output_dir / CHECKPOINT_DIR}: no checkpoint to resume from (run without "
                "--resume first)"
            )
        history = _load(path, model, optimizer, identity)
    if len(data) == 0:
        raise DataError("qat: the training data holds no samples")
    names = list(data.inputs)
    steps = -(-len(data) // batch_size)
    with (
        Progress(
            TextColumn("[bold]qat[/] epoch {task.fields[epoch]}/{task.fields[epochs]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            disable=not progress,
            transient=False,
        ) as bar,
    ):
        for epoch in range(history.epochs_done, epochs):
            task = bar.add_task("", total=steps, epoch=epoch + 1, epochs=epochs, loss="-")
            model.train()
            total, count = 0.0, 0
            for rows in batch_order(len(data), batch_size, seed, epoch):
                feeds = [torch.from_numpy(data.inputs[n][rows]) for n in names]
                loss = loss_fn(outputs_tuple(model(*feeds)), _targets(data, rows))
                if not torch.isfinite(loss):
                    raise RecipeError(
                        f"qat: the loss became {float(loss)} in epoch {epoch + 1} (lower qat.lr)"
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * len(rows)
                count += len(rows)
                bar.update(task, advance=1, loss=f"{total / count:.5f}")
            history.epochs_done = epoch + 1
            history.losses.append(total / count)
            model.eval()
            _save(checkpoint_path(output_dir, epoch + 1), model, optimizer, history, identity)
    return history
