"""Which part of the calibration set this process reads, and the collectives that merge the parts.

Sharding is by batch: batch b of the recipe's batch sequence (`data.iter_batches`, the same on
every process for the same recipe) belongs to shard b % N. Whole batches, not samples, because
ONNX Runtime is only guaranteed to give the same bits for the same input tensor: a sample fed in
another batch may come out differently rounded, and the stats would then depend on the sharding.
Round-robin rather than contiguous blocks, because it needs no sample count up front (streamed
sources have none) and keeps every shard's share within one batch of the others.

Two ways to split, which compose: `--shard i/N` (a job array, separate machines: each run writes
a stats file that `qtool stats merge` combines) and torch.distributed ranks (torchrun: rank r of
W reads sub-shard r of its shard, and the statistics are all-reduced so rank 0 writes the file
that one process would have written). Within shard i/N, rank r takes the batches
b % (N * W) == i + N * r.

torch is imported only when WORLD_SIZE > 1 (torchrun sets it): a plain run, and every
ONNX-source command, never loads torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from qtool.errors import CalibrationError, RecipeError, first_line

T = TypeVar("T")

_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
BACKEND_VARIABLE = "QTOOL_DIST_BACKEND"  # gloo | nccl; default: nccl when CUDA is usable


@dataclass(frozen=True)
class Shard:
    """Batches b with b % count == index."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str, where: str = "--shard") -> Shard:
        match = _SHARD.match(text)
        if match is None:
            raise RecipeError(f"{where}: expected INDEX/COUNT such as 0/4, got {text!r}")
        index, count = int(match.group(1)), int(match.group(2))
        if count < 1 or index >= count:
            raise RecipeError(f"{where}: index must be in 0..COUNT-1 and COUNT >= 1, got {text!r}")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def whole(self) -> bool:
        return self.count == 1

    def part(self, rank: int, world: int) -> Shard:
        """Rank `rank` of `world`'s part of this shard."""
        return Shard(self.index + self.count * rank, self.count * world)

    def select(self, items: Iterable[T], where: str) -> Iterator[T]:
        """This shard's items of the sequence (every other shard's are read and dropped). A shard
        of a split that finds none is an error naming `where`: its statistics would be empty."""
        seen = 0
        for number, item in enumerate(items):
            if number % self.count == self.index:
                seen += 1
                yield item
        if not seen and self.count > 1:
            raise CalibrationError(
                f"{where}: shard {self} of the batches is empty (the data has fewer than "
                f"{self.index + 1} batches); use fewer shards or processes, or a smaller batch_size"
            )

    def samples(self, total: int | None, batch_size: int) -> int | None:
        """How many of `total` samples, cut into batches of `batch_size`, this shard gets."""
        if total is None:
            return None
        full, rest = divmod(total, batch_size)
        mine = len(range(self.index, full, self.count)) * batch_size
        if rest and full % self.count == self.index:
            mine += rest
        return mine


