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

import logging
from collections import Counter
from collections.abc import Iterable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper, shape_inference, version_converter

from qtool.errors import ModelError
from qtool.quantize.fold_bn import fold_batch_norms

__all__ = ["prepare_model", "tensor_types"]

_log = logging.getLogger(__name__)

# Folding these would change results run to run (random ops) or dissolve quantization that is
# already in the model (Q/DQ): they stay even when all their inputs are constant.
_NEVER_FOLD = frozenset(
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "QuantizeLinear",
        "DequantizeLinear",
    }
)
_GRAPH_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
# A folded tensor larger than this AND larger than its inputs together is left as a node: folding
# Expand/Tile/ConstantOfShape would bloat the file without removing any work worth removing.
_MAX_GROWTH_BYTES = 1 << 20
# Folding can expose more static shapes (a Reshape whose shape input became constant); a handful
# of rounds reaches the fixed point on every exporter graph we have seen.
_MAX_FOLD_ROUNDS = 8


def prepare_model(model: onnx.ModelProto, *, min_opset: int = 17) -> onnx.ModelProto:
    """Return a copy of `model` ready for QDQ insertion; `model` itself is not modified.

    Steps: upgrade the default-domain opset to `min_opset`; turn initializers listed as graph inputs
    into plain weights; remove Identity nodes; fold every node computable from constants (including
    Shape/Size of tensors whose shape is static); fold inference BatchNormalization into the
    Conv/ConvTranspose/Gemm before it; fuse rank-2 MatMul+Add into Gemm; drop dead nodes
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
    for _ in range(_MAX_FOLD_ROUNDS):
        types = _infer(out)
        changed = _fold_constants(graph, opsets, types)
        changed |= _remove_dead(graph)
        if not changed:
            break
    if fold_batch_norms(graph):
        _remove_dead(graph)
    _fuse_matmul_add(graph, _infer(out))
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


def _subgraph_names(graph: onnx.GraphProto) -> set[str]:
    """Names read inside If/Loop/Scan bodies: outer-scope ones among them must not vanish.

    Over-approximates (names local to a body are included too), which only makes passes more
    careful, never wrong.
    """
    names: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            bodies = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
            for body in bodies:
                names.update(n for inner in body.node for n in inner.input)
                names.update(o.name for o in body.output)
                names.update(_subgraph_names(body))
    return names


def _remove_identities(graph: onnx.GraphProto) -> None:
    """Drop Identity nodes: activations are rewired, constant aliases become their own weights.

    An Identity of an initializer is how the TorchScript exporter deduplicates weights that are
    equal (e.g. zero biases of different layers); copying the tensor under the alias name keeps the
    module-path weight name and gives each layer its own weight to quantize.
    """
    inits = {i.name: i for i in graph.initializer}
    graph_inputs = {i.name for i in graph.input}
    graph_outputs = {o.name for o in graph.output}
    protected = _subgraph_names(graph)
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


def _infer(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Shape inference without touching `model`: folding only needs the result to read from."""
    g = _inferred(model).graph
    return {vi.name: vi.type for vi in [*g.input, *g.value_info, *g.output]}


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    # Non-strict: a node ONNX cannot infer (custom domain) must not stop inference elsewhere.
    try:
        return shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        name = model.graph.name
        raise ModelError(f"ONNX shape inference failed on model {name!r}: {detail}") from exc


def _static_shape(t: onnx.TypeProto | None) -> list[int] | None:
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    dims = t.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return [int(d.dim_value) for d in dims]


class _Constants:
    """Constant tensors by name, decoded to numpy only when a fold reads them.

    Decoding every weight up front would copy the whole model once per folding round; most
    weights feed Conv/MatMul nodes that never fold.
    """

    def __init__(self, initializers: Iterable[onnx.TensorProto]) -> None:
        self._protos = {t.name: t for t in initializers}
        self._arrays: dict[str, np.ndarray] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._arrays or name in self._protos

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self._protos[name])
        return self._arrays[name]

    def add(self, name: str, value: np.ndarray) -> None:
        self._arrays[name] = value

    def shape(self, name: str) -> list[int] | None:
        if name in self._arrays:
            return list(self._arrays[name].shape)
        return [int(d) for d in self._protos[name].dims] if name in self._protos else None

    def nbytes(self, name: str) -> int:
        if name in self._arrays:
            return int(self._arrays[name].nbytes)
        proto = self._protos[name]
        itemsize = helper.tensor_dtype_to_np_dtype(proto.data_type).itemsize
        return int(np.prod(proto.dims, dtype=np.int64)) * itemsize


def _fold_constants(
    graph: onnx.GraphProto, opsets: dict[str, int], types: dict[str, onnx.TypeProto]
) -> bool:
    """Replace nodes computable from constants by initializers; True when anything changed."""
    consts = _Constants(graph.initializer)
    graph_outputs = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    for node in graph.node:
        values = _try_fold(node, consts, opsets, types)
        if values is None or any(o in graph_outputs for o in node.output):
            kept.append(node)
            continue
        for name, value in zip([o for o in node.output if o], values, strict=True):
            consts.add(name, value)
            new_inits.append(numpy_helper.from_array(value, name))
    if not new_inits:
        return False
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(new_inits)
    folded = {t.name for t in new_inits}
    keep_vi = [vi for vi in graph.value_info if vi.name not in folded]
    del graph.value_info[:]
    graph.value_info.extend(keep_vi)
    return True


