"""Models over protobuf's 2 GB limit, end to end: load, prepare, calibrate, write, evaluate.

A real 2 GB model costs a minute and gigabytes, so these tests lower
`qtool.model.external_data.EXTERNAL_DATA_THRESHOLD` to 64 KiB and use a ~200 KB model stored with
external data; a guard makes every ModelProto serialization (SerializeToString, ByteSize, which
onnx.checker, shape inference, the version converter, onnx.save and ORT-from-bytes all go through)
over that threshold fail the test, so "never serialized whole" is checked, not assumed. Expected
values come from ONNX Runtime on the source model and from hashlib on the written files, not from
qtool. `test_model_over_2_gib` runs the same on a generated 2.2 GB model when asked to
(QTOOL_BIG_MODEL_TEST=1); benchmarks/external_data.py measures its time and peak memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration.stats_file import load_stats
from qtool.errors import ModelError, OutputError
from qtool.io import STALE_AFTER_S, Staged, commit_files, remove_stale_temporaries, stage
from qtool.model import external_data, provenance
from qtool.model.load import load_onnx

LIMIT = 64 << 10
HIDDEN = 256
FEATURES = 64
CLASSES = 10
OUTPUT_NAMES = ("model.int8.onnx", "model.int8.onnx.data", "model.fp32.onnx")
OUTPUT_NAMES += ("model.fp32.onnx.data", "stats.npz", "report.json")


@pytest.fixture
def small_limit(monkeypatch):
    """Lower the limit to LIMIT and fail on any serialization of a model larger than that."""
    monkeypatch.setattr(external_data, "EXTERNAL_DATA_THRESHOLD", LIMIT)
    serialize, byte_size = onnx.ModelProto.SerializeToString, onnx.ModelProto.ByteSize
    seen: list[int] = []

    def guarded_serialize(self, **kwargs):
        data = serialize(self, **kwargs)
        seen.append(len(data))
        assert len(data) < LIMIT, f"a {len(data)}-byte model was serialized into one protobuf"
        return data

    def guarded_size(self):
        size = byte_size(self)
        assert size < LIMIT, f"ByteSize() serialized a {size}-byte model"
        return size

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", guarded_serialize)
    monkeypatch.setattr(onnx.ModelProto, "ByteSize", guarded_size)
    return seen


def mlp(seed: int = 0, opset: int = 17) -> onnx.ModelProto:
    """x[batch, 64] -> MatMul+Add -> Relu -> MatMul -> Relu -> Gemm: 340 KB of float weights,
    85 KB as int8: both over LIMIT."""
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> TensorProto:
        scale = 1.0 / np.sqrt(shape[0])
        return numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name
        )

    inits = [
        weight("fc1.weight", FEATURES, HIDDEN),
        weight("fc1.bias", HIDDEN),
        weight("fc2.weight", HIDDEN, HIDDEN),
        weight("head.weight", HIDDEN, CLASSES),
        weight("head.bias", CLASSES),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["h1"], name="/fc1/MatMul"),
        helper.make_node("Add", ["h1", "fc1.bias"], ["h1b"], name="/fc1/Add"),
        helper.make_node("Relu", ["h1b"], ["a1"], name="/act1/Relu"),
        helper.make_node("MatMul", ["a1", "fc2.weight"], ["h2"], name="/fc2/MatMul"),
        helper.make_node("Relu", ["h2"], ["a2"], name="/act2/Relu"),
        helper.make_node("Gemm", ["a2", "head.weight", "head.bias"], ["logits"], name="/head/Gemm"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def save_external(model: onnx.ModelProto, path: Path) -> Path:
    """The source as users have it: weights in `path`.data beside it (onnx's own writer)."""
    onnx.save(model, str(path), save_as_external_data=True, location=f"{path.name}.data")
    return path


def run_ort(path: Path, x: np.ndarray, optimize: bool = True) -> np.ndarray:
    options = onnxruntime.SessionOptions()
    if not optimize:
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum(a * b) / np.linalg.norm(a) / np.linalg.norm(b))


def files_sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def external_tensors(path: Path) -> dict[str, dict[str, str]]:
    model = onnx.load(str(path), load_external_data=False)
    return {
        t.name: {e.key: e.value for e in t.external_data}
        for t in model.graph.initializer
        if t.data_location == TensorProto.EXTERNAL
    }


