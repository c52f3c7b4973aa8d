"""Graph preparation that runs inside `qtool quantize`, so users never run a preprocess step.

The quantizer needs a graph where weights are initializers (not Constant nodes or Identity aliases),
where shape arithmetic has been folded away (so no QDQ pair lands on it), where every tensor has a
known element type, where BatchNormalization is folded into the layer before it, and where 2-D
MatMul+Add pairs are a single Gemm (the pattern ONNX Runtime fuses into QGemm). Torch exporters emit
none of that directly. The passes live in their own modules: fold_constants, fold_bn, fuse_gemm,
fold_pad and shapes (ONNX shape inference without the cost of serializing the weights).

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
from qtool.model.external_data import convert_without_weights
from qtool.model.fold_bn import fold_batch_norms
from qtool.model.fold_constants import fold_constants
from qtool.model.fold_pad import fold_pads
from qtool.model.fuse_gemm import fuse_matmul_add
from qtool.model.graph_edit import delete_indexes, drop_where, subgraph_names
from qtool.model.opset21 import TARGET_OPSET, upgrade_to_opset21_in_place
from qtool.model.shapes import Inference, infer, write_inference
from qtool.model.tie_weights import share_transposed_copies

__all__ = ["prepare_model", "tensor_types"]

# Folding can expose more static shapes (a Reshape whose shape input became constant); a handful
# of rounds reaches the fixed point on every exporter graph we have seen.
_MAX_FOLD_ROUNDS = 8


def prepare_model(
    model: onnx.ModelProto, *, min_opset: int = 17, copy: bool = True
) -> onnx.ModelProto:
    """Return a copy of `model` ready for QDQ insertion; `model` itself is not modified, unless
    `copy=False` (a caller that drops `model` anyway: a 2 GB model is then not held twice).

    Steps: upgrade the default-domain opset to `min_opset`; turn initializers listed as graph inputs
    into plain weights; remove Identity nodes; replace an initializer that is the transpose of
    another by a Transpose of it (tied embeddings, stored once); fold every node computable from
    constants (including Shape/Size of tensors whose shape is static and CastLike of a constant),
    except a Transpose of a weight other nodes read too (the tied lm_head); fuse rank-2 MatMul+Add
    into Gemm; fold inference-mode BatchNormalization into the Conv/ConvTranspose/Gemm before it
    (and into a rank-2 MatMul, which becomes a Gemm); fold a constant-zero spatial Pad into the
    Conv it feeds (TensorFlow "same" padding, exported as Pad -> Conv);
    drop dead nodes and initializers; name unnamed nodes `{op_type}_{index}`; run ONNX shape
    inference, seeded with the exporter's types, so every tensor carries its element type.
    Deterministic: the same input gives byte-identical output.

    Raises ModelError when the opset cannot be upgraded or a tensor's element type stays unknown.
    """
    out = model
    if copy:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    _upgrade_opset(out, min_opset)
    graph = out.graph
    _initializer_inputs_to_weights(graph)
    _remove_identities(graph)
    share_transposed_copies(graph)  # a tied embedding stored once (tie_weights.py)
    opsets = {o.domain: o.version for o in out.opset_import}
    inference = _infer_seeded(out)
    for _ in range(_MAX_FOLD_ROUNDS):
        changed = fold_constants(graph, opsets, inference.types())
        changed |= _remove_dead(graph)
        if not changed:
            break
        inference = _infer_seeded(out)
    # One inference serves the passes below and the output when they change nothing.
    types = inference.types()
    changed = fuse_matmul_add(graph, types)
    changed |= fold_batch_norms(graph, types)
    changed |= fold_pads(graph, types)
    if changed:
        _remove_dead(graph)
        inference = _infer_seeded(out)
    _name_nodes(graph)
    write_inference(out, inference)
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
    raise ModelError("the model imports no ai.onnx opset")


def _upgrade_opset(model: onnx.ModelProto, min_opset: int) -> None:
    """Raise the default-domain opset to `min_opset`, in place. The converters copy the whole
    proto: they run on the model without its weights (external_data.convert_without_weights), so
    a model is never held twice (nor serialized past protobuf's limit)."""
    current = _default_opset(model)
    if current >= min_opset:
        return
    if min_opset == TARGET_OPSET:  # INT4 / blocked weights: the op-by-op upgrade with its fixes
        upgrade_to_opset21_in_place(model)
        return

    def convert(skeleton: onnx.ModelProto) -> onnx.ModelProto:
        try:
            converted = version_converter.convert_version(skeleton, min_opset)
        except Exception as exc:  # the C++ converter raises bare RuntimeError/ValueError
            text = str(exc).strip()
            reason = text.splitlines()[-1] if text else type(exc).__name__
            raise ModelError(
                f"cannot upgrade the model from opset {current} to {min_opset}: {reason}"
            ) from exc
        if _default_opset(converted) < min_opset:
            raise ModelError(f"cannot upgrade the model from opset {current} to {min_opset}")
        return converted

    convert_without_weights(model, convert)


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


def _infer_seeded(model: onnx.ModelProto) -> Inference:
    """Shape inference that starts from the types the exporter wrote.

    ONNX inference invents a fresh symbol for every dimension it cannot derive (the batch after a
    Reshape to [-1, S, H] becomes `unk__6`), where the exporter wrote the same symbol (`batch`)
    for the whole residual stream. ONNX Runtime fuses Add + LayerNormalization into
    SkipLayerNormalization only when both Add inputs have the same shape, symbols included: with
    the invented symbols, half the fusions of a BERT encoder are lost. So the exporter's entries for
    tensors that still exist seed inference, which keeps them where it cannot do better.
    """
    graph = model.graph
    produced = {o for node in graph.node for o in node.output if o}
    produced -= {o.name for o in graph.output}
    seen: set[str] = set()

    def stale(vi: onnx.ValueInfoProto) -> bool:
        keep = vi.name in produced and vi.name not in seen
        seen.add(vi.name)
        return not keep

    drop_where(graph.value_info, stale)
    return infer(model)


def _check_types_known(model: onnx.ModelProto) -> None:
    known = tensor_types(model)
    for node in model.graph.node:
        for out in node.output:
            if out and out not in known:
                if not onnx.defs.has(node.op_type, node.domain):
                    domain = node.domain or "ai.onnx"
                    raise ModelError(
                        f"node {node.name!r} is {node.op_type} of domain {domain!r}, an operator "
                        f"ONNX does not define: the element type of its output {out!r} is "
                        "unknown (declare it in the model's value_info)"
                    )
                raise ModelError(
                    f"element type of tensor {out!r} (output of node {node.name!r}, "
                    f"{node.op_type}) cannot be inferred"
                )
