"""A staged model calibrated part by part gives the statistics one session gives, holding one
part's weights at a time.

The model is a small stack of residual blocks whose every block also reads a second graph input
(as a decoder's layers read the attention mask), with a head at the end that no observed tensor
needs (an LLM's lm_head); it is written with every weight as external data, as a staged float
model is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration import collect as collect_module
from qtool.calibration.collect import collect
from qtool.calibration.parts import split_model
from qtool.data.batches import Batch

K, BLOCKS = 16, 5
WEIGHT_BYTES = K * K * 4


def _blocks() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    h = "x"
    for b in range(BLOCKS):
        w = f"w{b}"
        weights.append(numpy_helper.from_array(rng.normal(size=(K, K)).astype(np.float32), w))
        nodes += [
            helper.make_node("Mul", [h, "gate"], [f"gated{b}"], name=f"gate{b}"),
            helper.make_node("MatMul", [f"gated{b}", w], [f"m{b}"], name=f"mm{b}"),
            helper.make_node("Tanh", [f"m{b}"], [f"t{b}"], name=f"tanh{b}"),
            helper.make_node("Add", [h, f"t{b}"], [f"h{b}"], name=f"res{b}"),
        ]
        h = f"h{b}"
    weights.append(numpy_helper.from_array(rng.normal(size=(K, 4 * K)).astype(np.float32), "head"))
    nodes.append(helper.make_node("MatMul", [h, "head"], ["logits"], name="lm_head"))
    graph = helper.make_graph(
        nodes,
        "blocks",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", K]),
            helper.make_tensor_value_info("gate", TensorProto.FLOAT, ["b", "s", 1]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 4 * K])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnx.shape_inference.infer_shapes(model)


def _batches() -> list[Batch]:
    rng = np.random.default_rng(1)
    return [
        Batch(
            {
                "x": rng.normal(size=(n, 3, K)).astype(np.float32),
                "gate": rng.uniform(0.5, 1.5, size=(n, 3, 1)).astype(np.float32),
            },
            None,
        )
        for n in (2, 1, 3)
    ]


@pytest.fixture
def staged(tmp_path: Path) -> tuple[onnx.ModelProto, Path]:
    """The model's structure, every weight a reference into model.onnx.data in `tmp_path`."""
    onnx.save(_blocks(), tmp_path / "model.onnx", save_as_external_data=True, size_threshold=0)
    return onnx.load(tmp_path / "model.onnx", load_external_data=False), tmp_path


def test_parts_hold_at_most_their_share_of_weights_and_skip_what_nobody_observes(staged):
    model, _ = staged
    observed = [f"gated{b}" for b in range(BLOCKS)] + ["t1", "t4"]
    parts = split_model(model, observed, 2 * WEIGHT_BYTES)
    assert parts is not None
    held = [[t.name for t in part.model.graph.initializer] for part in parts]
    assert held == [["w0", "w1"], ["w2", "w3"], ["w4"]]  # two blocks' weights per part
    assert all(
        t.data_location == TensorProto.EXTERNAL
        for part in parts
        for t in part.model.graph.initializer
    )
    assert [part.observed for part in parts] == [
        ("gated0", "gated1", "gated2", "t1"),
        ("gated3", "gated4"),
        ("t4",),
    ]
    # what crosses a boundary: the residual stream, the observed tensor a later block reads,
    # and the second graph input every block reads
    assert parts[0].passes_on == ("gated2", "h1") and parts[1].feeds == ("gated2", "h1", "gate")
    assert parts[1].passes_on == ("gated4",) and parts[2].feeds == ("gated4",)
    every_node = [n.name for part in parts for n in part.model.graph.node]
    assert "lm_head" not in every_node and "res4" not in every_node  # nothing observed needs them
    # an observed graph input is no part's: the caller reads it from the batches
    with_input = split_model(model, ["x", *observed], 2 * WEIGHT_BYTES)
    assert [part.observed for part in with_input] == [part.observed for part in parts]
    # one part would hold it all, or a weight is observed: not split
    assert split_model(model, observed, 10 * WEIGHT_BYTES) is None
    assert split_model(model, ["w1", *observed], 2 * WEIGHT_BYTES) is None


def test_a_model_with_a_subgraph_is_not_split(staged):
    model, _ = staged
    branch = helper.make_graph(
        [helper.make_node("Identity", ["h0"], ["y"])],
        "branch",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model.graph.node.append(
        helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch)
    )
    assert split_model(model, ["gated3"], 2 * WEIGHT_BYTES) is None


def test_calibration_in_parts_gives_the_one_session_statistics(staged, monkeypatch):
    """Ranges and Hessians of every observed tensor are the same bytes in parts as in one
    session, and the finished Hessians are read back from disk rather than held."""
    model, folder = staged
    whole = onnx.load(folder / "model.onnx")
    ranges = [f"m{b}" for b in range(BLOCKS)] + ["h2"]
    hessians = ["x"] + [f"gated{b}" for b in range(BLOCKS)]  # a graph input too
    kwargs = {"bins": 64, "hessian_tensors": hessians, "progress": False}
    stats_one, xtx_one = collect(whole, ranges, _batches(), **kwargs)
    split = []
    monkeypatch.setattr(collect_module, "PART_BYTES", 2 * WEIGHT_BYTES)
    monkeypatch.setattr(
        collect_module,
        "split_model",
        lambda *a: split.append(split_model(*a)) or split[-1],
    )
    stats_parts, xtx_parts = collect(model, ranges, _batches(), model_dir=folder, **kwargs)
    assert len(split[0]) == 3
    for one, parts in zip(stats_one, stats_parts, strict=True):
        assert one.name == parts.name
        assert (one.minimum, one.maximum, one.half_range, one.samples) == (
            parts.minimum,
            parts.maximum,
            parts.half_range,
            parts.samples,
        )
        assert np.array_equal(one.counts, parts.counts)
    for name in hessians:
        assert xtx_parts[name]._packed is None and xtx_parts[name]._stored is not None
        assert np.array_equal(xtx_parts[name].xtx, xtx_one[name].xtx)
        assert xtx_parts[name].rows == xtx_one[name].rows == 6 * 3
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