def write_case(
    folder: Path, model: onnx.ModelProto, samples: int = 64, float_model: str = "always"
) -> tuple[Path, np.ndarray]:
    """Source model with external data, calibration/evaluation data (.npz), and a recipe
    (`output.float_model`: these tests check the float copy unless they say otherwise)."""
    source = save_external(model, folder / "source.onnx")
    x = np.random.default_rng(1).standard_normal((samples, FEATURES)).astype(np.float32)
    np.savez(folder / "data.npz", x=x)
    recipe = {
        "model": {"onnx": str(source)},
        "inputs": {"x": [1, FEATURES]},
        "calibration": {"data": {"npz": "data.npz"}, "batch_size": 16, "method": "minmax"},
        "evaluation": {"data": {"npz": "data.npz"}, "batch_size": 32},
        "output": {"dir": "out", "float_model": float_model},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path, x


def assert_no_temporaries(folder: Path) -> None:
    left = [p.name for p in folder.iterdir() if ".qtool" in p.name]
    assert not left, left


def test_guard_catches_a_whole_model_serialization(small_limit) -> None:
    """The guard the other tests rely on fails where the code before external data failed."""
    model = mlp()
    assert external_data.needs_external_data(model)
    with pytest.raises(AssertionError, match="serialized into one protobuf"):
        model.SerializeToString()
    with pytest.raises(AssertionError):
        onnx.checker.check_model(model)


def test_quantize_and_evaluate_with_external_data(small_limit, cli, tmp_path) -> None:
    recipe, x = write_case(tmp_path, mlp())
    source = tmp_path / "source.onnx"
    out = tmp_path / "out"

    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr

    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUT_NAMES)
    for name in ("model.fp32.onnx", "model.int8.onnx"):
        tensors = external_tensors(out / name)
        assert tensors, f"{name} keeps its weights inline"
        for entry in tensors.values():
            assert entry["location"] == f"{name}.data"
            assert int(entry["offset"]) % external_data.ALIGNMENT == 0
        assert (out / name).stat().st_size < LIMIT
    # The int8 weights are what the data file holds: the MatMul/Gemm weights, 1 byte each.
    int8 = external_tensors(out / "model.int8.onnx")
    assert int(int8["fc2.weight_quantized"]["length"]) == HIDDEN * HIDDEN

    reference = run_ort(source, x)
    np.testing.assert_allclose(run_ort(out / "model.fp32.onnx", x), reference, rtol=1e-5, atol=1e-5)
    for optimize in (True, False):
        quantized = run_ort(out / "model.int8.onnx", x, optimize)
        assert cosine(quantized, reference) > 0.99
        assert not np.array_equal(quantized, reference)  # it really is quantized

    fingerprint = files_sha256(out / "model.fp32.onnx", out / "model.fp32.onnx.data")
    _, stats_fingerprint = load_stats(out / "stats.npz")
    assert stats_fingerprint == fingerprint
    stamped = provenance.read(onnx.load(str(out / "model.int8.onnx"), load_external_data=False))
    assert stamped[provenance.FLOAT_MODEL_SHA256] == fingerprint
    assert stamped[provenance.SOURCE_MODEL_SHA256] == files_sha256(
        source, tmp_path / "source.onnx.data"
    )
    report = json.loads((out / "report.json").read_text())
    assert report["files"]["quantized_model_data"] == str(out / "model.int8.onnx.data")
    assert report["files"]["float_model_data"] == str(out / "model.fp32.onnx.data")
    assert report["runtime"]["fused"] == 3, report["runtime"]  # fc1, fc2, head: from ORT's graph

    evaluation = tmp_path / "eval.json"
    result = cli("evaluate", recipe, "--json", evaluation, "--no-progress")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(evaluation.read_text())
    assert summary["provenance"]["status"] == "match"
    sizes = {
        name: (out / name).stat().st_size + (out / f"{name}.data").stat().st_size
        for name in ("model.fp32.onnx", "model.int8.onnx")
    }
    assert summary["size"]["fp32_bytes"] == sizes["model.fp32.onnx"]
    assert summary["size"]["quant_bytes"] == sizes["model.int8.onnx"]

    # Same inputs, same bytes; and the stats file is accepted for the staged float model.
    before = {name: (out / name).read_bytes() for name in OUTPUT_NAMES if name != "report.json"}
    result = cli("quantize", recipe, "--stats", out / "stats.npz", "--no-progress")
    assert result.exit_code == 0, result.stderr
    for name, content in before.items():
        assert (out / name).read_bytes() == content, name
    assert_no_temporaries(out)
    assert max(small_limit) < LIMIT  # and the guard did see the serializations that happened


