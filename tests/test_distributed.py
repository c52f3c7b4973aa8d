"""Sharded calibration: shards (processes or separate runs) merge into the single-process bytes.

The histograms are range-doubling with exact bin merges, so merging is exact only if shards agree
on the largest power-of-two range, grow the others' histograms to it and sum; these tests check
the result byte for byte against one pass over the same data, through every route: the merge
arithmetic on the real observers, two gloo processes (torch.multiprocessing and torchrun), and
`qtool stats merge` of `calibrate --shard` runs on the digits example.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from qtool.calibration.data_digest import DataDigest
from qtool.calibration.hessian_file import hessian_file_bytes, load_hessians
from qtool.calibration.hessians import HessianAccumulator
from qtool.calibration.merge import merge_stats, regrid
from qtool.calibration.observers import HistogramObserver, TensorStats
from qtool.calibration.stats_file import (
    ShardRecord,
    load_stats,
    read_stats_file,
    stats_file_bytes,
)
from qtool.data.batches import Batch
from qtool.distributed import Shard
from qtool.errors import CalibrationError, RecipeError

REPO = Path(__file__).resolve().parent.parent
BINS = 64  # the stats file's bins; observers keep 2 * BINS


def _batches() -> list[dict[str, np.ndarray]]:
    """Batches whose magnitudes differ by orders of magnitude (so shards end at different
    ranges), with -0.0 and +0.0 as extremes, and one tensor that is zero in the early batches
    and small (below the canonical all-zero range 1) later: the corners of merging."""
    rng = np.random.default_rng(7)
    batches = []
    for i in range(7):
        scale = 10.0 ** (i - 3)
        wide = (rng.standard_normal((5, 9)) * scale).astype(np.float32)
        signed = np.abs(rng.standard_normal((5, 4))).astype(np.float32)
        signed[0, 0] = -0.0 if i % 2 else 0.0
        late = np.zeros((5, 3), np.float32) if i < 4 else rng.uniform(-0.3, 0.2, (5, 3))
        batches.append({"wide": wide, "signed": signed, "late": late.astype(np.float32)})
    return batches


NAMES = ("wide", "signed", "late", "zero")


def _observe(batches: list[dict[str, np.ndarray]]) -> list[TensorStats]:
    observers = [HistogramObserver(name, 2 * BINS) for name in NAMES]
    for batch in batches:
        for observer in observers:
            values = batch.get(observer.name)
            observer.update(np.zeros((5, 2), np.float32) if values is None else values)
    return [observer.result() for observer in observers]


def _hessians(batches: list[dict[str, np.ndarray]]) -> dict[str, HessianAccumulator]:
    accumulator = HessianAccumulator(9, "wide")
    for batch in batches:
        accumulator.update(batch["wide"])
    return {"wide": accumulator}


def _digest(batches: list[dict[str, np.ndarray]]) -> DataDigest:
    digest = DataDigest()
    for batch in batches:
        digest.update(Batch(batch, None))
    return digest


def _assert_same_stats(merged: list[TensorStats], single: list[TensorStats]) -> None:
    assert stats_file_bytes(merged, "m" * 64, BINS) == stats_file_bytes(single, "m" * 64, BINS)
    for a, b in zip(merged, single, strict=True):  # the bytes include these; named on failure
        assert (a.name, a.half_range, a.samples) == (b.name, b.half_range, b.samples)
        assert np.array_equal(a.counts, b.counts), a.name
        assert str(a.minimum) == str(b.minimum) and str(a.maximum) == str(b.maximum), a.name


# ---------------------------------------------------------------------- the merge arithmetic


@pytest.mark.parametrize("count", [2, 3, 7])
def test_merged_shards_equal_one_pass_over_all_batches(count: int) -> None:
    batches = _batches()
    single = _observe(batches)
    shards = [_observe(list(Shard(i, count).select(batches, "test"))) for i in range(count)]
    assert len({s[0].half_range for s in shards}) > 1  # the shards really end at other ranges
    _assert_same_stats(merge_stats(shards), single)
    _assert_same_stats(merge_stats(shards[::-1]), single)  # order-independent
    assert str(merge_stats(shards)[1].minimum) == "-0.0"  # the total order's minimum survives


def test_regrid_is_the_observers_range_doubling() -> None:
    values = np.random.default_rng(1).uniform(-0.9, 0.9, 1000).astype(np.float32)
    narrow = HistogramObserver("x", 16)
    narrow.update(values)
    wide = HistogramObserver("x", 16)
    wide.update(np.array([7.5], np.float32))  # range 8 before the values arrive
    wide.update(values)
    grown = regrid(narrow.counts, narrow.half_range, 8.0)
    assert grown.sum() == 1000
    assert np.array_equal(grown + wide_only(wide, 7.5), wide.counts)
    with pytest.raises(CalibrationError, match="narrow"):
        regrid(wide.counts, 8.0, 1.0)


def wide_only(observer: HistogramObserver, value: float) -> np.ndarray:
    """The histogram of the one value alone at the observer's range."""
    alone = HistogramObserver("x", len(observer.counts))
    alone.update(np.array([value], np.float32))
    return regrid(alone.counts, alone.half_range, observer.half_range)