class Group:
    """The processes calibrating or training together. World 1 (no torchrun) does nothing and
    needs no torch.

    Every collective is called by every rank in the same order with arrays of the same shape;
    results are exact (integer sums, min/max as selections), so the merged statistics do not
    depend on how the reduction is scheduled.
    """

    def __init__(self, rank: int = 0, world: int = 1, backend: str | None = None) -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self._device = None

    @property
    def primary(self) -> bool:
        """Rank 0: the one that writes files and prints."""
        return self.rank == 0

    def describe(self) -> str:
        """' (rank r of W)' for messages; empty in a single process."""
        return "" if self.world == 1 else f" (rank {self.rank} of {self.world})"

    def _dist(self):
        import torch.distributed as dist

        return dist

    def _to_torch(self, array: np.ndarray):
        import torch

        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.to(self._device) if self._device is not None else tensor

    def _collective(self, what: str, call) -> None:
        """Run one collective; a peer that failed (its own error printed above) breaks the group,
        which torch reports as a multi-line RuntimeError: name it in one line instead."""
        try:
            call()
        except RuntimeError as exc:
            raise CalibrationError(
                f"rank {self.rank} of {self.world}: {what} failed, another rank stopped (see its "
                f"error): {first_line(exc)}"
            ) from None

    def all_reduce(self, array: np.ndarray, op: str) -> np.ndarray:
        """Element-wise "sum" | "min" | "max" of `array` over all ranks (a new array)."""
        if self.world == 1:
            return np.array(array, copy=True)
        dist = self._dist()
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        tensor = self._to_torch(np.array(array, copy=True))
        self._collective("merging statistics", lambda: dist.all_reduce(tensor, op=ops[op]))
        return tensor.cpu().numpy()

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's (small, picklable) `value`, in rank order."""
        if self.world == 1:
            return [value]
        gathered: list[Any] = [None] * self.world
        dist = self._dist()
        self._collective("exchanging metadata", lambda: dist.all_gather_object(gathered, value))
        return gathered

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's (picklable) `value` on every rank: what rank 0 alone read from its disk, such
        as a QAT checkpoint, so several machines need no shared file system."""
        if self.world == 1:
            return value
        holder = [value if self.primary else None]
        dist = self._dist()
        self._collective("receiving rank 0's data", lambda: dist.broadcast_object_list(holder))
        return holder[0]

    def barrier(self, what: str) -> None:
        """Wait until every rank gets here (the others, while rank 0 writes the files)."""
        if self.world > 1:
            dist = self._dist()
            self._collective(what, lambda: dist.barrier())

    @property
    def device(self):
        """The CUDA device this rank's NCCL collectives run on; None on CPU (gloo)."""
        return self._device

    def sum_in_rank_order(self, array: np.ndarray) -> np.ndarray | None:
        """On rank 0, ((rank 0 + rank 1) + rank 2) + ...: a fixed order, so float sums come out
        the same on every run. None on the other ranks. Point-to-point, one array in flight, so
        rank 0 holds two arrays of this size whatever the world size."""
        if self.world == 1:
            return np.array(array, copy=True)
        dist = self._dist()
        if not self.primary:
            tensor = self._to_torch(array)
            self._collective("sending Hessians", lambda: dist.send(tensor, dst=0))
            return None
        total = np.array(array, copy=True)
        buffer = self._to_torch(np.empty_like(total))
        for source in range(1, self.world):
            self._collective("receiving Hessians", lambda s=source: dist.recv(buffer, src=s))
            total += buffer.cpu().numpy()
        return total


_current: Group | None = None


def _environment_world() -> tuple[int, int]:
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise CalibrationError(
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} / RANK={os.environ.get('RANK')!r} are "
            "not integers (set them with torchrun)"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise CalibrationError(f"RANK {rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE {world})")
    return rank, world


def _backend(torch_module) -> str:
    chosen = os.environ.get(BACKEND_VARIABLE)
    if chosen is None:
        return "nccl" if torch_module.cuda.is_available() else "gloo"
    if chosen not in ("gloo", "nccl"):
        raise CalibrationError(f"{BACKEND_VARIABLE}={chosen!r}: expected gloo or nccl")
    return chosen


def current() -> Group:
    """This process's group: joined on first use when torchrun started several processes."""
    global _current
    if _current is not None:
        return _current
    rank, world = _environment_world()
    if world == 1:
        _current = Group()
        return _current
    import torch
    import torch.distributed as dist

    backend = _backend(torch)
    group = Group(rank, world, backend)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise CalibrationError(f"{BACKEND_VARIABLE}=nccl, but CUDA is not usable here")
        local = int(os.environ.get("LOCAL_RANK", rank))
        group._device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(group._device)
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend=backend)
        except (RuntimeError, ValueError) as exc:
            raise CalibrationError(
                f"torch.distributed ({backend}) did not start: {first_line(exc)} "
                "(launch with torchrun, which sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)"
            ) from None
    _current = group
    return group


def shutdown() -> None:
    """Leave the process group (torch warns at exit about one left open)."""
    global _current
    if _current is not None and _current.world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _current = None


def require_single_process(what: str) -> None:
    """Refuse commands that do not run distributed, before any process joins a group."""
    _, world = _environment_world()
    if world > 1:
        raise CalibrationError(
            f"{what} runs in one process; under torchrun (WORLD_SIZE={world}) run "
            "`qtool calibrate` only, then this command once on rank 0's files"
        )


def check_agreement(group: Group, what: str, value: object) -> None:
    """Every rank must hold the same `value` (the model fingerprint, the tensor list, ...)."""
    values = group.all_gather_object(value)
    for rank, other in enumerate(values):
        if other != values[0]:
            raise CalibrationError(
                f"rank {rank} and rank 0 disagree on {what}: every process must calibrate the "
                "same recipe with the same qtool version"
            )
