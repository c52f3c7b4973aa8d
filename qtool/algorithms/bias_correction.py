"""Empirical bias correction (Nagel et al. 2019, "Data-Free Quantization", section 4.2, measured
instead of derived): remove the mean output shift that quantizing each layer introduces.

Rounding weights to a grid, and clipping activations, shifts a layer's output by E[y_fp - y_q]
per output channel; on depthwise and 4-bit layers that shift is large relative to the signal
and accumulates through the network. Measured on calibration data with the quantized model run
as its QDQ semantics (ORT_DISABLE_ALL: what the fused kernels approximate, the same on every
CPU), the shift is folded into the layer's bias, so the quantized model's outputs are centred on
the float model's again. All layers are measured in one pass (each against the float model's
own output of that layer); the pipeline can repeat the pass on the corrected model.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.calibration.collect import session_with_outputs
from qtool.errors import CalibrationError, DataError
from qtool.metrics.signal import SignalQuality
from qtool.model.inline_write import write_model
from qtool.ort.sessions import create_session, ort_reason

# Ops whose bias input (index 2) adds one value per output channel on this axis.
_CHANNEL_AXIS = {"Conv": 1, "ConvTranspose": 1, "Gemm": -1, "MatMul": -1}


@dataclass(frozen=True)
class BiasTarget:
    """A layer whose bias absorbs the shift: its node, output tensor and bias initializer."""

    node: str
    op_type: str
    output: str
    bias: str


@dataclass
class Correction:
    """The shift measured per output channel and the bias that absorbs it."""

    target: BiasTarget
    shift: np.ndarray  # E[y_fp - y_q] per output channel, float64
    before: float  # mean |E[y_fp - y_q]| over channels, before correction
    samples: int

    def corrected_bias(self, bias: np.ndarray) -> np.ndarray:
        return (np.asarray(bias, np.float64) + self.shift).astype(np.float32)


def bias_targets(model: onnx.ModelProto, nodes: Iterable[str]) -> list[BiasTarget]:
    """The named nodes that have a constant per-channel bias: Conv, ConvTranspose and Gemm with
    a bias input, and MatMul whose only reader is an Add of a 1-D constant."""
    wanted = set(nodes)
    initializers = {init.name: init for init in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    targets = []
    for node in model.graph.node:
        if node.name in wanted and node.op_type == "MatMul":
            # A Linear exported as MatMul + Add(bias): the Add's constant absorbs the shift.
            readers = consumers.get(node.output[0], [])
            if len(readers) == 1 and readers[0].op_type == "Add":
                add = readers[0]
                bias = add.input[1] if add.input[0] == node.output[0] else add.input[0]
                if bias in initializers and len(initializers[bias].dims) == 1:
                    targets.append(BiasTarget(node.name, "MatMul", add.output[0], bias))
            continue
        if node.name not in wanted or node.op_type not in _CHANNEL_AXIS:
            continue
        if len(node.input) < 3 or node.input[2] not in initializers:
            continue
        if len(initializers[node.input[2]].dims) != 1:
            continue
        targets.append(BiasTarget(node.name, node.op_type, node.output[0], node.input[2]))
    return targets


def _per_channel_sum(values: np.ndarray, axis: int) -> tuple[np.ndarray, int]:
    moved = np.moveaxis(np.asarray(values, np.float64), axis, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    return flat.sum(axis=0), flat.shape[0]


_LOCAL = "__local"


def local_model(
    float_model: onnx.ModelProto, quantized: onnx.ModelProto, targets: list[BiasTarget]
) -> onnx.ModelProto:
    """The float model plus, for each target, its quantized twin reading the float model's own
    input, with both outputs exposed: the shift measured there is the layer's own, not the sum
    of every layer before it (correcting accumulated shifts would over-correct downstream).

    The twin is the QDQ model's node with the DequantizeLinear (weights, bias) and
    QuantizeLinear -> DequantizeLinear (activation) nodes that feed it, read off the QDQ model.
    """
    out = onnx.ModelProto()
    out.CopyFrom(float_model)
    q_graph = quantized.graph
    producer = {o: n for n in q_graph.node for o in n.output}
    q_inits = {i.name: i for i in q_graph.initializer}
    have = {i.name for i in out.graph.initializer}
    added_inits: set[str] = set()  # initializers taken from the QDQ model
    by_name = {n.name: n for n in q_graph.node}
    added: set[str] = set()
    extra_nodes: list[onnx.NodeProto] = []

    def include(tensor: str) -> None:
        node = producer.get(tensor)
        if node is None or node.op_type not in ("DequantizeLinear", "QuantizeLinear"):
            return
        if node.name in added:
            return
        for name in node.input:
            if name in q_inits and name not in have:
                out.graph.initializer.append(q_inits[name])
                have.add(name)
                added_inits.add(name)
            include(name)
        added.add(node.name)
        extra_nodes.append(node)

    for target in targets:
        node = by_name.get(target.node)
        if node is None:
            raise CalibrationError(f"bias correction: node '{target.node}' not in the QDQ model")
        for name in node.input:
            include(name)
            if name in q_inits and name not in have:  # read directly (MatMulNBits' packed B)
                out.graph.initializer.append(q_inits[name])
                have.add(name)
                added_inits.add(name)
        twin = onnx.NodeProto()
        twin.CopyFrom(node)
        twin.name = node.name + _LOCAL
        chain = [twin]
        if node.output[0] != target.output:  # the writer split the bias into an Add
            tail = producer.get(target.output)
            if tail is None or tail.op_type != "Add" or node.output[0] not in tail.input:
                raise CalibrationError(
                    f"bias correction: cannot follow '{target.node}' to '{target.output}'"
                )
            add = onnx.NodeProto()
            add.CopyFrom(tail)
            add.name = tail.name + _LOCAL
            add.input[list(tail.input).index(node.output[0])] = node.output[0] + _LOCAL
            chain.append(add)
        for part in chain:
            _use_quantized_initializers(part, q_inits, have, added_inits, out.graph)
        del twin.output[:]
        twin.output.append((node.output[0] if len(chain) > 1 else target.output) + _LOCAL)
        del chain[-1].output[:]
        chain[-1].output.append(target.output + _LOCAL)
        extra_nodes.extend(chain)
    out.graph.node.extend(extra_nodes)
    typed = {vi.name: vi for vi in list(out.graph.value_info) + list(out.graph.output)}
    for target in targets:
        if target.output not in typed:
            raise CalibrationError(f"bias correction: tensor '{target.output}' has no type")
        twin_type = onnx.ValueInfoProto()
        twin_type.CopyFrom(typed[target.output])
        twin_type.name = target.output + _LOCAL
        out.graph.value_info.append(twin_type)
    for opset in quantized.opset_import:
        if all(o.domain != opset.domain for o in out.opset_import):
            out.opset_import.append(opset)
    return out


def _use_quantized_initializers(
    node: onnx.NodeProto,
    q_inits: dict[str, onnx.TensorProto],
    have: set[str],
    added: set[str],
    graph: onnx.GraphProto,
) -> None:
    """A float initializer both models hold (the bias of a weight-only layer, corrected in the
    QDQ model only): the twin reads the QDQ model's copy, under its own name."""
    for position, name in enumerate(node.input):
        if name in q_inits and name in have and name not in added:
            copy_name = name + _LOCAL
            if copy_name not in have:
                copy = onnx.TensorProto()
                copy.CopyFrom(q_inits[name])
                copy.name = copy_name
                graph.initializer.append(copy)
                have.add(copy_name)
            node.input[position] = copy_name