def test_data_digest_ignores_split_and_order_but_not_content() -> None:
    batches = _batches()
    whole = _digest(batches)
    parts = [_digest(list(Shard(i, 3).select(batches, "test"))) for i in range(3)]
    assert parts[2].merged(parts[0], parts[1]).hexdigest() == whole.hexdigest()
    rebatched = [{k: v[i : i + 1] for k, v in b.items()} for b in batches for i in range(5)]
    assert _digest(rebatched[::-1]).hexdigest() == whole.hexdigest()  # batch size and order
    changed = [dict(b) for b in batches]
    changed[3] = {**changed[3], "wide": changed[3]["wide"].copy()}
    changed[3]["wide"][2, 2] += 1.0
    assert _digest(changed).hexdigest() != whole.hexdigest()
    # Two samples trading one input: each input's multiset is unchanged, the samples are not.
    swapped = [dict(b) for b in batches]
    signed = swapped[0]["signed"].copy()
    signed[[0, 1]] = signed[[1, 0]]
    swapped[0] = {**swapped[0], "signed": signed}
    assert _digest(swapped).hexdigest() != whole.hexdigest()
    assert DataDigest.from_json(whole.to_json(), "f").hexdigest() == whole.hexdigest()


def test_shard_parsing_composition_and_sizes() -> None:
    assert Shard.parse("1/4") == Shard(1, 4)
    for bad in ("4/4", "1/0", "a/2", "-1/2", "1"):
        with pytest.raises(RecipeError, match="--shard"):
            Shard.parse(bad)
    # Shard 1/3 split across 2 ranks: rank r takes b % 6 == 1 + 3r, together exactly shard 1/3.
    parts = [Shard(1, 3).part(rank, 2) for rank in range(2)]
    assert parts == [Shard(1, 6), Shard(4, 6)]
    items = list(range(40))
    together = sorted(x for p in parts for x in p.select(items, "t"))
    assert together == list(Shard(1, 3).select(items, "t"))
    sizes = [Shard(i, 4).samples(1000, 32) for i in range(4)]  # 31 batches of 32 and one of 8
    assert sum(sizes) == 1000 and sizes == [256, 256, 256, 232]
    with pytest.raises(CalibrationError, match="shard 5/6 of the batches is empty"):
        list(Shard(5, 6).select(range(3), "recipe.yaml: calibration"))


# ------------------------------------------------------------ two gloo processes, in-process


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    """One rank: observe its shard, merge through torch.distributed as the pipeline does."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        QTOOL_DIST_BACKEND="gloo",
    )
    from qtool import distributed
    from qtool.calibration.merge import merge_across_processes

    group = distributed.current()
    mine = list(Shard(rank, world).select(_batches(), "test"))
    try:
        stats, hessians, digest = merge_across_processes(
            group, "m" * 64, BINS, _observe(mine), _hessians(mine), _digest(mine)
        )
        if group.primary:
            Path(out, "stats.npz").write_bytes(
                stats_file_bytes(stats, "m" * 64, BINS, data_digest=digest)
            )
            Path(out, "hessians.npz").write_bytes(hessian_file_bytes(hessians, "m" * 64))
        else:
            assert hessians == {}
    finally:
        distributed.shutdown()


def test_two_gloo_processes_merge_to_the_single_process_bytes(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    # fork: the children start with this process's imports instead of importing torch again.
    args = (2, _free_port(), str(tmp_path))
    mp.start_processes(_rank_main, args=args, nprocs=2, join=True, start_method="fork")
    batches = _batches()
    single = stats_file_bytes(_observe(batches), "m" * 64, BINS, data_digest=_digest(batches))
    assert (tmp_path / "stats.npz").read_bytes() == single
    # XᵀX: rank 0 + rank 1 in that order, the order `qtool stats merge` sums shard files in.
    shards = [_hessians(list(Shard(i, 2).select(batches, "t"))) for i in range(2)]
    from qtool.calibration.hessian_file import merge_hessians

    expected = hessian_file_bytes(merge_hessians(shards), "m" * 64)
    assert (tmp_path / "hessians.npz").read_bytes() == expected
    merged = load_hessians(tmp_path / "hessians.npz", "m" * 64)["wide"]
    one_pass = _hessians(batches)["wide"]
    assert merged.rows == one_pass.rows == 35
    np.testing.assert_allclose(merged.xtx, one_pass.xtx, rtol=1e-12)  # float64 grouping only


# ------------------------------------------------------------------- digits, through the CLI


@pytest.fixture(scope="module")
def digits_shards(digits_run, cli, tmp_path_factory) -> list[Path]:
    """`calibrate --shard i/2` of the session's digits recipe, each in its own folder."""
    root = tmp_path_factory.mktemp("shards")
    paths = []
    for index in range(2):
        out = root / f"shard{index}"
        result = cli(
            "calibrate", digits_run.recipe, "-o", out, "--shard", f"{index}/2", "--no-progress"
        )
        assert result.exit_code == 0, result.output
        assert f"(shard {index}/2)" in result.output
        paths.append(out / "stats.npz")
    return paths


