"""The calibration stage: one streaming pass that collects every statistic the plan and the
algorithms asked for, merged exactly across shards and processes, or the same read back from a
stats file collected on this very model."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import onnx

from qtool import kernels
from qtool.calibration.channels import ChannelStats, channel_file_bytes
from qtool.calibration.collect import collect
from qtool.calibration.data_digest import DataDigest
from qtool.calibration.hessian_file import load_hessians, read_back, write_hessian_file
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.merge import merge_across_processes
from qtool.calibration.observers import TensorStats
from qtool.calibration.requests import StatisticRequests
from qtool.calibration.stats_file import (
    ShardRecord,
    load_stats,
    stats_data_sha256,
    stats_file_bytes,
)
from qtool.data.source import BatchSource
from qtool.distributed import Group, Shard
from qtool.errors import CalibrationError
from qtool.io import Staged, stage
from qtool.pipeline.float_model import FloatModel
from qtool.pipeline.outputs import OutputFiles


@dataclass
class Statistics:
    """Statistics (and GPTQ Hessians) of one calibration run and the files it produces, not yet
    written: calibrate commits them alone, quantize together with its own outputs."""

    stats: list[TensorStats]
    hessians: dict[str, HessianAccumulator]
    files: dict[Path, bytes | Staged]
    data_sha256: str | None
    primary: bool = True  # rank 0 (or the only process): the one that writes the files
    # SmoothQuant's per-channel statistics from this run (None: read from channels.npz)
    channels: dict[str, ChannelStats] | None = None
    # The stats file these came from, or the one this run will write
    path: Path | None = None

    def by_name(self) -> dict[str, TensorStats]:
        return {s.name: s for s in self.stats}


def collect_statistics(
    model: FloatModel,
    requests: StatisticRequests,
    data: BatchSource,
    bins: int,
    outputs: OutputFiles,
    where: str,
    progress: bool,
    shard: Shard | None = None,
    group: Group | None = None,
    reload: bool = True,
    release: bool = False,
) -> Statistics:
    """Calibrate on `shard` of the batches (all of them by default), split further across the
    ranks of `group` and merged exactly (calibration/merge.py) before anything is written.
    `reload`: whether a staged model's weights are read back afterwards (quantize needs them).
    `release`: let go of the float model while ORT runs (FloatModel.release), for callers
    that discard the model's staged files when they fail."""
    shard, group = shard or Shard(), group or Group()
    part = shard.part(group.rank, group.world)
    observers = requests.channel_observers()
    stats: list[TensorStats] = []
    hessians: dict[str, HessianAccumulator] = {}
    if observers and not part.whole:
        # min/max per channel would merge exactly, but the row sample SmoothQuant searches alpha
        # on is chosen by each row's position in the whole stream, which no shard knows.
        raise CalibrationError(
            f"{where}: {requests.channels_for} needs one calibration process over all batches "
            f"(got shard {part}{group.describe()}): its sampled rows cannot be merged across "
            "shards exactly; calibrate without --shard/torchrun"
        )
    digest = None
    if requests.needs_data:  # weight-only round-to-nearest needs no data
        digest = DataDigest()
        model_dir = None

        def source() -> onnx.ModelProto | None:
            return model.model

        if model.staged is not None:
            # ORT reads the weights from the staged float model: Python lets go of its copy
            # meanwhile (a model's worth of memory) and reads it back afterwards.
            model_dir = model.staged.session_path.parent
            model.model = None
            source = model.staged.structure
        elif release and group.primary:
            source = functools.partial(model.release, outputs.float_model)
        # called in the argument list: collect holds the only reference to a released model and
        # drops it once the session has read the model
        stats, hessians = collect(
            source(),
            list(requests.ranges),
            digest.tap(part.select(data.batches(), f"{where}: calibration{group.describe()}")),
            bins=bins,
            hessian_tensors=requests.hessians,
            device=kernels.default_device(),
            total_samples=part.samples(data.samples_hint(), data.batch_size),
            progress=progress and group.primary,
            model_dir=model_dir,
            channel_observers=observers,
            # after source(): a released model's bytes are in the staged float file by now
            serialized=None if model.float_file is None else model.float_file.path,
        )
        if model.staged is not None and reload:
            model.model = model.staged.lazy() if model.lazy else model.staged.load()
        elif model.staged is None:  # callers after calibrate read both (analyze: the bytes)
            model.restore()
        stats, hessians, digest = merge_across_processes(
            group, model.fingerprint, bins, stats, hessians, digest
        )
    record = ShardRecord(shard.count, (shard.index,), data.batch_size, data.max_samples, data.seed)
    stats_bytes = stats_file_bytes(stats, model.fingerprint, bins, data_digest=digest, shard=record)
    data_sha256 = None if digest is None else digest.hexdigest()
    files = {outputs.stats: stats_bytes, **model.float_files(outputs.float_model)}
    for accumulator in hessians.values():  # half the bytes until they are written
        accumulator.pack()
    if requests.hessians and group.primary:
        fingerprint = model.fingerprint
        staged = stage(
            outputs.hessians,
            lambda handle: write_hessian_file(handle, hessians, fingerprint, data_sha256),
        )
        files[outputs.hessians] = staged
        # the build reads each back from the file, layer by layer, instead of holding them all
        read_back(staged.path, outputs.hessians, hessians)
    channels = {observer.name: observer.result() for observer in observers}
    if observers:
        files[outputs.channels] = channel_file_bytes(channels, model.fingerprint, data_sha256)
    return Statistics(
        stats,
        hessians,
        files,
        data_sha256,
        group.primary,
        channels if observers else None,
        outputs.stats,
    )


def read_statistics(
    stats_path: Path, model: FloatModel, requests: StatisticRequests, where: str
) -> Statistics:
    """The statistics a stats file (and the Hessians beside it) hold, when they were collected
    on this model; no files to write, every rank reads the same file."""
    stats, fingerprint = load_stats(stats_path)
    if fingerprint != model.fingerprint:
        raise CalibrationError(
            f"{stats_path}: collected on a different model than {where} describes "
            "(re-run `qtool calibrate`)"
        )
    hessians = _hessians_beside(stats_path, model, requests.hessians)
    return Statistics(
        list(stats.values()), hessians, {}, stats_data_sha256(stats_path), path=stats_path
    )


def _hessians_beside(
    stats_path: Path, model: FloatModel, needed: tuple[str, ...]
) -> dict[str, HessianAccumulator]:
    """The GPTQ Hessians the calibration run wrote beside `stats_path`, when the plan needs any."""
    if not needed:
        return {}
    path = stats_path.parent / "hessians.npz"
    if not path.is_file():
        raise CalibrationError(
            f"{path}: not found; weights with method gptq need the Hessians that `qtool "
            "calibrate` writes with this recipe (re-run it)"
        )
    hessians = load_hessians(path, model.fingerprint)
    missing = [name for name in needed if name not in hessians]
    if missing:
        raise CalibrationError(
            f"{path}: has no Hessian for layer input '{missing[0]}' ({len(missing)} missing; "
            "re-run `qtool calibrate` with this recipe)"
        )
    return hessians
