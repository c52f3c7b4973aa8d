"""Merge calibration statistics of shards, exactly: the result is what one pass over all would give.

Why exact is possible (calibration/observers.py): a tensor's histogram covers [-R, R] with R the
smallest power of two strictly above every |x| seen, and growing R to 2R merges bin pairs, which
is exactly the histogram a pass at 2R would have built. So shards with different R merge by
agreeing on the largest R, growing every other shard's histogram to it (pairwise bin merges) and
summing counts; min and max are selections (in the kernels' total order, -0.0 < +0.0) and sample
counts are integer sums. None of it depends on the order or grouping of the shards.

One corner needs care: a shard that saw only zeros has no R of its own (the observer stores the
canonical R = 1 with everything in the centre bin), so it takes no part in choosing R; its centre
bin is the centre bin at any R.

The same arithmetic serves both callers through `reduce`: for shard files every shard is in this
process and `reduce` folds over them (`local_reduce`); under torch.distributed each process holds
its own shard and `reduce` is an all-reduce (`distributed.Group`), two collectives per
statistic for all tensors at once.

Hessians (GPTQ's XᵀX) are float64 sums, merged in shard order (rank order): the same shards give
the same bytes on every run, but not the bytes of one process over all batches, whose additions
are grouped differently (they agree to float64 rounding; `merge_hessians` says the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qtool.calibration.data_digest import DataDigest
from qtool.calibration.hessian_file import (
    hessian_data_sha256,
    hessian_file_bytes,
    load_hessians,
    merge_hessians,
)
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.observers import TensorStats
from qtool.calibration.stats_file import ShardRecord, StatsFile, read_stats_file, stats_file_bytes
from qtool.distributed import Group, check_agreement
from qtool.errors import CalibrationError

# (one array per shard held here, "sum" | "min" | "max") -> the element-wise reduction over all
Reduce = Callable[[Sequence[np.ndarray], str], np.ndarray]

_NUMPY = {"sum": np.sum, "min": np.min, "max": np.max}


def local_reduce(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    return _NUMPY[op](np.stack(arrays), axis=0)


def order_keys(values: Sequence[float]) -> np.ndarray:
    """int64 keys whose order is IEEE total order on the float64 values (-0.0 below +0.0), so
    that an integer min/max all-reduce selects exactly what observers._lower/_higher select."""
    bits = np.asarray(values, dtype=np.float64).view(np.int64)
    return np.where(bits < 0, bits ^ np.int64(0x7FFF_FFFF_FFFF_FFFF), bits)


def from_order_keys(keys: np.ndarray) -> list[float]:
    keys = np.asarray(keys, dtype=np.int64)
    bits = np.where(keys < 0, keys ^ np.int64(0x7FFF_FFFF_FFFF_FFFF), keys)
    return [float(v) for v in bits.view(np.float64)]


def _own_half_range(tensor: TensorStats) -> float:
    """R as the data set it: 0 for an all-zero tensor (whose stored R = 1 is only canonical)."""
    if max(abs(tensor.minimum), abs(tensor.maximum)) == 0.0:
        return 0.0
    mantissa, _ = math.frexp(tensor.half_range)
    if mantissa != 0.5:
        raise CalibrationError(
            f"tensor '{tensor.name}': half-range {tensor.half_range} is not a power of two "
            "(not written by qtool's observer), so its histogram cannot be merged exactly"
        )
    return tensor.half_range


def regrid(counts: np.ndarray, half_range: float, target: float) -> np.ndarray:
    """The histogram over [-half_range, half_range] as it is over [-target, target]: one pairwise
    bin merge per doubling, as HistogramObserver._grow does (target / half_range a power of two;
    half_range 0 means all-zero counts, which sit in the centre bin at any range)."""
    counts = np.asarray(counts, dtype=np.int64)
    if half_range == 0.0 or half_range == target:
        return counts.copy()
    if half_range > target:
        raise CalibrationError(f"cannot narrow a histogram from {half_range} to {target}")
    bins = len(counts)
    quarter = bins // 4
    while half_range < target:
        merged = counts.reshape(-1, 2).sum(axis=1)
        counts = np.zeros(bins, dtype=np.int64)
        counts[quarter : quarter + len(merged)] = merged
        half_range *= 2.0
    if half_range != target:
        raise CalibrationError(f"histogram ranges {half_range} and {target} differ by a non-power")
    return counts


def merge_stats(shards: Sequence[Sequence[TensorStats]], reduce: Reduce = local_reduce):
    """The merged statistics of all shards, tensor by tensor (every shard lists the same tensors
    in the same order; the callers check that). Exact: see the module docstring."""
    if not shards:
        raise CalibrationError("no statistics to merge")
    first = shards[0]
    low = reduce([order_keys([t.minimum for t in shard]) for shard in shards], "min")
    high = reduce([order_keys([t.maximum for t in shard]) for shard in shards], "max")
    own = [np.array([_own_half_range(t) for t in shard], dtype=np.float64) for shard in shards]
    half_ranges = reduce(own, "max")
    half_ranges = np.where(half_ranges == 0.0, 1.0, half_ranges)  # all zero everywhere: canonical
    samples = reduce(
        [np.array([t.samples for t in shard], dtype=np.int64) for shard in shards], "sum"
    )
    grids = []
    for shard, shard_own in zip(shards, own, strict=True):
        rows = [
            regrid(t.counts, r, target)
            for t, r, target in zip(shard, shard_own, half_ranges, strict=True)
        ]
        grids.append(np.stack(rows) if rows else np.zeros((0, 0), dtype=np.int64))
    counts = reduce(grids, "sum")
    minimums, maximums = from_order_keys(low), from_order_keys(high)
    return [
        TensorStats(
            t.name,
            minimums[i],
            maximums[i],
            float(half_ranges[i]),
            counts[i].copy(),
            int(samples[i]),
        )
        for i, t in enumerate(first)
    ]


def merge_digests(digests: Sequence[DataDigest | None], where: Sequence[str]) -> DataDigest:
    for digest, name in zip(digests, where, strict=True):
        if digest is None:
            raise CalibrationError(
                f"{name}: records no mergeable data digest (written by an older qtool: re-run "
                "`qtool calibrate` on that shard)"
            )
    return digests[0].merged(*digests[1:])


def merge_across_processes(
    group: Group,
    model_sha256: str,
    bins: int,
    stats: list[TensorStats],
    hessians: dict[str, HessianAccumulator],
    digest: DataDigest,
) -> tuple[list[TensorStats], dict[str, HessianAccumulator], DataDigest]:
    """Every rank's statistics and data digest merged (on every rank), and the Hessians summed in
    rank order (on rank 0 only: the other ranks get {} and write nothing). World 1: unchanged."""
    if group.world == 1:
        return stats, hessians, digest
    names = sorted(hessians)
    check_agreement(
        group,
        "the prepared model, the bins, the observed tensors or the GPTQ inputs",
        (model_sha256, bins, [s.name for s in stats], [(n, hessians[n].features) for n in names]),
    )

    def all_reduce(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
        return group.all_reduce(local_reduce(arrays, op), op)

    merged = merge_stats([stats], all_reduce) if stats else []
    parts = group.all_gather_object((digest.samples, digest.total))
    merged_digest = DataDigest().merged(*(DataDigest(n, total) for n, total in parts))
    rows = group.all_reduce(np.array([hessians[n].rows for n in names], dtype=np.int64), "sum")
    merged_hessians = {}
    for name, count in zip(names, rows, strict=True):
        total = group.sum_in_rank_order(hessians[name].xtx)
        if total is not None:
            merged_hessians[name] = HessianAccumulator.from_sum(total, int(count), name)
    return merged, merged_hessians, merged_digest


@dataclass
class MergedFiles:
    """The merge of some stats files (and the Hessian files beside them), not yet written."""

    files: dict[Path, bytes]
    stats: list[TensorStats]
    shard: ShardRecord | None  # None: the shards cover the whole calibration set
    digest: DataDigest
    hessians_path: Path | None


def _whole(loaded: StatsFile) -> ShardRecord:
    return loaded.shard or ShardRecord(1, (0,), 0, None, 0)


def _check_compatible(loaded: Sequence[StatsFile]) -> None:
    """Same model, bins and tensors; shards of one split that do not overlap."""
    first = loaded[0]
    names = [s.name for s in first.stats]
    for other in loaded[1:]:
        if other.model_sha256 != first.model_sha256:
            raise CalibrationError(
                f"{other.path}: collected on a different model than {first.path} (prepared model "
                "SHA-256 differs); shards must come from the same recipe and qtool version"
            )
        if other.bins != first.bins:
            raise CalibrationError(
                f"{other.path}: histogram bins {other.bins}, but {first.path} has {first.bins}"
            )
        if [s.name for s in other.stats] != names:
            raise CalibrationError(
                f"{other.path}: observes other tensors than {first.path} (another recipe?)"
            )
    if len(loaded) == 1:
        return
    whole = [f for f in loaded if f.shard is None]
    if whole:
        raise CalibrationError(
            f"{whole[0].path}: covers the whole calibration set, so merging it with other files "
            "counts samples twice (merge the files of `qtool calibrate --shard i/N` runs)"
        )
    seen: dict[int, Path] = {}
    for item in loaded:
        shard, reference = item.shard, first.shard
        if shard.count != reference.count:
            raise CalibrationError(
                f"{item.path}: shard {shard.describe()}, but {first.path} is shard "
                f"{reference.describe()}: shards of different splits cannot be merged"
            )
        for key in ("batch_size", "max_samples", "seed"):
            if getattr(shard, key) != getattr(reference, key):
                raise CalibrationError(
                    f"{item.path}: calibration {key} {getattr(shard, key)}, but {first.path} has "
                    f"{getattr(reference, key)}: the shards would not split the same batches"
                )
        for index in shard.indices:
            if index in seen:
                raise CalibrationError(
                    f"{item.path}: shard {index}/{shard.count} is also in {seen[index]} "
                    "(overlapping or duplicate shard files)"
                )
            seen[index] = item.path


def _companion(path: Path) -> Path:
    """Where `qtool calibrate` writes the Hessians of a stats file (and quantize reads them)."""
    return path.parent / "hessians.npz"


def _merged_hessians(
    loaded: Sequence[StatsFile], output: Path
) -> tuple[Path | None, dict[str, HessianAccumulator]]:
    companions = [_companion(item.path) for item in loaded]
    present = [path.is_file() for path in companions]
    if not any(present):
        return None, {}
    if not all(present):
        missing = loaded[present.index(False)].path
        having = loaded[present.index(True)].path
        raise CalibrationError(
            f"{missing}: no hessians.npz beside it, but {having} has one: merge shards of one "
            "recipe, each run in its own output folder"
        )
    if len(set(companions)) != len(companions):
        raise CalibrationError(
            f"{loaded[0].path.parent}: holds several of the stats files, but one hessians.npz: "
            "run each shard in its own output folder"
        )
    target = _companion(output)
    if target in companions:
        raise CalibrationError(
            f"{target}: is one shard's Hessian file; write the merge to another folder (-o)"
        )
    shards = []
    for item, path in zip(loaded, companions, strict=True):
        if hessian_data_sha256(path) != item.data_sha256:
            raise CalibrationError(
                f"{path}: records other calibration data than {item.path} beside it (left over "
                "from another run?)"
            )
        shards.append(load_hessians(path, item.model_sha256))
    return target, merge_hessians(shards)


def merge_stats_files(paths: Sequence[Path], output: Path) -> MergedFiles:
    """Merge shard stats files (and their hessians.npz) into `output`'s bytes.

    Shards are merged in shard-index order whatever the order given, so the Hessian sums (the one
    merge that rounds) come out as a torchrun with one rank per shard gives them. When the shards
    cover the whole split, the stats file is byte-identical to one `qtool calibrate` run.
    """
    if not paths:
        raise CalibrationError("stats merge: no stats files given")
    output = Path(output)
    resolved = {Path(p).resolve() for p in paths}
    if len(resolved) != len(paths):
        raise CalibrationError("stats merge: a stats file is given twice")
    if output.resolve() in resolved:
        raise CalibrationError(f"{output}: is one of the inputs; write the merge elsewhere")
    loaded = [read_stats_file(Path(p)) for p in paths]
    _check_compatible(loaded)
    loaded.sort(key=lambda item: _whole(item).indices[0])
    digest = merge_digests([f.data_digest for f in loaded], [str(f.path) for f in loaded])
    stats = merge_stats([f.stats for f in loaded])
    reference = _whole(loaded[0])
    indices = tuple(sorted(i for f in loaded for i in _whole(f).indices))
    shard = None
    if len(indices) < reference.count:
        shard = ShardRecord(
            reference.count, indices, reference.batch_size, reference.max_samples, reference.seed
        )
    first = loaded[0]
    files = {
        output: stats_file_bytes(
            stats, first.model_sha256, first.bins, data_digest=digest, shard=shard
        )
    }
    hessians_path, hessians = _merged_hessians(loaded, output)
    if hessians_path is not None:
        files[hessians_path] = hessian_file_bytes(hessians, first.model_sha256, digest.hexdigest())
    return MergedFiles(files, stats, shard, digest, hessians_path)
