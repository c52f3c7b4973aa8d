"""GPTQ Hessians collected in the calibration pass, their file, and the merge of shards.

The model is a real torch export (two Linear layers on a [batch, 5, 6] input, so every leading
dimension is a row) prepared the way calibration sees it; the reference XᵀX is computed directly
from the same tensors fetched from ONNX Runtime over all batches.
"""

from __future__ import annotations

import io
import json
import warnings
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from torch import nn

from qtool.calibration import collect as collect_module
from qtool.calibration.collect import collect, collect_statistics, save_with_extra_outputs
from qtool.calibration.hessian_file import (
    hessian_data_sha256,
    load_hessians,
    merge_hessians,
    save_hessians,
)
from qtool.calibration.hessians import HessianAccumulator
from qtool.data.batches import Batch
from qtool.errors import CalibrationError
from qtool.model.prepare import prepare_model

BINS = 256
SEQ, K_IN, HIDDEN = 5, 6, 8
FINGERPRINT = "ab" * 32


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(K_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 3)).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            module,
            (torch.zeros(1, SEQ, K_IN),),
            buffer,
            opset_version=17,
            dynamo=False,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        )
    return prepare_model(onnx.load_from_string(buffer.getvalue()))


def _weight_inputs(model: onnx.ModelProto) -> list[str]:
    """The activation input of every MatMul with a constant weight: what GPTQ needs XᵀX of."""
    constants = {i.name for i in model.graph.initializer}
    return [
        n.input[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in constants
    ]


def _batches(sizes: list[int], seed: int = 3) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [
        Batch({"x": rng.standard_normal((s, SEQ, K_IN)).astype(np.float32)}, None) for s in sizes
    ]


def _rebatch(batches: list[Batch], size: int) -> list[Batch]:
    x = np.concatenate([b.inputs["x"] for b in batches])
    return [Batch({"x": x[i : i + size]}, None) for i in range(0, len(x), size)]


def _direct_xtx(model: onnx.ModelProto, tensors: list[str], batches: list[Batch], tmp: Path):
    """XᵀX of each tensor from all its rows at once, fetched by a plain ORT session."""
    path = tmp / "exposed.onnx"
    save_with_extra_outputs(model, tensors, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fetched = [session.run(tensors, b.inputs) for b in batches]
    out = {}
    for i, name in enumerate(tensors):
        rows = np.concatenate([f[i].reshape(-1, f[i].shape[-1]) for f in fetched])
        rows = rows.astype(np.float64)
        out[name] = (rows.T @ rows, len(rows))
    return out


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to the rounding of float32 per-batch products (HessianAccumulator.update) and of
    float64 sums grouped differently, relative to the diagonal."""
    return np.allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(np.diag(b)))))


@pytest.fixture(scope="module")
def collected(model):
    inputs = _weight_inputs(model)
    batches = _batches([5, 3, 7])
    stats, hessians = collect(
        model, ["x", "y"], batches, bins=BINS // 2, hessian_tensors=inputs, progress=False
    )
    return inputs, batches, stats, hessians


def test_streamed_xtx_is_the_product_over_all_batches(model, collected, tmp_path):
    inputs, batches, _, hessians = collected
    assert len(inputs) == 2 and inputs[0] == "x"  # the graph input and the hidden ReLU output
    assert list(hessians) == inputs
    direct = _direct_xtx(model, inputs, batches, tmp_path)
    for name in inputs:
        xtx, rows = direct[name]
        acc = hessians[name]
        assert acc.rows == rows == 15 * SEQ  # every leading dim is a row
        assert acc.xtx.shape == (acc.features, acc.features) == xtx.shape
        assert _close(acc.xtx, xtx), np.abs(acc.xtx - xtx).max()
        assert np.array_equal(acc.xtx, acc.xtx.T)  # what the file's upper triangle relies on
    x = np.concatenate([b.inputs["x"] for b in batches]).reshape(-1, K_IN).astype(np.float64)
    assert _close(hessians["x"].xtx, x.T @ x)  # the graph input reaches ORT unchanged


def test_rerun_is_bit_identical_and_batch_size_only_rounds(model, collected):
    inputs, batches, _, hessians = collected
    _, again = collect(model, [], batches, bins=BINS // 2, hessian_tensors=inputs, progress=False)
    _, one_by_one = collect(
        model, [], _rebatch(batches, 1), bins=BINS // 2, hessian_tensors=inputs, progress=False
    )
    for name in inputs:
        assert np.array_equal(again[name].xtx, hessians[name].xtx)
        assert one_by_one[name].rows == hessians[name].rows
        assert _close(one_by_one[name].xtx, hessians[name].xtx)


def test_statistics_are_those_of_collect_statistics_and_shared_tensors_are_fetched_once(
    model, collected, monkeypatch
):
    inputs, batches, stats, _ = collected
    fetched = []
    real = collect_module.save_with_extra_outputs

    def spy(model, tensors, path, serialized=None):
        fetched.append(list(tensors))
        return real(model, tensors, path, serialized)

    monkeypatch.setattr(collect_module, "save_with_extra_outputs", spy)
    alone = collect_statistics(model, ["x", "y"], batches, bins=BINS // 2, progress=False)
    _, _ = collect(model, ["x"], batches, bins=BINS // 2, hessian_tensors=inputs, progress=False)
    assert fetched[-1] == ["x", inputs[1]]  # "x" is observed and a Hessian input: fetched once
    assert [s.name for s in stats] == ["x", "y"]
    for a, b in zip(stats, alone, strict=True):
        assert (a.name, a.minimum, a.maximum, a.half_range, a.samples) == (
            b.name,
            b.minimum,
            b.maximum,
            b.half_range,
            b.samples,
        )
        assert np.array_equal(a.counts, b.counts)


def _graph_model(elem: int, shape: list) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", elem, shape)],
        [helper.make_tensor_value_info("y", elem, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


def test_unknown_feature_count_is_sized_by_the_first_batch():
    model = _graph_model(onnx.TensorProto.FLOAT, ["batch", "k"])
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((n, 4)).astype(np.float32) for n in (2, 5)]
    _, hessians = collect(
        model,
        [],
        [Batch({"x": x}, None) for x in xs],
        bins=64,
        hessian_tensors=["y"],
        progress=False,
    )
    rows = np.concatenate(xs).astype(np.float64)
    assert hessians["y"].features == 4 and hessians["y"].rows == 7
    assert _close(hessians["y"].xtx, rows.T @ rows)


def test_collect_rejects_what_has_no_hessian(model):
    batches = _batches([2])
    with pytest.raises(CalibrationError, match="'nope'.*no inferred type"):
        collect(model, [], batches, bins=64, hessian_tensors=["nope"], progress=False)
    integer = _graph_model(onnx.TensorProto.INT64, ["batch", 4])
    with pytest.raises(CalibrationError, match="'x' is INT64"):
        collect(integer, [], [], bins=64, hessian_tensors=["x"], progress=False)
    with pytest.raises(CalibrationError, match="'x' received no calibration data"):
        collect(model, [], [], bins=64, hessian_tensors=["x"], progress=False)


# --- the Hessian file -------------------------------------------------------------------------


def test_file_round_trip_is_exact_and_byte_deterministic(collected, tmp_path):
    _, _, _, hessians = collected
    first, second, reordered = tmp_path / "a.zip", tmp_path / "b.zip", tmp_path / "c.zip"
    save_hessians(first, hessians, FINGERPRINT, "cd" * 32)
    loaded = load_hessians(first, FINGERPRINT)
    assert list(loaded) == sorted(hessians)
    for name, acc in hessians.items():
        assert np.array_equal(loaded[name].xtx, acc.xtx)
        assert loaded[name].rows == acc.rows and loaded[name].name == name
    save_hessians(second, loaded, FINGERPRINT, "cd" * 32)
    save_hessians(reordered, dict(reversed(hessians.items())), FINGERPRINT, "cd" * 32)
    assert first.read_bytes() == second.read_bytes() == reordered.read_bytes()
    assert hessian_data_sha256(first) == "cd" * 32
    with zipfile.ZipFile(first) as archive:  # the upper triangle only: half of K x K
        index = json.loads(archive.read("index.json"))
        for entry in index["tensors"]:
            k = entry["features"]
            packed = np.load(io.BytesIO(archive.read(entry["xtx"])))
            assert packed.shape == (k * (k + 1) // 2,)


def _rewrite(path: Path, change) -> None:
    """Apply `change(members: dict[str, bytes], index: dict)` to a saved file."""
    with zipfile.ZipFile(path) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    index = json.loads(members["index.json"])
    change(members, index)
    if "index.json" in members:
        members["index.json"] = json.dumps(index).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _member(index: dict, tensor: str) -> str:
    return next(e["xtx"] for e in index["tensors"] if e["name"] == tensor)


def _set_array(tensor: str, edit):
    def change(members, index):
        member = _member(index, tensor)
        members[member] = _npy(edit(np.load(io.BytesIO(members[member]))))

    return change


def _with_nan(a):
    a = a.copy()
    a[1] = np.nan
    return a


def _negative_first(a):
    a = a.copy()
    a[0] = -1.0  # (XᵀX)_00
    return a


def _set_entry(tensor: str, **fields):
    def change(members, index):
        next(e for e in index["tensors"] if e["name"] == tensor).update(fields)

    return change


BAD_FILES = {
    "missing member": (
        lambda members, index: members.pop(_member(index, "x")),
        r"tensor 'x': member 'xtx_\d\.npy' is missing",
    ),
    "wrong shape": (_set_array("x", lambda a: a[:-1]), r"tensor 'x': XᵀX triangle is float64"),
    "wrong dtype": (_set_array("x", lambda a: a.astype(np.float32)), r"'x': .*expected float64"),
    "not finite": (_set_array("x", _with_nan), r"tensor 'x': XᵀX contains NaN"),
    "negative diagonal": (_set_array("x", _negative_first), r"'x': XᵀX has a negative diagonal"),
    "features mismatch": (_set_entry("x", features=K_IN + 1), r"'x': XᵀX triangle is float64"),
    "rows without data": (_set_entry("x", rows=0), r"'x': XᵀX is not zero but counts no rows"),
    "bad rows": (_set_entry("x", rows=-3), r"tensor 'x': features 6 and rows -3"),
    "wrong format": (
        lambda members, index: index.update(format="qtool-stats/1"),
        "not a qtool Hessian file",
    ),
    "no index": (lambda members, index: members.pop("index.json"), "no index.json"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_raise_naming_file_and_tensor(collected, tmp_path, case):
    _, _, _, hessians = collected
    path = tmp_path / "hessians.zip"
    save_hessians(path, hessians, FINGERPRINT)
    change, message = BAD_FILES[case]
    _rewrite(path, change)
    with pytest.raises(CalibrationError, match=message) as error:
        load_hessians(path, FINGERPRINT)
    assert str(path) in str(error.value)


def test_wrong_model_missing_and_non_zip_files_raise(collected, tmp_path):
    _, _, _, hessians = collected
    path = tmp_path / "hessians.zip"
    save_hessians(path, hessians, FINGERPRINT)
    with pytest.raises(CalibrationError, match="collected on a different model"):
        load_hessians(path, "ef" * 32)
    with pytest.raises(CalibrationError, match="Hessian file not found"):
        load_hessians(tmp_path / "absent.zip", FINGERPRINT)
    path.write_bytes(b"not a zip")
    with pytest.raises(CalibrationError, match="corrupt Hessian file"):
        load_hessians(path, FINGERPRINT)


def test_save_refuses_what_the_triangle_cannot_hold(tmp_path):
    asymmetric = HessianAccumulator.from_sum(np.array([[2.0, 1.0], [0.5, 3.0]]), 4, "h")
    with pytest.raises(CalibrationError, match="'h': XᵀX is not exactly symmetric"):
        save_hessians(tmp_path / "h.zip", {"h": asymmetric}, FINGERPRINT)
    infinite = HessianAccumulator.from_sum(np.array([[np.inf, 0.0], [0.0, 1.0]]), 4, "h")
    with pytest.raises(CalibrationError, match="'h': XᵀX contains NaN or Inf"):
        save_hessians(tmp_path / "h.zip", {"h": infinite}, FINGERPRINT)
    assert not (tmp_path / "h.zip").exists()


# --- merging shards ---------------------------------------------------------------------------


def test_merged_shards_match_one_pass_and_repeat_bit_for_bit(model, collected):
    inputs, batches, _, hessians = collected
    shards = [
        collect(model, [], [b], bins=64, hessian_tensors=inputs, progress=False)[1] for b in batches
    ]
    merged = merge_hessians(shards)
    again = merge_hessians(shards)
    for name in inputs:
        assert merged[name].rows == hessians[name].rows
        assert _close(merged[name].xtx, hessians[name].xtx)
        assert np.array_equal(merged[name].xtx, again[name].xtx)
        expected = (shards[0][name].xtx + shards[1][name].xtx) + shards[2][name].xtx
        assert np.array_equal(merged[name].xtx, expected)  # plain addition, in shard order
    single = merge_hessians(shards[:1])
    single[inputs[0]].xtx[0, 0] += 1.0
    assert shards[0][inputs[0]].xtx[0, 0] != single[inputs[0]].xtx[0, 0]  # a copy, not an alias


def test_merge_rejects_shards_that_disagree(collected):
    _, _, _, hessians = collected
    with pytest.raises(CalibrationError, match="no Hessian shards"):
        merge_hessians([])
    partial = {"x": hessians["x"]}
    with pytest.raises(CalibrationError, match="shard 1 and shard 0 disagree on tensor"):
        merge_hessians([hessians, partial])
    wider = {name: HessianAccumulator(acc.features + 1, name) for name, acc in hessians.items()}
    with pytest.raises(CalibrationError, match="cannot merge Hessians of"):
        merge_hessians([hessians, wider])


def test_a_packed_accumulator_holds_half_and_gives_the_same_matrix(collected):
    """The build holds every layer's XᵀX at once: packed, each is its upper triangle, and
    reading it back (or accumulating more into it) gives exactly what the full matrix gave."""
    _, batches, _, hessians = collected
    source = hessians["x"]
    acc = HessianAccumulator.from_sum(source.xtx, source.rows, "x")
    full = acc.xtx.copy()
    acc.pack()
    k = acc.features
    assert acc._full is None and acc._packed.nbytes == k * (k + 1) // 2 * 8 < full.nbytes * 0.6
    assert np.array_equal(acc.xtx, full) and acc.xtx is not acc.xtx  # rebuilt on each read
    extra = batches[0].inputs["x"]
    acc.update(extra)
    flat = extra.reshape(-1, k).astype(np.float32)
    assert np.array_equal(acc.xtx, full + flat.T @ flat)


def test_a_derived_accumulator_is_the_scaled_sum_without_holding_it(collected):
    """AWQ's scaled layer inputs: diag(1/s) XᵀX diag(1/s), computed from the unscaled sum on
    each read (the triangle kept is the upper one, mirrored), and it takes no more rows."""
    _, batches, _, hessians = collected
    source = hessians["x"]
    inverse = np.linspace(0.5, 2.0, source.features)
    derived = source.scaled(inverse, "x_scaled")
    expected = HessianAccumulator.from_sum(
        source.xtx * inverse[:, None] * inverse[None, :], source.rows, "x_scaled"
    )
    expected.pack()
    assert derived._packed is None and derived._full is None
    assert np.array_equal(derived.xtx, expected.xtx) and np.array_equal(derived.xtx, derived.xtx.T)
    assert (derived.rows, derived.features) == (source.rows, source.features)
    with pytest.raises(CalibrationError, match="takes no rows"):
        derived.update(batches[0].inputs["x"])
    with pytest.raises(ValueError, match="inverse scales"):
        source.scaled(inverse[:-1], "short")


def test_stored_accumulators_read_their_triangle_from_the_file_written(collected, tmp_path):
    """After the file is written the accumulators hold nothing and read it back, from the staged
    name or, once renamed into place, the committed one: the same matrices as before."""
    from qtool.calibration.hessian_file import read_back

    _, _, _, hessians = collected
    copies = {
        name: HessianAccumulator.from_sum(acc.xtx, acc.rows, name) for name, acc in hessians.items()
    }
    before = {name: acc.xtx.copy() for name, acc in copies.items()}
    staged, committed = tmp_path / "staged.npz", tmp_path / "hessians.npz"
    save_hessians(staged, copies, FINGERPRINT)
    read_back(staged, committed, copies)
    for name, acc in copies.items():
        assert acc._packed is None and acc._full is None
        assert np.array_equal(acc.xtx, before[name])
    staged.rename(committed)
    assert all(np.array_equal(acc.xtx, before[name]) for name, acc in copies.items())
    committed.unlink()
    with pytest.raises(CalibrationError, match="cannot read the Hessians this run wrote back"):
        _ = copies["x"].xtx