def measure_shifts(
    float_model: onnx.ModelProto,
    quantized: onnx.ModelProto,
    targets: list[BiasTarget],
    batches: Iterable[Mapping[str, np.ndarray]],
) -> list[Correction]:
    """Each target's own E[y_fp - y_q] per output channel, from one pass over `batches`."""
    if not targets:
        return []
    model = local_model(float_model, quantized, targets)
    outputs = [t.output for t in targets] + [t.output + _LOCAL for t in targets]
    session = session_with_outputs(model, outputs, optimize=False)
    sums: dict[str, np.ndarray | None] = {t.node: None for t in targets}
    rows = dict.fromkeys(sums, 0)
    for index, feed in enumerate(batches):
        try:
            values = session.run(outputs, dict(feed))
        except Exception as exc:  # ORT raises private types for bad feeds
            raise DataError(f"bias correction: batch {index} failed: {ort_reason(exc)}") from None
        ref, out = values[: len(targets)], values[len(targets) :]
        for target, r, q in zip(targets, ref, out, strict=True):
            axis = _CHANNEL_AXIS[target.op_type]
            diff, count = _per_channel_sum(np.asarray(r) - np.asarray(q), axis)
            total = sums[target.node]
            sums[target.node] = diff if total is None else total + diff
            rows[target.node] += count
    corrections = []
    for target in targets:
        total = sums[target.node]
        if total is None or not rows[target.node]:
            raise CalibrationError("bias correction needs at least one calibration batch")
        shift = total / rows[target.node]
        if not np.all(np.isfinite(shift)):
            raise CalibrationError(f"bias correction: non-finite shift at node '{target.node}'")
        corrections.append(
            Correction(target, shift, float(np.mean(np.abs(shift))), rows[target.node])
        )
    return corrections