def test_failed_run_leaves_nothing(small_limit, cli, tmp_path, monkeypatch) -> None:
    """A failure after both models were staged: no outputs, no temporary files."""
    from qtool.pipeline import finish

    recipe, _ = write_case(tmp_path, mlp())

    def broken_verify(source, *args, **kwargs):
        assert isinstance(source, Path) and source.is_file()  # the staged quantized model
        raise ModelError("verification failed on purpose")

    monkeypatch.setattr(finish, "verify", broken_verify)
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 2
    assert "verification failed on purpose" in result.stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_old_opset_source_is_upgraded_without_serializing(small_limit, cli, tmp_path) -> None:
    """Opset 13 -> 17 runs the version converter, which serializes: the weights stay out."""
    recipe, x = write_case(tmp_path, mlp(opset=13))
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    fp32 = onnx.load(str(out / "model.fp32.onnx"), load_external_data=False)
    assert {o.version for o in fp32.opset_import if o.domain in ("", "ai.onnx")} == {17}
    np.testing.assert_allclose(
        run_ort(out / "model.fp32.onnx", x), run_ort(tmp_path / "source.onnx", x), atol=1e-5
    )


def test_int4_weights_with_external_data(small_limit, cli, tmp_path, monkeypatch) -> None:
    """Blocked INT4 weights with bias correction: the opset-21 upgrade (converter and checker),
    the bias-correction models and the low-bit speed check's float session, all over the limit."""
    recipe, x = write_case(tmp_path, mlp())
    spec = yaml.safe_load(recipe.read_text())
    spec["quantization"] = {
        "weights": {"bits": 4, "block_size": 32},
        "algorithms": ["bias_correction"],
    }
    recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
    # The INT4 model is ~1/8 of the float one: a lower limit still sends it to external data.
    monkeypatch.setattr(external_data, "EXTERNAL_DATA_THRESHOLD", LIMIT // 4)
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    quant = next(out.glob("model.int4.onnx"))
    assert external_tensors(quant), "the INT4 model keeps its weights inline"
    report = json.loads((out / "report.json").read_text())
    assert report["algorithms"]["bias_correction"]["nodes"], report["algorithms"]
    assert report["runtime"]["low_bit_speed"]["fp32_ms_median"] > 0
    reference = run_ort(tmp_path / "source.onnx", x)
    quantized = run_ort(quant, x)
    assert cosine(quantized, reference) > 0.98


def test_missing_data_file_is_named(cli, tmp_path) -> None:
    recipe, _ = write_case(tmp_path, mlp())
    (tmp_path / "source.onnx.data").unlink()
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "source.onnx.data" in lines[0], result.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_small_models_stay_in_one_file(cli, tmp_path) -> None:
    """Under the real limit the same source is written inline, as before external data."""
    recipe, _ = write_case(tmp_path, mlp())
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    assert not list(out.glob("*.data"))
    fp32 = (out / "model.fp32.onnx").read_bytes()
    assert load_stats(out / "stats.npz")[1] == hashlib.sha256(fp32).hexdigest()


def test_model_sha256_covers_the_data_file(tmp_path) -> None:
    model = mlp()
    inline = tmp_path / "inline.onnx"
    onnx.save(model, str(inline))
    assert external_data.model_sha256(inline) == provenance.sha256_file(inline)
    split = save_external(model, tmp_path / "split.onnx")
    data = tmp_path / "split.onnx.data"
    assert external_data.model_sha256(split) == files_sha256(split, data)
    before = external_data.model_sha256(split)
    content = bytearray(data.read_bytes())
    content[-1] ^= 1  # one weight bit
    data.write_bytes(bytes(content))
    assert external_data.model_sha256(split) != before


def test_loading_hashes_the_source_as_sha256_model_does(tmp_path) -> None:
    """The provenance hash is taken from the one read of the model and its data files."""
    model = mlp()
    inline = tmp_path / "inline.onnx"
    onnx.save(model, str(inline))
    split = save_external(model, tmp_path / "split.onnx")
    for path in (inline, split):
        digest = hashlib.sha256()
        loaded = load_onnx(path, digest)
        assert digest.hexdigest() == external_data.model_sha256(path)
        assert len(loaded.graph.initializer) == len(model.graph.initializer)
        assert all(t.data_location == onnx.TensorProto.DEFAULT for t in loaded.graph.initializer)


def test_staged_model_matches_its_files(small_limit, tmp_path) -> None:
    """stage_model's hash is the committed files' hash; the weights read back are the model's."""
    model = mlp()
    target = tmp_path / "m.onnx"
    staged = external_data.stage_model(model, target)
    loaded = staged.load()
    for a, b in zip(model.graph.initializer, loaded.graph.initializer, strict=True):
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    commit_files(staged.files())
    staged.discard()
    assert staged.sha256 == files_sha256(target, tmp_path / "m.onnx.data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    assert external_data.model_sha256(target) == staged.sha256


def test_checker_still_rejects_a_bad_large_model(small_limit) -> None:
    model = mlp()
    model.graph.node[0].input[1] = "no_such_tensor"
    with pytest.raises(onnx.checker.ValidationError, match="no_such_tensor"):
        external_data.check_model(model)


def test_commit_is_all_or_nothing_with_staged_files(tmp_path, monkeypatch) -> None:
    staged = stage(tmp_path / "big.data", lambda handle: handle.write(b"x" * 10000))
    assert staged.path.parent == tmp_path and staged.path.read_bytes() == b"x" * 10000
    calls = {"n": 0}
    real_replace = os.replace

    def failing_replace(src, dst):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OutputError, match="none of this run's 2 outputs"):
        commit_files({tmp_path / "big.data": staged, tmp_path / "big.onnx": b"skeleton"})
    assert list(tmp_path.iterdir()) == []


def test_staged_files_are_never_stale_while_live(tmp_path) -> None:
    staged = stage(tmp_path / "big.data", lambda handle: handle.write(b"data"))
    old = time.time() - 2 * STALE_AFTER_S
    os.utime(staged.path, (old, old))
    assert remove_stale_temporaries(tmp_path) == []
    assert staged.path.is_file()
    staged.discard()
    assert list(tmp_path.iterdir()) == []


def test_staged_files_commit_from_a_relative_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    staged = stage(Path("out") / "m.data", lambda handle: handle.write(b"weights"))
    commit_files({Path("out") / "m.data": staged, Path("out") / "m.onnx": b"skeleton"})
    assert (tmp_path / "out" / "m.data").read_bytes() == b"weights"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.data", "m.onnx"]


def test_staged_file_must_sit_beside_its_target(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    staged = stage(tmp_path / "a" / "x.data", lambda handle: handle.write(b"1"))
    with pytest.raises(ValueError, match="not staged beside"):
        commit_files({tmp_path / "x.data": Staged(staged.path)})
    staged.discard()


# The real thing: a generated model just over 2 GiB.

BIG_N = 8192
BIG_LAYERS = 8  # 8 x 8192 x 8192 float32 = 2.15 GB of weights, just over 2 GiB


def big_model(folder: Path) -> Path:
    """A MatMul+Relu chain over the limit, written tensor by tensor with external data."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(BIG_LAYERS):
        w = rng.standard_normal((BIG_N, BIG_N), dtype=np.float32)
        w *= 1.0 / np.sqrt(BIG_N)
        inits.append(numpy_helper.from_array(w, f"layer{i}.weight"))
        del w
        nodes.append(
            helper.make_node("MatMul", [x, f"layer{i}.weight"], [f"h{i}"], name=f"/l{i}/MatMul")
        )
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"a{i}"], name=f"/l{i}/Relu"))
        x = f"a{i}"
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", BIG_N])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", BIG_N])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "big.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="big.onnx.data")
    return path


@pytest.mark.skipif(
    os.environ.get("QTOOL_BIG_MODEL_TEST") != "1",
    reason="generates and quantizes a 2.15 GB model (~2 min, ~5 GB RAM on 2 cores); run by hand "
    "with QTOOL_BIG_MODEL_TEST=1, figures in benchmarks/external_data.py",
)
def test_model_over_2_gib(cli, tmp_path) -> None:
    source = big_model(tmp_path)
    assert (tmp_path / "big.onnx.data").stat().st_size > 2**31
    x = np.random.default_rng(1).standard_normal((8, BIG_N)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x)
    recipe = {
        "model": {"onnx": str(source)},
        "inputs": {"x": [1, BIG_N]},
        "calibration": {"data": {"npz": "data.npz"}, "batch_size": 8, "method": "minmax"},
        "evaluation": {"data": {"npz": "data.npz"}, "batch_size": 8},
        "output": {"dir": "out", "float_model": "always"},  # checked below
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = cli("quantize", path, "--no-progress")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    assert (out / "model.fp32.onnx.data").stat().st_size > 2**31
    assert external_tensors(out / "model.int8.onnx")
    _, fingerprint = load_stats(out / "stats.npz")
    assert fingerprint == files_sha256(out / "model.fp32.onnx", out / "model.fp32.onnx.data")
    reference = run_ort(source, x)
    quantized = run_ort(out / "model.int8.onnx", x)
    assert cosine(quantized, reference) > 0.99
    result = cli("evaluate", path, "--json", tmp_path / "eval.json", "--no-progress")
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "eval.json").read_text())["provenance"]["status"] == "match"
