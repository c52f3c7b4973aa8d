"""Graph preparation that runs inside `qtool quantize`, so users never run a preprocess step.

The quantizer needs a graph where weights are initializers (not Constant nodes or Identity aliases),
where shape arithmetic has been folded away (so no QDQ pair lands on it), where every tensor has a
known element type, and where 2-D MatMul+Add pairs are a single Gemm (the pattern ONNX Runtime fuses
into QGemm). Torch exporters emit none of that directly.

Why a folder of our own instead of ONNX Runtime's BASIC optimisation level (what
`quant_pre_process` uses): ORT's level-1 pass list also rewrites the graph in ways we must control —
it fuses MatMul+Add into Gemm for 3-D inputs by inserting Reshapes, fuses Conv+Add/Mul/BatchNorm,
shares and renames initializers, renames fused nodes — and the list changes between ORT releases,
so node names that recipe overrides refer to and the byte-for-byte output would depend on the
installed ORT. Here we decide which nodes disappear and only ask ORT to *evaluate* one standard
node at a time on the CPU provider, so folded values are exactly what ORT computes at run time.
(`onnx.reference` was tried first and rejected: its GatherElements fails on the position-id gather
that the dynamo exporter emits for BERT.)
"""

from __future__ import annotations

from collections import Counter

import onnx
from onnx import version_converter

from qtool.errors import ModelError
from qtool.quantize.fold_constants import fold_constants
from qtool.quantize.graph_edit import delete_indexes, drop_where, subgraph_names
from qtool.quantize.shapes import infer, write_inference

__all__ = ["prepare_model", "tensor_types"]

# Folding can expose more static shapes (a Reshape whose shape input became constant); a handful
# of rounds reaches the fixed point on every exporter graph we have seen.
_MAX_FOLD_ROUNDS = 8


