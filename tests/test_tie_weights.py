"""qtool/model/tie_weights.py: a transposed copy of a weight becomes a Transpose of the original,
only exact transposes are merged, and each weight is read once however many same-shape
weights it is compared with (a 2 GB decoder's square projections once made ~600 reads)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.model import tie_weights


def _graph(initializers: dict[str, np.ndarray], gathered: str | None = None) -> onnx.GraphProto:
    nodes = []
    if gathered:
        nodes.append(helper.make_node("Gather", [gathered, "ids"], ["h"]))
    for name in initializers:
        nodes.append(helper.make_node("Identity", [name], [f"{name}_out"]))
    return helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["s"])],
        [helper.make_tensor_value_info(f"{n}_out", TensorProto.FLOAT, None) for n in initializers],
        [numpy_helper.from_array(a, n) for n, a in initializers.items()],
    )


def test_the_transposed_copy_becomes_a_transpose_of_the_gathered_table():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((96, 64)).astype(np.float32)
    graph = _graph({"head_t": table.T.copy(), "embed": table}, gathered="embed")
    replaced = tie_weights.share_transposed_copies(graph)
    assert replaced == [{"kept": "embed", "replaced": "head_t", "shape": [96, 64]}]
    assert [t.name for t in graph.initializer] == ["embed"]
    transpose = graph.node[0]
    assert (transpose.op_type, list(transpose.input), list(transpose.output)) == (
        "Transpose",
        ["embed"],
        ["head_t"],
    )


def test_a_weight_equal_at_every_probed_element_but_one_is_not_merged():
    rng = np.random.default_rng(1)
    square = rng.standard_normal((64, 64)).astype(np.float32)
    almost = square.T.copy()
    rows, cols = tie_weights._probe_positions(64, 64)
    probed = set(zip(cols.tolist(), rows.tolist(), strict=True))
    spot = next((r, c) for r in range(64) for c in range(64) if (r, c) not in probed)
    almost[spot] += 1.0  # differs only where the probe does not look
    graph = _graph({"a": square, "b": almost})
    assert tie_weights.share_transposed_copies(graph) == []
    assert [t.name for t in graph.initializer] == ["a", "b"]


def test_same_shape_weights_are_each_read_once(monkeypatch):
    rng = np.random.default_rng(2)
    weights = {f"w{i}": rng.standard_normal((48, 48)).astype(np.float32) for i in range(8)}
    reads: list[str] = []
    real = tie_weights._array

    def counted(tensor: onnx.TensorProto) -> np.ndarray:
        reads.append(tensor.name)
        return real(tensor)

    monkeypatch.setattr(tie_weights, "_array", counted)
    graph = _graph(weights)
    assert tie_weights.share_transposed_copies(graph) == []
    assert sorted(reads) == sorted(weights)  # 8 reads, where every pair once read both (56)