def test_stats_merge_of_shard_runs_is_byte_identical_to_one_run(
    digits_run, digits_shards, cli, tmp_path
) -> None:
    halves = [read_stats_file(p) for p in digits_shards]
    assert [h.shard.indices for h in halves] == [(0,), (1,)]
    # 6 of the 12 batches each: digits' mse ranges leave every 4th of its 512 samples to the
    # tuning rows they are judged on (384 calibrate)
    assert [h.stats[0].samples for h in halves] == [192, 192]
    merged = tmp_path / "merged" / "stats.npz"
    result = cli("stats", "merge", *digits_shards[::-1], "-o", merged)
    assert result.exit_code == 0, result.output
    assert "all shards" in result.output
    assert merged.read_bytes() == (digits_run.out / "stats.npz").read_bytes()
    # ...so quantize takes it, and the quantized model records the same data fingerprint.
    with pytest.raises(CalibrationError, match="shard 0/2 of the calibration set only"):
        load_stats(digits_shards[0])


def test_stats_merge_refuses_what_cannot_be_merged(digits_run, digits_shards, cli, tmp_path):
    first, second = digits_shards

    def refused(*files: Path) -> str:
        result = cli("stats", "merge", *files, "-o", tmp_path / "out" / "stats.npz")
        assert result.exit_code == 2, result.output
        assert not (tmp_path / "out").exists()
        return " ".join(result.output.split())

    assert "overlapping or duplicate" in refused(first, _copy(first, tmp_path / "again"))
    assert "covers the whole calibration set" in refused(first, digits_run.out / "stats.npz")
    loaded = read_stats_file(second)
    other = tmp_path / "other" / "stats.npz"
    other.parent.mkdir()
    other.write_bytes(
        stats_file_bytes(
            loaded.stats, "0" * 64, loaded.bins, data_digest=loaded.data_digest, shard=loaded.shard
        )
    )
    assert "different model" in refused(first, other)
    resplit = ShardRecord(2, (1,), 16, loaded.shard.max_samples, loaded.shard.seed)
    other.write_bytes(
        stats_file_bytes(
            loaded.stats,
            loaded.model_sha256,
            loaded.bins,
            data_digest=loaded.data_digest,
            shard=resplit,
        )
    )
    assert "batch_size 16" in refused(first, other)
    coarse = [
        TensorStats(
            s.name, s.minimum, s.maximum, s.half_range, s.counts.reshape(-1, 2).sum(1), s.samples
        )
        for s in loaded.stats
    ]  # the same statistics at half the bins: a run with calibration.bins 1024
    other.write_bytes(
        stats_file_bytes(
            coarse,
            loaded.model_sha256,
            loaded.bins // 2,
            data_digest=loaded.data_digest,
            shard=loaded.shard,
        )
    )
    assert "histogram bins 1024" in refused(first, other)
    assert "is one of the inputs" in " ".join(
        cli("stats", "merge", first, second, "-o", first).output.split()
    )


def _copy(path: Path, folder: Path) -> Path:
    folder.mkdir(parents=True)
    return Path(shutil.copy(path, folder / path.name))


