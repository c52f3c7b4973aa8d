"""Layer by layer: every quantized node's input and output SQNR in the fully quantized model.

The float model and the QDQ model each run once, unfused (ORT_DISABLE_ALL: the QDQ semantics,
every tensor computed as written), with each quantized node's data input and output exposed as
graph outputs. Exposing a tensor in a fused session would stop the very fusion that computes it,
so the numbers would describe another model. The writer keeps node and tensor names, so the
node's output has the same name in both graphs; its input is read as the QDQ node reads it (the
dequantized copy), so `sqnr_in` includes the input's own quantization. Read in graph order, the
output SQNRs say where the error enters and how it accumulates; `sqnr_in - sqnr_out` is what the
node itself (its weights, and the amplification of the error it was given) costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import onnx
from onnx import helper

from qtool.data.batches import Batch
from qtool.metrics.signal import SignalQuality
from qtool.model.prepare import tensor_types
from qtool.ort.sessions import as_declared, create_session
from qtool.plan.plan import Plan


@dataclass(frozen=True)
class LayerScore:
    node: str
    op_type: str
    precision: str
    output: str
    sqnr_out_db: float
    input: str | None = None  # the float graph's name of the data input compared
    sqnr_in_db: float | None = None

    @property
    def lost_db(self) -> float | None:
        if self.sqnr_in_db is None or math.isinf(self.sqnr_out_db):
            return None
        if math.isinf(self.sqnr_in_db):
            return math.inf
        return self.sqnr_in_db - self.sqnr_out_db


def _with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> bytes:
    """`model` with `names` added as float graph outputs of unknown shape."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    present = {o.name for o in exposed.graph.output}
    for name in dict.fromkeys(names):
        if name not in present:
            exposed.graph.output.append(
                helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
            )
    return exposed.SerializeToString()


def layer_sqnr(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    plan: Plan,
    batches: Sequence[Batch],
    threads: int | None = None,
) -> list[LayerScore]:
    """Input and output SQNR of every quantized node of `plan`, in graph order."""
    float_nodes = {node.name: node for node in float_model.graph.node}
    quant_nodes = {node.name: node for node in quant_model.graph.node}
    graph_inputs = {i.name for i in float_model.graph.input}
    initializers = {i.name for i in float_model.graph.initializer}
    types = tensor_types(float_model)
    produced = {out for node in quant_model.graph.node for out in node.output}
    produced |= {i.name for i in quant_model.graph.input}

    pairs: dict[str, tuple[str, str]] = {}  # key -> (float tensor, quantized tensor)
    rows: list[tuple] = []
    for node_plan in plan.quantized():
        node = float_nodes[node_plan.name]
        out = node.output[0]
        if out not in produced:
            continue  # the writer replaced it (never for a quantized node's own output)
        pairs[f"out:{out}"] = (out, out)
        input_key = None
        quant_node = quant_nodes.get(node.name)
        for index, name in enumerate(node.input):
            is_float = types.get(name, (None,))[0] == onnx.TensorProto.FLOAT
            if not name or name in initializers or not is_float:
                continue
            if node_plan.activations == "dynamic":
                # its input is quantized inside the node at run time (DynamicQuantizeLinear ->
                # integers): the float tensor it reads is the one to compare, and the
                # quantization error shows in its output
                input_key = f"in:{node.name}"
                pairs[input_key] = (name, name)
            elif quant_node is not None and index < len(quant_node.input):
                input_key = f"in:{node.name}"
                pairs[input_key] = (name, quant_node.input[index])
            break
        rows.append((node_plan, out, input_key))

    float_names = sorted({f for f, _ in pairs.values() if f not in graph_inputs})
    quant_names = sorted({q for _, q in pairs.values() if q not in graph_inputs})
    float_session = create_session(
        _with_outputs(float_model, float_names), threads=threads, optimize=False
    )
    quant_session = create_session(
        _with_outputs(quant_model, quant_names), threads=threads, optimize=False
    )
    energy = {key: SignalQuality() for key in pairs}
    for batch in batches:
        ref = dict(zip(float_names, float_session.run(float_names, batch.inputs), strict=True))
        feed = as_declared(batch.inputs, quant_session)
        got = dict(zip(quant_names, quant_session.run(quant_names, feed), strict=True))
        ref.update({k: v for k, v in batch.inputs.items()})
        got.update({k: v for k, v in batch.inputs.items()})
        for key, (float_name, quant_name) in pairs.items():
            energy[key].update(ref[float_name], got[quant_name])

    scores = []
    for node_plan, out, input_key in rows:
        scores.append(
            LayerScore(
                node_plan.name,
                node_plan.op_type,
                node_plan.precision,
                out,
                energy[f"out:{out}"].sqnr_db(),
                None if input_key is None else pairs[input_key][0],
                None if input_key is None else energy[input_key].sqnr_db(),
            )
        )
    return scores