def corrected_model(model: onnx.ModelProto, corrections: list[Correction]) -> onnx.ModelProto:
    """A copy of the (prepared float) model whose target biases absorb the shifts; the writer
    then quantizes these biases exactly as it would the originals."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_bias = {c.target.bias: c for c in corrections}
    for index, init in enumerate(out.graph.initializer):
        correction = by_bias.get(init.name)
        if correction is not None:
            bias = correction.corrected_bias(numpy_helper.to_array(init))
            out.graph.initializer[index].CopyFrom(numpy_helper.from_array(bias, init.name))
    return out


def output_error(
    float_model: onnx.ModelProto,
    quantized: onnx.ModelProto,
    batches: Iterable[Mapping[str, np.ndarray]],
) -> float:
    """Mean squared error of the quantized model's outputs (QDQ semantics) against FP32."""
    with tempfile.TemporaryDirectory(prefix="qtool-biascorr-") as tmp:
        paths = []
        for label, model in (("float", float_model), ("quant", quantized)):
            path = Path(tmp) / f"{label}.onnx"
            write_model(model, path)  # over 2 GB: with external data
            paths.append(path)
        reference = create_session(paths[0], spinning=False)
        candidate = create_session(paths[1], optimize=False, spinning=False)
    quality = SignalQuality()
    for feed in batches:
        for r, q in zip(
            reference.run(None, dict(feed)), candidate.run(None, dict(feed)), strict=True
        ):
            quality.update(r, q)
    return quality.mse()


def apply_bias_correction(
    float_model: onnx.ModelProto,
    quantized: onnx.ModelProto,
    nodes: Iterable[str],
    write: Callable[[onnx.ModelProto], onnx.ModelProto],
    batches: Callable[[], Iterable[Mapping[str, np.ndarray]]],
    tuning: Callable[[], Iterable[Mapping[str, np.ndarray]]],
) -> tuple[onnx.ModelProto, dict]:
    """The quantized model with corrected biases, and what changed for report.json.

    `write` turns a float model (the prepared one with corrected biases) into the QDQ model the
    way the pipeline does; `batches()` yields the calibration inputs the shifts are measured on,
    `tuning()` the tuning rows the correction is judged on (rows it did not measure: on the rows
    it measured, removing their own mean shift lowers their error almost by construction). Kept
    only when it lowers the output error there; otherwise the uncorrected model is kept and the
    report says so.
    """
    targets = bias_targets(float_model, nodes)
    corrections = measure_shifts(float_model, quantized, targets, batches())
    corrected = write(corrected_model(float_model, corrections))
    before = output_error(float_model, quantized, tuning())
    after = output_error(float_model, corrected, tuning())
    kept = after < before
    entry = {
        "applied": kept,
        "judged_on": "tuning rows",
        "output_mse_before": before,
        "output_mse_after": after,
        "reason": None
        if kept
        else "the corrected biases did not lower the output error on the tuning rows: not applied",
        "nodes": {
            c.target.node: {
                "bias": c.target.bias,
                "mean_abs_shift_removed": c.before,
                "max_abs_shift_removed": float(np.max(np.abs(c.shift))),
                "rows": c.samples,
            }
            for c in corrections
        },
    }
    return (corrected if kept else quantized), entry
