"""Fuse rank-2 MatMul + bias Add into Gemm: the pattern ONNX Runtime fuses into QGemm."""

from __future__ import annotations

import onnx

from qtool.model.graph_edit import STANDARD_DOMAINS, consumer_counts, delete_indexes

__all__ = ["fuse_matmul_add"]


def fuse_matmul_add(graph: onnx.GraphProto, types: dict[str, onnx.TypeProto]) -> bool:
    """MatMul(A[M,K], W[K,N]) + Add(bias[N]) -> Gemm(A, W, bias), named like the MatMul.

    Only where A has rank 2: that is the form ONNX Runtime fuses into QGemm. The 3-D MatMuls of a
    transformer stay MatMul (ORT fuses those into QAttention/MatMulInteger instead). True when
    anything was fused.
    """
    inits = {i.name: i for i in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    consumers = consumer_counts(graph)
    by_output = {o: node for node in graph.node for o in node.output}
    adds_to_drop: list[int] = []  # node indexes (ids of upb wrappers are not stable)
    for index, node in enumerate(graph.node):
        if node.op_type != "Add" or node.domain not in STANDARD_DOMAINS or len(node.input) != 2:
            continue
        for mm_out, bias in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            mm = by_output.get(mm_out)
            if mm is None or mm.op_type != "MatMul" or mm.domain not in STANDARD_DOMAINS:
                continue
            if mm_out in graph_outputs or consumers[mm_out] != 1:
                continue
            if not _gemm_compatible(mm, bias, inits, types):
                continue
            a, w = mm.input
            mm.op_type = "Gemm"
            del mm.input[:]
            mm.input.extend([a, w, bias])
            mm.output[0] = node.output[0]
            adds_to_drop.append(index)
            break
    delete_indexes(graph.node, adds_to_drop)
    return bool(adds_to_drop)


def _gemm_compatible(
    mm: onnx.NodeProto,
    bias: str,
    inits: dict[str, onnx.TensorProto],
    types: dict[str, onnx.TypeProto],
) -> bool:
    a, w = mm.input
    if w not in inits or bias not in inits or len(inits[w].dims) != 2:
        return False
    a_type = types.get(a)
    if a_type is None or not a_type.tensor_type.HasField("shape"):
        return False
    if len(a_type.tensor_type.shape.dim) != 2:
        return False
    n = int(inits[w].dims[1])
    b = inits[bias]
    if b.data_type != inits[w].data_type or a_type.tensor_type.elem_type != b.data_type:
        return False
    # Gemm's C broadcasts one way to [M, N]; a per-output-column bias is the Linear layer case.
    return list(b.dims) in ([n], [1, n])
