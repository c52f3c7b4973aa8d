"""Write the QDQ model: the float graph with QuantizeLinear/DequantizeLinear pairs inserted.

Weights and biases are stored already quantized (int8/int32 initializers followed by a
DequantizeLinear) instead of float weights behind a Q/DQ pair: the file is ~4x smaller and ORT and
TensorRT constant-fold nothing at load time. Node and tensor names derive from the original tensor
names, so the output is deterministic and readable in Netron.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.errors import ModelError
from qtool.model import external_data
from qtool.plan.layout import Layout
from qtool.write.dynamic import (
    column_sums,
    dynamic_matmul_nodes,
    dynamic_quantize_node,
    token_constants,
    token_matmul_nodes,
    token_quantize_nodes,
)
from qtool.write.int4 import (
    MS_DOMAIN,
    BlockwiseWeight,
    dequantize_node,
    gather_block_quantized_node,
    to_initializers,
)
from qtool.write.matmul_nbits import matmul_nbits_node, nbits_blocker, nbits_initializers
from qtool.write.params import ActivationParams, WeightParams
from qtool.write.tied import tied_tables


@dataclass(frozen=True)
class BiasParams:
    values: np.ndarray  # int32
    scale: np.ndarray  # float32, [C] or scalar


def _dequantize_node(name: str, inputs: list[str], output: str, axis: int | None) -> onnx.NodeProto:
    attrs = {"axis": axis} if axis is not None else {}
    return helper.make_node("DequantizeLinear", inputs, [output], name=name, **attrs)


def _fused_gather_tables(layout: Layout, target: str) -> set[str]:
    """Tables whose Gathers become com.microsoft GatherBlockQuantized (ORT fuses nothing else)."""
    if target != "ort-cpu":
        return set()
    return {
        name
        for name, slot in layout.weights.items()
        if slot.reduction == "gather" and slot.block_size is not None
    }


def _needs_opset21(low_bit: dict[str, BlockwiseWeight]) -> str | None:
    for name, bw in sorted(low_bit.items()):
        if bw.bits == 4 or bw.block_size is not None:
            return name
    return None


def write_qdq_model(
    model: onnx.ModelProto,
    layout: Layout,
    activations: dict[str, ActivationParams],
    weights: dict[str, WeightParams | BlockwiseWeight],
    biases: dict[str, BiasParams],
    target: str = "ort-cpu",
    nbits_level: int | None = None,
    check: bool = True,
) -> onnx.ModelProto:
    """Return a new model; `model` is the prepared float model the layout was planned on.
    `check=False`: the caller runs onnx.checker itself (on the bytes it writes, see pipeline).

    `nbits_level` set: 4-bit MatMul/Gemm weights that ORT would fuse are written as MatMulNBits
    with that accuracy level (qtool/quantize/matmul_nbits.py); None keeps every weight in QDQ.
    """
    graph = model.graph
    replaced = set(weights) | set(biases)
    new_initializers = [init for init in graph.initializer if init.name not in replaced]
    head_nodes: list[onnx.NodeProto] = []  # weight/bias DequantizeLinear, placed first
    rename: dict[str, str] = {}  # tensor -> dequantized tensor read by consumers

    low_bit = {n: w for n, w in weights.items() if isinstance(w, BlockwiseWeight)}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    needs_21 = _needs_opset21(low_bit)
    if needs_21 is not None and opset < 21:
        raise ModelError(
            f"weight '{needs_21}' is 4-bit or blocked, which needs opset 21, but the prepared "
            f"model is opset {opset} (preparation should have upgraded it)"
        )
    # A table read by Gathers and, transposed, by MatMuls (a tied lm_head): one set of uint8
    # initializers for GatherBlockQuantized and MatMulNBits alike (write/tied.py).
    tables, tied_matmuls, tied_transposes = (
        tied_tables(graph, low_bit) if nbits_level is not None else ({}, {}, set())
    )
    fused_tables = (_fused_gather_tables(layout, target) & set(low_bit)) - set(tables)
    gather_readers = {
        name
        for name in fused_tables
        if any(n.op_type != "Gather" and name in n.input for n in graph.node)
    }
    transposed = {name for name, slot in layout.weights.items() if slot.transposed}
    nbits = {} if nbits_level is None else nbits_readers(graph, low_bit, transposed)
    nbits = {name: node for name, node in nbits.items() if name not in tables}
    dims = {i.name: list(i.dims) for i in graph.initializer} if nbits else {}  # Gemm biases
    for _, table in sorted(tables.items()):
        new_initializers.extend(table.initializers())
        head_nodes.extend(table.head_nodes())
    for name, bw in sorted(low_bit.items()):
        if name in tables:
            continue
        if name in nbits:
            new_initializers.extend(nbits_initializers(name, bw))
            continue
        new_initializers.extend(to_initializers(name, bw))
        if name not in fused_tables or name in gather_readers:
            rename[name] = f"{name}_dequantized"
            head_nodes.append(dequantize_node(name, bw, rename[name]))

    dynamic_nodes = _dynamic_nodes(layout)
    dynamic_only = _read_only_by(graph, dynamic_nodes, set(weights))
    constants = [
        (name, w.values, w.scale, w.zero_point_array(), w.axis)
        for name, w in sorted(weights.items())
        if isinstance(w, WeightParams)
    ]
    for name in sorted(biases):
        scale, values = biases[name].scale, biases[name].values
        zero_point = np.zeros(scale.shape, dtype=values.dtype)
        constants.append((name, values, scale, zero_point, 0 if scale.ndim == 1 else None))
    for name, values, scale_values, zero_values, axis in constants:
        quant, scale, zero = f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"
        new_initializers.append(numpy_helper.from_array(values, quant))
        new_initializers.append(numpy_helper.from_array(scale_values.astype(np.float32), scale))
        new_initializers.append(numpy_helper.from_array(zero_values, zero))
        if name in dynamic_only:  # MatMulInteger reads the integers and the scale directly
            continue
        rename[name] = f"{name}_dequantized"
        head_nodes.append(
            _dequantize_node(f"{name}_DequantizeLinear", [quant, scale, zero], rename[name], axis)
        )

    pairs_after: dict[str, list[onnx.NodeProto]] = {}  # source tensor -> its Q/DQ nodes
    graph_inputs = {i.name for i in graph.input}
    pairs: dict[tuple[str, str], str] = {}  # (tensor, pair type) -> its dequantized tensor
    for key in sorted(activations):
        slot = layout.activations[key]
        params = activations[key]
        scale, zero = f"{key}_scale", f"{key}_zero_point"
        quantized, dequantized = f"{key}_quantized", f"{key}_dequantized"
        new_initializers.append(
            numpy_helper.from_array(np.asarray(params.scale, np.float32), scale)
        )
        new_initializers.append(numpy_helper.from_array(np.asarray(params.zero_point), zero))
        nodes = [
            helper.make_node(
                "QuantizeLinear",
                [slot.source, scale, zero],
                [quantized],
                name=f"{key}_QuantizeLinear",
            ),
            _dequantize_node(
                f"{key}_DequantizeLinear", [quantized, scale, zero], dequantized, None
            ),
        ]
        pairs_after.setdefault(slot.source, []).extend(nodes)
        pairs[(slot.tensor, slot.dtype)] = dequantized
    per_token = layout.dynamic_ranges == "per-token" and bool(layout.dynamic)
    for tensor in sorted(layout.dynamic):  # quantized at run time: no scale to store
        if per_token:
            quantize = token_quantize_nodes(tensor, opset)
        else:
            quantize = [dynamic_quantize_node(tensor)]
        pairs_after.setdefault(tensor, []).extend(quantize)
    if per_token:
        new_initializers.extend(token_constants(opset))
        for weight in sorted(set(dynamic_nodes.values())):
            params = weights[weight]
            new_initializers.append(column_sums(weight, params.values, params.zero_point_array()))

    folded = set(layout.folded_clamps)
    body: list[onnx.NodeProto] = []
    for source in sorted(s for s in pairs_after if s in graph_inputs):
        body.extend(pairs_after[source])
    for node in graph.node:
        if node.name in folded or node.name in tied_transposes:
            continue
        if node.op_type == "Gather" and node.input[0] in tables:
            body.extend(tables[node.input[0]].gather(node))
            body.extend(pairs_after.get(node.output[0], []))
            continue
        if node.name in tied_matmuls:
            matmul = onnx.NodeProto()
            matmul.CopyFrom(node)
            if matmul.input[0] in rename:
                matmul.input[0] = rename[matmul.input[0]]
            body.append(tables[tied_matmuls[node.name]].matmul(matmul, nbits_level))
            for out in node.output:
                body.extend(pairs_after.get(out, []))
            continue
        if node.op_type == "Gather" and node.input[0] in fused_tables:
            table = node.input[0]
            fused = gather_block_quantized_node(
                table, low_bit[table], node.input[1], node.output[0]
            )
            fused.name = node.name  # the Plan's name, so the runtime truth finds it
            body.append(fused)
        elif node.name in dynamic_nodes:  # the registry's int8/dynamic forms
            written = token_matmul_nodes if per_token else dynamic_matmul_nodes
            body.extend(written(node, dynamic_nodes[node.name]))
        else:
            reads = {**rename, **_pair_reads(node, layout, pairs)}
            body.extend(_rewritten(node, reads, transposed, nbits, low_bit, dims, nbits_level))
        # after every written form, the fused Gather's too: an int8 consumer of the gathered
        # rows reads them through this pair
        for out in node.output:
            body.extend(pairs_after.get(out, []))

    # The prepared model's shapes travel along: ORT's transformer fusions (SkipLayerNormalization)
    # compare symbolic dims that its own inference cannot recover on the QDQ graph.
    produced = {out for node in body for out in node.output}
    value_info = [vi for vi in graph.value_info if vi.name in produced]
    new_graph = helper.make_graph(
        head_nodes + body,
        graph.name,
        list(graph.input),
        list(graph.output),
        initializer=new_initializers,
        value_info=value_info,
    )
    opset_imports = list(model.opset_import)
    if (fused_tables or nbits or tables) and all(o.domain != MS_DOMAIN for o in opset_imports):
        opset_imports.append(helper.make_opsetid(MS_DOMAIN, 1))
    quantized_model = helper.make_model(
        new_graph,
        opset_imports=opset_imports,
        producer_name="qtool",
        producer_version=_version(),
    )
    quantized_model.ir_version = model.ir_version
    if check:
        external_data.check_model(quantized_model)  # over 2 GB: checked without serializing it
    return quantized_model


def _dynamic_nodes(layout: Layout) -> dict[str, str]:
    """Planned node -> its weight, for the nodes whose input is quantized at run time."""
    return {
        node.name: node.weight.tensor
        for node in layout.plan
        if node.quantized and node.activations == "dynamic" and node.weight is not None
    }


def _read_only_by(graph: onnx.GraphProto, readers: dict[str, str], weights: set[str]) -> set[str]:
    """The weights no node other than `readers` (as their weight) reads: they need no
    DequantizeLinear. A weight also read by a static or float node keeps it for that node."""
    wanted = {weight for weight in readers.values() if weight in weights}
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in wanted and not (node.name in readers and index == 1):
                wanted.discard(name)
    return wanted


def _pair_reads(
    node: onnx.NodeProto, layout: Layout, pairs: dict[tuple[str, str], str]
) -> dict[str, str]:
    """Input -> the dequantized tensor `node` reads: the pair of its own type (int8 or fp8) where
    its input has one, else the int8 pair, else the fp8 one (a float reader of a quantized
    tensor reads it dequantized, as in every QDQ model)."""
    planned = layout.plan.nodes.get(node.name)
    own = planned.activations if planned is not None and planned.quantized else None
    reads = {}
    for name in node.input:
        choice = pairs.get((name, own)) if own is not None else None
        choice = choice or pairs.get((name, "int8")) or pairs.get((name, "fp8"))
        if choice is not None:
            reads[name] = choice
    return reads


def _rewritten(
    node: onnx.NodeProto,
    rename: dict[str, str],
    transposed: set[str],
    nbits: dict[str, str],
    low_bit: dict[str, BlockwiseWeight],
    dims: dict[str, list[int]],
    nbits_level: int | None,
) -> list[onnx.NodeProto]:
    """`node` reading the dequantized tensors, as written: itself, MatMulNBits (plus a bias Add
    where needed) for a 4-bit weight ORT fuses, or a blocked Gemm split from its bias."""
    rewritten = onnx.NodeProto()
    rewritten.CopyFrom(node)
    for index, name in enumerate(rewritten.input):
        if name in rename:
            rewritten.input[index] = rename[name]
    if node.op_type == "Gemm" and len(node.input) > 1 and node.input[1] in transposed:
        _set_int_attribute(rewritten, "transB", 0)
    if nbits.get(node.input[1] if len(node.input) > 1 else None) == node.name:
        weight = node.input[1]
        return _nbits_nodes(rewritten, weight, low_bit[weight], dims, nbits_level)
    if node.op_type == "Gemm" and _blocked_weight(node, low_bit):
        return _split_gemm_bias(rewritten)
    return [rewritten]


def nbits_readers(
    graph: onnx.GraphProto, low_bit: dict[str, BlockwiseWeight], transposed: set[str]
) -> dict[str, str]:
    """4-bit weight -> the one MatMul/Gemm node that reads it as B and can run as MatMulNBits.

    A weight read by anything else as well keeps its DequantizeLinear (one copy of the data).
    """
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in set(node.input):
            if name in low_bit:
                readers.setdefault(name, []).append(node)
    chosen = {}
    for name, nodes in readers.items():
        if len(nodes) != 1 or len(nodes[0].input) < 2 or nodes[0].input[1] != name:
            continue
        if nodes[0].input[0] == name:
            continue
        node = onnx.NodeProto()
        node.CopyFrom(nodes[0])
        if name in transposed:
            _set_int_attribute(node, "transB", 0)
        if nbits_blocker(node, low_bit[name]) is None:
            chosen[name] = node.name
    return chosen


def _nbits_nodes(
    node: onnx.NodeProto,
    weight: str,
    bw: BlockwiseWeight,
    dims: dict[str, list[int]],
    accuracy_level: int,
) -> list[onnx.NodeProto]:
    """MatMulNBits for `node`, plus an Add when a Gemm bias is not the [N] vector it can take."""
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 else ""
    if not bias:
        return [matmul_nbits_node(node, weight, bw, None, accuracy_level)]
    original = node.input[2].removesuffix("_dequantized")
    if dims.get(bias, dims.get(original)) == [bw.values.shape[1]]:
        return [matmul_nbits_node(node, weight, bw, bias, accuracy_level)]
    product, add = _split_gemm_bias(node)  # nbits_blocker admitted only beta == 1
    return [matmul_nbits_node(product, weight, bw, None, accuracy_level), add]


def _blocked_weight(node: onnx.NodeProto, low_bit: dict[str, BlockwiseWeight]) -> bool:
    weight = low_bit.get(node.input[1]) if len(node.input) > 1 else None
    return weight is not None and weight.block_size is not None


def _split_gemm_bias(gemm: onnx.NodeProto) -> list[onnx.NodeProto]:
    """Gemm(x, W, b) -> Gemm(x, W) + Add(b) for a blocked weight.

    ORT's GemmActivationFusion runs before its DequantizeLinear -> MatMulNBits fusion and takes a
    biased Gemm followed by Relu into a float FusedGemm (measured on ORT 1.31); without the bias
    in the Gemm, MatMulNBits forms and absorbs the Add. beta != 1 keeps the Gemm whole.
    """
    beta = next((a.f for a in gemm.attribute if a.name == "beta"), 1.0)
    if len(gemm.input) < 3 or not gemm.input[2] or beta != 1.0:
        return [gemm]
    bias = gemm.input[2]
    output = gemm.output[0]
    del gemm.input[2]
    gemm.output[0] = f"{output}_before_bias"
    add = helper.make_node("Add", [gemm.output[0], bias], [output], name=f"{gemm.name}_bias_Add")
    return [gemm, add]


def _set_int_attribute(node: onnx.NodeProto, name: str, value: int) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(helper.make_attribute(name, value))


def _version() -> str:
    from qtool import __version__

    return __version__
