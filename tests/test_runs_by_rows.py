"""qtool.ort.sessions.runs_by_rows: a batch whose outputs would be too large for one run (an
LLM's logits) runs a few rows at a time, and together the runs give the whole batch's outputs."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from qtool.ort.sessions import create_session, runs_by_rows


def _session(tmp_path):
    weight = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 4]),
        ],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return create_session(path)


def test_a_batch_over_the_limit_runs_in_row_groups_that_cover_it(tmp_path):
    session = _session(tmp_path)
    x = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    whole = session.run(["y", "z"], {"x": x})
    # one row's outputs are 8 values: a limit of 16 allows two rows a run after the first
    runs = list(runs_by_rows(session, ["y", "z"], {"x": x}, limit=16))
    assert [(r.start, r.stop) for r, _ in runs] == [(0, 1), (1, 3), (3, 5)]
    for index in range(2):
        joined = np.concatenate([outputs[index] for _, outputs in runs])
        np.testing.assert_allclose(joined, whole[index], rtol=1e-6)


def test_a_batch_under_the_limit_is_one_run_of_the_whole_batch(tmp_path):
    session = _session(tmp_path)
    x = np.random.default_rng(2).normal(size=(5, 3)).astype(np.float32)
    runs = list(runs_by_rows(session, ["y"], {"x": x}))
    assert [(r.start, r.stop) for r, _ in runs] == [(0, 5)]
    np.testing.assert_array_equal(runs[0][1][0], session.run(["y"], {"x": x})[0])


def test_a_model_with_a_fixed_batch_dimension_takes_the_whole_batch(tmp_path):
    weight = np.ones((3, 4), np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 4])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "fixed.onnx"
    path.write_bytes(model.SerializeToString())
    x = np.ones((5, 3), np.float32)
    runs = list(runs_by_rows(create_session(path), ["y"], {"x": x}, limit=4))
    assert [(r.start, r.stop) for r, _ in runs] == [(0, 5)]
