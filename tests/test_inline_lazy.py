"""Large single-file models read without their weights (qtool/model/inline_lazy.py) and written
back as one file by streaming (qtool/model/inline_write.py): the same model, byte for byte, as
onnx's own loader and serializer give, with the weights left in their files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import ModelError
from qtool.model import external_data, inline_lazy
from qtool.model.external_data import is_lazy, lazy_file, read_lazy_weights, tensor_array
from qtool.model.inline_lazy import load_inline_lazy
from qtool.model.inline_write import write_inline
from qtool.model.load import load_onnx


def _decoderish(seed: int = 0) -> onnx.ModelProto:
    """Two large weights (one of them 4-bit, sub-byte packed), a small one, an int64 shape
    constant, metadata on both sides of the graph field: every part the reader splits."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((256, 96)).astype(np.float32)
    w2 = rng.standard_normal((96, 256)).astype(np.float32)
    bias = rng.standard_normal(256).astype(np.float32)
    packed = helper.make_tensor("packed", TensorProto.INT4, [1 << 18], rng.bytes(1 << 17), raw=True)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("MatMul", ["h", "w2"], ["y0"], name="mm2"),
        helper.make_node("Add", ["y0", "bias"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "decoderish",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(w2, "w2"),
            numpy_helper.from_array(bias, "bias"),
            packed,
            numpy_helper.from_array(np.array([1, 256], np.int64), "shape"),
        ],
        doc_string="a graph doc string after the initializers",
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    helper.set_model_props(model, {"source": "test"})
    return model


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "model.onnx"
    path.write_bytes(_decoderish().SerializeToString())
    return path


def test_the_large_weights_stay_in_the_file_and_read_back_exactly(model_file):
    digest = hashlib.sha256()
    lazy = load_inline_lazy(model_file, digest)
    assert lazy is not None and is_lazy(lazy)
    assert digest.hexdigest() == hashlib.sha256(model_file.read_bytes()).hexdigest()
    reference = onnx.load(str(model_file))
    by_name = {t.name: t for t in reference.graph.initializer}
    lazy_names = {t.name for t in lazy.graph.initializer if lazy_file(t) is not None}
    assert lazy_names == {"w1", "w2", "packed"}  # bias, shape: under 64 kB, parsed whole
    for tensor in lazy.graph.initializer:
        np.testing.assert_array_equal(
            tensor_array(tensor), numpy_helper.to_array(by_name[tensor.name])
        )
    # The proto holds the graph, not the weights.
    assert lazy.ByteSize() < model_file.stat().st_size // 4
    read_lazy_weights(lazy)
    assert lazy.SerializeToString() == model_file.read_bytes()


def test_writing_streams_the_same_bytes_as_serializing(model_file, tmp_path):
    lazy = load_inline_lazy(model_file)
    lazy.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "added"))
    out = tmp_path / "written.onnx"
    with open(out, "wb") as handle:
        written = write_inline(lazy, handle)
    read_lazy_weights(lazy)
    expected = lazy.SerializeToString()
    assert out.read_bytes() == expected and written == len(expected)


def test_a_file_the_reader_does_not_take_is_left_to_onnx(tmp_path, model_file):
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(model_file.read_bytes()[:-1000])
    assert load_inline_lazy(truncated) is None
    with pytest.raises(ModelError, match="truncated.onnx: not a readable ONNX model"):
        load_onnx(truncated)
    typed = _decoderish()
    w1 = typed.graph.initializer[0]
    values = numpy_helper.to_array(w1).reshape(-1).tolist()
    w1.ClearField("raw_data")
    w1.float_data.extend(values)  # a large weight in the typed field: read the ordinary way
    path = tmp_path / "typed.onnx"
    path.write_bytes(typed.SerializeToString())
    assert load_inline_lazy(path) is None


def test_load_onnx_takes_the_lazy_path_from_the_staging_size_on(model_file, monkeypatch):
    assert not is_lazy(load_onnx(model_file))  # under the threshold: read whole
    monkeypatch.setattr(external_data, "STAGE_WEIGHTS_THRESHOLD", 1024)
    digest, files = hashlib.sha256(), []
    loaded = load_onnx(model_file, digest, files)
    assert is_lazy(loaded) and files == [model_file]
    assert digest.hexdigest() == hashlib.sha256(model_file.read_bytes()).hexdigest()


def test_a_weight_shorter_than_its_dims_is_named(tmp_path, monkeypatch):
    model = _decoderish()
    w1 = model.graph.initializer[0]
    w1.raw_data = w1.raw_data[:-4]
    path = tmp_path / "short.onnx"
    path.write_bytes(model.SerializeToString())
    monkeypatch.setattr(external_data, "STAGE_WEIGHTS_THRESHOLD", 1024)
    with pytest.raises(
        ModelError,
        match=r"short.onnx: initializer 'w1' has dims \[256, 96\].*"
        r"but holds 98300 bytes of data",
    ):
        load_onnx(path)


def test_every_command_runs_on_a_large_single_file_model(tmp_path, monkeypatch, cli):
    """calibrate, quantize and evaluate on a single-file model read lazily (the threshold
    lowered): the weights stay in the user's file until staging, every ORT session gets files
    it accepts, and the quantized model matches what the ordinary load gives."""
    import json

    import yaml
    from test_external_data import FEATURES, mlp

    contents = {}
    for lazy in (False, True):
        folder = tmp_path / ("lazy" if lazy else "whole")
        folder.mkdir()
        (folder / "model.onnx").write_bytes(mlp().SerializeToString())
        x = np.random.default_rng(1).standard_normal((64, FEATURES)).astype(np.float32)
        np.savez(folder / "data.npz", x=x)
        recipe = {
            "model": {"onnx": "model.onnx"},
            "inputs": {"x": [1, FEATURES]},
            "calibration": {"data": {"npz": "data.npz"}, "batch_size": 16, "method": "percentile"},
            "evaluation": {"data": {"npz": "data.npz"}, "batch_size": 32},
            "output": {"dir": "out"},
        }
        (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
        read_lazily = []

        def load_and_count(path, digest=None, seen=read_lazily):
            model = load_inline_lazy(path, digest)
            seen.append(model is not None and is_lazy(model))
            return model

        with monkeypatch.context() as patch:
            patch.setattr(inline_lazy, "load_inline_lazy", load_and_count)
            if lazy:
                patch.setattr(external_data, "STAGE_WEIGHTS_THRESHOLD", 64 << 10)
            for command in ("calibrate", "quantize", "evaluate"):
                result = cli(command, folder / "recipe.yaml", "--no-progress")
                assert result.exit_code == 0, (command, result.stderr)
        # calibrate and quantize read the user's file (evaluate reads the float copy they wrote)
        assert read_lazily == ([True, True] if lazy else [])
        report = json.loads((folder / "out" / "report.json").read_text())
        assert report["size"]["source_model_bytes"] == (folder / "model.onnx").stat().st_size
        (written,) = (folder / "out").glob("model.int*.onnx")
        model = onnx.load(str(written))
        kept = [p for p in model.metadata_props if not p.key.startswith("qtool.")]
        del model.metadata_props[:]
        model.metadata_props.extend(kept)
        contents[lazy] = model.SerializeToString()
    assert contents[True] == contents[False]