def _try_fold(
    node: onnx.NodeProto,
    consts: _Constants,
    opsets: dict[str, int],
    types: dict[str, onnx.TypeProto],
) -> list[np.ndarray] | None:
    if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER_FOLD:
        return None
    if any(a.type in _GRAPH_ATTRS for a in node.attribute):
        return None
    if node.op_type in ("Shape", "Size"):
        shape = consts.shape(node.input[0])
        shape = shape if shape is not None else _static_shape(types.get(node.input[0]))
        return None if shape is None else [_shape_value(node, shape)]
    if node.op_type == "CastLike":
        # Only the element type of the second input matters, and the exporters pass an
        # activation there (CastLike(0, x) builds zero biases): fold it as the Cast it is.
        node = _castlike_as_cast(node, consts, types)
        if node is None:
            return None
    inputs = [n for n in node.input if n]
    if not all(n in consts for n in inputs):
        return None
    in_bytes = sum(consts.nbytes(n) for n in inputs)
    # A Constant node is a weight written inline: it always becomes an initializer.
    limit = node.op_type != "Constant"
    for out in node.output if limit else ():
        shape = _static_shape(types.get(out))
        if shape is not None and _too_big(int(np.prod(shape, dtype=np.int64)) * 8, in_bytes):
            return None
    try:
        values = _evaluate(node, consts, opsets)
    except Exception as exc:  # e.g. an op this ORT build has no CPU kernel for
        _log.warning("not folding %s (%s): %s", node.name or node.output[0], node.op_type, exc)
        return None
    if limit and any(_too_big(v.nbytes, in_bytes) for v in values):
        return None
    return values


def _castlike_as_cast(
    node: onnx.NodeProto, consts: _Constants, types: dict[str, onnx.TypeProto]
) -> onnx.NodeProto | None:
    """CastLike(value, like) as Cast(value, to=elem type of like), when that type is known."""
    if len(node.input) < 2 or node.input[0] not in consts:
        return None
    like = node.input[1]
    if like in consts:
        elem = helper.np_dtype_to_tensor_dtype(consts[like].dtype)
    else:
        known = types.get(like)
        if known is None or not known.HasField("tensor_type"):
            return None
        elem = known.tensor_type.elem_type
    if not elem:
        return None
    return helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=elem)


def _too_big(out_bytes: int, in_bytes: int) -> bool:
    return out_bytes > _MAX_GROWTH_BYTES and out_bytes > in_bytes


def _shape_value(node: onnx.NodeProto, shape: list[int]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    # Shape-15 start/end clamp exactly like Python slicing.
    return np.array(shape[attrs.get("start", 0) : attrs.get("end", len(shape))], dtype=np.int64)


def _evaluate(node: onnx.NodeProto, consts: _Constants, opsets: dict[str, int]) -> list[np.ndarray]:
    """Run one node in ONNX Runtime (CPU): folded values are exactly what ORT would compute."""
    feeds = {n: consts[n] for n in dict.fromkeys(n for n in node.input if n)}
    opset = [helper.make_opsetid("", opsets.get("", opsets.get("ai.onnx", 0)))]
    sub = helper.make_model(
        helper.make_graph(
            [node],
            "fold",
            [
                helper.make_tensor_value_info(
                    n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)
                )
                for n, a in feeds.items()
            ],
            [helper.make_empty_tensor_value_info(o) for o in node.output if o],
        ),
        opset_imports=opset,
        ir_version=helper.find_min_ir_version_for(opset),
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        sub.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return [np.asarray(r) for r in session.run(None, feeds)]


def _remove_dead(graph: onnx.GraphProto) -> bool:
    """Drop nodes and initializers nothing reads; True when anything was removed."""
    needed = {o.name for o in graph.output} | _subgraph_names(graph)
    kept_rev: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output if o):
            kept_rev.append(node)
            needed.update(n for n in node.input if n)
    kept = list(reversed(kept_rev))
    inits = [i for i in graph.initializer if i.name in needed]
    changed = len(kept) != len(graph.node) or len(inits) != len(graph.initializer)
    if changed:
        del graph.node[:]
        graph.node.extend(kept)
        del graph.initializer[:]
        graph.initializer.extend(inits)
    return changed


def _fuse_matmul_add(graph: onnx.GraphProto, types: dict[str, onnx.TypeProto]) -> None:
    """MatMul(A[M,K], W[K,N]) + Add(bias[N]) -> Gemm(A, W, bias), named like the MatMul.

    Only where A has rank 2: that is the form ONNX Runtime fuses into QGemm. The 3-D MatMuls of a
    transformer stay MatMul (ORT fuses those into QAttention/MatMulInteger instead).
    """
    inits = {i.name: i for i in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    consumers: Counter[str] = Counter(n for node in graph.node for n in node.input)
    consumers.update(_subgraph_names(graph))
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
    """Infer value_info for every node output, starting from the exporter's where it survives.

    The exporter's shapes carry its symbolic dims (`batch`) through Reshapes where ONNX's own
    inference can only say `unk__6`; ORT's transformer fusions (SkipLayerNormalization needs
    both Add inputs to have the same shape) compare those dims, so dropping them loses fusions.
    Entries for tensors that folding or fusion removed are dropped.
    """
    graph = model.graph
    produced = {o for n in graph.node for o in n.output if o}
    keep = [vi for vi in graph.value_info if vi.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(keep)
    model.CopyFrom(_inferred(model))


def _check_types_known(model: onnx.ModelProto) -> None:
    known = tensor_types(model)
    for node in model.graph.node:
        for out in node.output:
            if out and out not in known:
                raise ModelError(
                    f"element type of tensor {out!r} (output of node {node.name!r}, "
                    f"{node.op_type}) cannot be inferred"
                )
