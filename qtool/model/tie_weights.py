"""Tied weights stored once: an initializer that is the transpose of another becomes a Transpose.

A decoder LLM with tied embeddings reads one table twice: its embedding Gather reads W [V, D]
and its lm_head multiplies by Wᵀ. The TorchScript exporter constant-folds that Wᵀ into a second
initializer (SmolLM2-135M: 652 MB exported where its parameters take 542 MB), and so did qtool's
own folding before it learned to keep a Transpose of a shared weight (fold_constants.py). This
pass undoes the copy: the transposed twin is replaced by a Transpose node of the original, so the
prepared float model holds each parameter once, and the plan reads MatMul(x, Transpose(W)) as a
weighted MatMul on W (qtool/plan/ops/matmul.py), quantized as the recipe says.

Only exact transposes of 2-D float initializers of at least `MIN_ELEMENTS` elements are merged:
two different weights never are, and small constants are not worth the comparison.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper

from qtool.model.external_data import tensor_array
from qtool.model.graph_edit import drop_where

__all__ = ["MIN_ELEMENTS", "share_transposed_copies"]

MIN_ELEMENTS = 1 << 10
_FLOAT = onnx.TensorProto.FLOAT
# Elements compared before a full comparison: most pairs of same-shape weights differ at once.
_PROBE = 64


def _array(tensor: onnx.TensorProto) -> np.ndarray:
    """The values without a copy where the bytes are raw (they nearly always are)."""
    if tensor.raw_data and tensor.data_location != onnx.TensorProto.EXTERNAL:
        return np.frombuffer(tensor.raw_data, dtype=np.float32).reshape(tuple(tensor.dims))
    return tensor_array(tensor)


def _probe_positions(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column indices of the probed elements of an [rows, cols] weight."""
    flat = np.linspace(0, rows * cols - 1, num=min(_PROBE, rows * cols)).astype(np.int64)
    return np.divmod(flat, cols)


def _probes(tensor: onnx.TensorProto) -> tuple[np.ndarray, np.ndarray]:
    """The elements the probe compares, read with one load of the weight: where it stands as
    the original `a` (a[rows, cols]) and where it stands as the candidate copy `b` of an `a`
    of the transposed shape (b[cols, rows]). Weights held as external data are read once here
    instead of once per same-shape pair (a 2 GB decoder's square projections made that ~600
    reads of the file)."""
    array = _array(tensor)
    m, n = array.shape
    rows, cols = _probe_positions(m, n)
    rows_t, cols_t = _probe_positions(n, m)
    return array[rows, cols].copy(), array[cols_t, rows_t].copy()


def _transposed(a: np.ndarray, b: np.ndarray) -> bool:
    """b == aᵀ exactly (a [m, n], b [n, m])."""
    return bool(np.array_equal(a.T, b))


def share_transposed_copies(graph: onnx.GraphProto) -> list[dict]:
    """Replace every initializer that is the exact transpose of another by Transpose(original);
    return what was replaced ({"kept", "replaced", "shape"}). The original kept is the one a
    Gather reads (the embedding's [V, D] orientation) when one does, else the first listed."""
    candidates = [
        t
        for t in graph.initializer
        if t.data_type == _FLOAT and len(t.dims) == 2 and int(np.prod(t.dims)) >= MIN_ELEMENTS
    ]
    by_shape: dict[tuple[int, int], list[onnx.TensorProto]] = defaultdict(list)
    for tensor in candidates:
        by_shape[(int(tensor.dims[0]), int(tensor.dims[1]))].append(tensor)
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input}
    replaced: list[dict] = []
    gone: set[str] = set()
    probes: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def probe(tensor: onnx.TensorProto) -> tuple[np.ndarray, np.ndarray]:
        if tensor.name not in probes:
            probes[tensor.name] = _probes(tensor)
        return probes[tensor.name]

    for tensor in sorted(candidates, key=lambda t: t.name not in gathered):
        if tensor.name in gone:
            continue
        rows, cols = int(tensor.dims[0]), int(tensor.dims[1])
        for other in by_shape.get((cols, rows), []):
            if other.name in gone or other.name == tensor.name or tensor.name in gone:
                continue
            # Most same-shape pairs differ in the probed elements: only a match reads both whole.
            if not np.array_equal(probe(tensor)[0], probe(other)[1]):
                continue
            if not _transposed(_array(tensor), _array(other)):
                continue
            gone.add(other.name)
            graph.node.insert(
                0,
                helper.make_node(
                    "Transpose",
                    [tensor.name],
                    [other.name],
                    name=f"{other.name}_tied_Transpose",
                    perm=[1, 0],
                ),
            )
            replaced.append({"kept": tensor.name, "replaced": other.name, "shape": [rows, cols]})
    if gone:
        drop_where(graph.initializer, lambda t: t.name in gone)
    return replaced
