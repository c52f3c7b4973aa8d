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
from qtool.model import external_data
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