def prepare_model(model: onnx.ModelProto, *, min_opset: int = 17) -> onnx.ModelProto:
    """Return a copy of `model` ready for QDQ insertion; `model` itself is not modified.

    Steps: upgrade the default-domain opset to `min_opset`; turn initializers listed as graph inputs
    into plain weights; remove Identity nodes; fold every node computable from constants (including
    Shape/Size of tensors whose shape is static); fuse rank-2 MatMul+Add into Gemm; drop dead nodes
    and initializers; name unnamed nodes `{op_type}_{index}`; run ONNX shape inference so every
    tensor carries its element type. Deterministic: the same input gives byte-identical output.

    Raises ModelError when the opset cannot be upgraded or a tensor's element type stays unknown.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _upgrade_opset(out, min_opset)
    graph = out.graph
    _initializer_inputs_to_weights(graph)
    _remove_identities(graph)
    opsets = {o.domain: o.version for o in out.opset_import}
    inference = infer(out)
    for _ in range(_MAX_FOLD_ROUNDS):
        changed = fold_constants(graph, opsets, inference.types())
        changed |= _remove_dead(graph)
        if not changed:
            break
        inference = infer(out)
    _fuse_matmul_add(graph, inference.types())
    _remove_dead(graph)
    _name_nodes(graph)
    _refresh_value_info(out)
    _check_types_known(out)
    return out


def tensor_types(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | str | None] | None]]:
    """Map every typed value name of the main graph to (onnx elem_type, shape).

    Dims are ints when static, the symbolic name when symbolic, None when unknown; the whole shape
    is None when even the rank is unknown (so it is never confused with a scalar's empty list).
    """
    result: dict[str, tuple[int, list[int | str | None] | None]] = {}
    graph = model.graph
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            result[vi.name] = _type_of(vi.type.tensor_type)
    for init in graph.initializer:
        result[init.name] = (init.data_type, [int(d) for d in init.dims])
    return result


def _type_of(tensor_type: onnx.TypeProto.Tensor) -> tuple[int, list[int | str | None] | None]:
    if not tensor_type.HasField("shape"):
        return tensor_type.elem_type, None
    dims: list[int | str | None] = []
    for d in tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return tensor_type.elem_type, dims


def _default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    raise ModelError(f"model {model.graph.name!r} imports no ai.onnx opset")


def _upgrade_opset(model: onnx.ModelProto, min_opset: int) -> None:
    current = _default_opset(model)
    if current >= min_opset:
        return
    try:
        converted = version_converter.convert_version(model, min_opset)
    except Exception as exc:  # the C++ converter raises bare RuntimeError/ValueError
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"cannot upgrade model {model.graph.name!r} from opset {current} to {min_opset}: "
            f"{reason}"
        ) from exc
    if _default_opset(converted) < min_opset:
        raise ModelError(
            f"cannot upgrade model {model.graph.name!r} from opset {current} to {min_opset}"
        )
    model.CopyFrom(converted)


def _initializer_inputs_to_weights(graph: onnx.GraphProto) -> None:
    """Old exporters list every weight as a graph input; the quantizer needs them as constants."""
    init_names = {i.name for i in graph.initializer}
    keep = [vi for vi in graph.input if vi.name not in init_names]
    if len(keep) != len(graph.input):
        del graph.input[:]
        graph.input.extend(keep)


def _remove_identities(graph: onnx.GraphProto) -> None:
    """Drop Identity nodes: activations are rewired, constant aliases become their own weights.

    An Identity of an initializer is how the TorchScript exporter deduplicates weights that are
    equal (e.g. zero biases of different layers); copying the tensor under the alias name keeps the
    module-path weight name and gives each layer its own weight to quantize.
    """
    inits = {i.name: i for i in graph.initializer}
    graph_inputs = {i.name for i in graph.input}
    graph_outputs = {o.name for o in graph.output}
    protected = subgraph_names(graph)
    rename: dict[str, str] = {}  # consumer input name -> replacement
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            kept.append(node)
            continue
        src = rename.get(node.input[0], node.input[0])
        dst = node.output[0]
        if dst in graph_outputs or dst in protected:
            # The name must survive: rename the producer's output instead, unless that tensor is not
            # produced by a node, in which case the Identity is the only correct graph.
            pinned = graph_inputs | graph_outputs | protected | set(inits)
            if src in pinned:
                kept.append(node)
                continue
            _rename_tensor(graph, kept, src, dst)
            rename = {k: (dst if v == src else v) for k, v in rename.items()}
            rename[src] = dst
        elif src in inits:
            copy = onnx.TensorProto()
            copy.CopyFrom(inits[src])
            copy.name = dst
            graph.initializer.append(copy)
            inits[dst] = copy
        else:
            rename[dst] = src
    for node in kept:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    del graph.node[:]
    graph.node.extend(kept)


def _rename_tensor(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], old: str, new: str) -> None:
    for node in nodes:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
    for vi in graph.value_info:
        if vi.name == old:
            vi.name = new


def _remove_dead(graph: onnx.GraphProto) -> bool:
    """Drop nodes and initializers nothing reads; True when anything was removed."""
    needed = {o.name for o in graph.output} | subgraph_names(graph)
    dead: list[int] = []
    for index in range(len(graph.node) - 1, -1, -1):
        node = graph.node[index]
        if any(o in needed for o in node.output if o):
            needed.update(n for n in node.input if n)
        else:
            dead.append(index)
    delete_indexes(graph.node, dead)
    return bool(dead) | bool(drop_where(graph.initializer, lambda t: t.name not in needed))


def _fuse_matmul_add(graph: onnx.GraphProto, types: dict[str, onnx.TypeProto]) -> None:
    """MatMul(A[M,K], W[K,N]) + Add(bias[N]) -> Gemm(A, W, bias), named like the MatMul.

    Only where A has rank 2: that is the form ONNX Runtime fuses into QGemm. The 3-D MatMuls of a
    transformer stay MatMul (ORT fuses those into QAttention/MatMulInteger instead).
    """
    inits = {i.name: i for i in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    consumers: Counter[str] = Counter(n for node in graph.node for n in node.input)
    consumers.update(subgraph_names(graph))
    by_output = {o: node for node in graph.node for o in node.output}
    adds_to_drop: set[int] = set()
    for node in graph.node:
        if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        for mm_out, bias in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            mm = by_output.get(mm_out)
            if mm is None or mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx"):
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
            adds_to_drop.add(id(node))
            break
    if adds_to_drop:
        kept = [n for n in graph.node if id(n) not in adds_to_drop]
        del graph.node[:]
        graph.node.extend(kept)


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


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Give every node a unique name; recipe overrides and reports address layers by it."""
    used = Counter(n.name for n in graph.node if n.name)
    seen: set[str] = set()
    for index, node in enumerate(graph.node):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        base = node.name or f"{node.op_type}_{index}"
        name, k = base, 0
        while name in seen or (name != node.name and used[name]):
            k += 1
            name = f"{base}_{k}"
        node.name = name
        seen.add(name)


def _refresh_value_info(model: onnx.ModelProto) -> None:
    """Recompute value_info for standard-op outputs; keep exporter types for custom-op outputs."""
    graph = model.graph
    custom = {o for n in graph.node if n.domain not in ("", "ai.onnx") for o in n.output}
    keep = [vi for vi in graph.value_info if vi.name in custom]
    del graph.value_info[:]
    graph.value_info.extend(keep)
    write_inference(model, infer(model))


def _check_types_known(model: onnx.ModelProto) -> None:
    known = tensor_types(model)
    for node in model.graph.node:
        for out in node.output:
            if out and out not in known:
                raise ModelError(
                    f"element type of tensor {out!r} (output of node {node.name!r}, "
                    f"{node.op_type}) cannot be inferred"
                )