def test_stats_merge_merges_the_hessian_files_beside_the_shards(digits_dir, cli, tmp_path):
    """GPTQ's XᵀX rides along: merged in shard order, rows summed, digest checked."""
    recipe = digits_dir / "recipe-gptq.yaml"
    recipe.write_text(
        "base: recipe.yaml\nquantization:\n  weights: {bits: 4, block_size: 16, method: gptq}\n"
    )
    outs = []
    for shard in ("", "0/2", "1/2"):
        out = tmp_path / (f"shard{shard[0]}" if shard else "single")
        args = ["calibrate", recipe, "-o", out, "--no-progress"]
        result = cli(*args, *(["--shard", shard] if shard else []))
        assert result.exit_code == 0, result.output
        outs.append(out)
    single, *shards = outs
    merged = tmp_path / "merged" / "stats.npz"
    result = cli("stats", "merge", *(s / "stats.npz" for s in shards), "-o", merged)
    assert result.exit_code == 0, result.output
    assert merged.read_bytes() == (single / "stats.npz").read_bytes()
    fingerprint = read_stats_file(merged).model_sha256
    got = load_hessians(merged.parent / "hessians.npz", fingerprint)
    want = load_hessians(single / "hessians.npz", fingerprint)
    assert sorted(got) == sorted(want) and got
    for name in want:
        assert got[name].rows == want[name].rows
        np.testing.assert_allclose(got[name].xtx, want[name].xtx, rtol=1e-12)
    # A shard without its Hessians, or with another run's, is refused.
    (shards[1] / "hessians.npz").rename(tmp_path / "moved.npz")
    result = cli("stats", "merge", *(s / "stats.npz" for s in shards), "-o", tmp_path / "x.npz")
    assert result.exit_code == 2 and "no hessians.npz beside it" in result.output
    shutil.copy(single / "hessians.npz", shards[1] / "hessians.npz")
    result = cli("stats", "merge", *(s / "stats.npz" for s in shards), "-o", tmp_path / "x.npz")
    assert result.exit_code == 2 and "other calibration data" in " ".join(result.output.split())


# ------------------------------------------------------------------------------- torchrun


def test_torchrun_two_processes_write_the_single_process_stats_file(digits_run, tmp_path):
    """The real launcher: 2 gloo processes, each calibrating half the batches of digits."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "QTOOL_DIST_BACKEND": "gloo"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "qtool.cli", "calibrate", str(digits_run.recipe), "-o", str(out), "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 384 samples in 2 processes" in done.stdout  # 512 less the 128 tuning rows
    assert done.stdout.count("calibrated") == 1  # rank 0 reports, rank 1 does not
    assert (out / "stats.npz").read_bytes() == (digits_run.out / "stats.npz").read_bytes()
    index = json.loads(zipfile.ZipFile(out / "stats.npz").read("index.json"))
    assert "shard" not in index and index["data_digest"]["samples"] == 384


def test_sharded_onnx_calibration_and_merge_never_import_torch(tmp_path: Path) -> None:
    """torch.distributed is for torchrun only: an ONNX model's shard runs and merge stay light."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    (tmp_path / "recipe.yaml").write_text(
        "model: {onnx: m.onnx}\ninputs: {x: [4, 16]}\n"
        "calibration: {data: {synthetic: true, samples: 20}, batch_size: 4}\n"
    )
    script = """
from typer.testing import CliRunner
from qtool.cli import app
run = CliRunner().invoke
for args in (["calibrate", "recipe.yaml", "-o", "one", "--no-progress"],
             ["calibrate", "recipe.yaml", "-o", "s0", "--shard", "0/3", "--no-progress"],
             ["calibrate", "recipe.yaml", "-o", "s1", "--shard", "1/3", "--no-progress"],
             ["calibrate", "recipe.yaml", "-o", "s2", "--shard", "2/3", "--no-progress"],
             ["stats", "merge", "s2/stats.npz", "s0/stats.npz", "-o", "two/stats.npz"],
             ["stats", "merge", "two/stats.npz", "s1/stats.npz", "-o", "all/stats.npz"]):
    result = run(app, args)
    assert result.exit_code == 0, (args, result.output)
import sys
print(" ".join(sorted(sys.modules)))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert "onnxruntime" in loaded and not loaded & {"torch", "sklearn", "transformers"}
    # 5 batches over 3 shards, merged in two steps (a partial merge records shards 0,2 of 3).
    assert read_stats_file(tmp_path / "two" / "stats.npz").shard.indices == (0, 2)
    whole = (tmp_path / "one" / "stats.npz").read_bytes()
    assert (tmp_path / "all" / "stats.npz").read_bytes() == whole
