"""Per-token dynamic INT8 against its arithmetic, computed here in numpy.

One MatMul whose input rows differ in scale by 1000x (an LLM's outlier token next to ordinary
ones): qtool's per-token model, run by ONNX Runtime, must equal the numpy reference of "each row
quantized to uint8 with its own range, times the int8 weight" to float rounding, and must be far
more accurate than the per-tensor form on the ordinary rows, which a per-tensor range gives a
step 1000x too coarse.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.search.costs import attribute, record_bytes

K, N, ROWS = 64, 48, 6


def _model(path: Path, weight: np.ndarray, opset: int = 17) -> None:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, ROWS, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, ROWS, N])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)


def _inputs(count: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(count, 1, ROWS, K)).astype(np.float32)
    x[:, :, 0] *= 1000.0  # the outlier token
    return x


def _quantize(tmp_path: Path, ranges: str, cli, **quantization) -> Path:
    out = tmp_path / f"out-{ranges}"
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, ROWS, K]},
        "calibration": {"data": {"npz": "cal.npz"}, "batch_size": 1},
        "quantization": {
            "op_types": ["MatMul"],
            "activations": "dynamic",
            "dynamic_ranges": ranges,
            **quantization,
        },
        "output": {"dir": str(out)},
    }
    path = tmp_path / f"{ranges}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = cli("quantize", path, "--no-progress")
    assert result.exit_code == 0, result.output
    return out / "model.int8.onnx"


def _reference(x: np.ndarray, model: onnx.ModelProto) -> np.ndarray:
    """Per row: DynamicQuantizeLinear's uint8 arithmetic on that row alone, then the integer
    product with the stored weight, its zero points, and the two scales."""
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    wq = init["w_quantized"].astype(np.int64) - init["w_zero_point"].astype(np.int64)
    w_scale = init["w_scale"]
    low = np.minimum(x.min(axis=-1, keepdims=True), np.float32(0))
    high = np.maximum(x.max(axis=-1, keepdims=True), np.float32(0))
    scale = np.maximum((high - low) / np.float32(255), np.finfo(np.float32).tiny)
    zero = np.clip(np.rint(-low / scale), 0, 255)
    xq = np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.int64) - zero.astype(np.int64)
    return ((xq @ wq).astype(np.float32) * w_scale) * scale


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMin's axes: an attribute, then an input
def test_per_token_model_is_its_arithmetic_and_beats_per_tensor(tmp_path, cli, opset):
    weight = np.random.default_rng(1).normal(size=(K, N)).astype(np.float32)
    _model(tmp_path / "model.onnx", weight, opset)
    np.savez(tmp_path / "cal.npz", x=_inputs(2, seed=2)[:, 0])
    per_token = _quantize(tmp_path, "per-token", cli)
    per_tensor = _quantize(tmp_path, "per-tensor", cli)
    model = onnx.load(str(per_token))
    reduce = next(n for n in model.graph.node if n.op_type == "ReduceMin")
    assert (len(reduce.input) == 2) == (opset >= 18)
    x = _inputs(4, seed=3)
    token_run = ort.InferenceSession(str(per_token), providers=["CPUExecutionProvider"])
    tensor_run = ort.InferenceSession(str(per_tensor), providers=["CPUExecutionProvider"])
    errors = {"token": [], "tensor": []}
    for sample in x:
        got = token_run.run(None, {"x": sample})[0]
        np.testing.assert_allclose(got, _reference(sample, model), rtol=1e-6, atol=1e-6)
        exact = sample @ weight
        ordinary = slice(1, None)  # the rows next to the outlier token
        for name, y in (("token", got), ("tensor", tensor_run.run(None, {"x": sample})[0])):
            noise = np.sum((y[:, ordinary] - exact[:, ordinary]) ** 2)
            errors[name].append(10 * np.log10(np.sum(exact[:, ordinary] ** 2) / noise))
    # per token the ordinary rows keep int8's ~40 dB; one range for all leaves them ~0 dB
    assert min(errors["token"]) > 30.0, errors
    assert max(errors["tensor"]) < 10.0, errors


def test_per_token_with_uint8_weights_takes_their_zero_points_off(tmp_path, cli):
    """On a CPU without VNNI, `saturation: uint8-weights` stores the weight as uint8 with zero
    points (docs/runtime.md): the column sums are of (w - w_z), so the result is still the
    arithmetic of the int8 reference."""
    weight = np.random.default_rng(4).normal(size=(K, N)).astype(np.float32)
    _model(tmp_path / "model.onnx", weight)
    np.savez(tmp_path / "cal.npz", x=_inputs(2, seed=2)[:, 0])
    written = _quantize(tmp_path, "per-token", cli, cpu="avx2", saturation="uint8-weights")
    model = onnx.load(str(written))
    stored = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert stored["w_quantized"].dtype == np.uint8 and np.any(stored["w_zero_point"] != 0)
    session = ort.InferenceSession(str(written), providers=["CPUExecutionProvider"])
    sample = _inputs(1, seed=5)[0]
    got = session.run(None, {"x": sample})[0]
    np.testing.assert_allclose(got, _reference(sample, model), rtol=1e-6, atol=1e-6)
    exact = sample @ weight
    noise = np.sum((got[:, 1:] - exact[:, 1:]) ** 2)
    assert 10 * np.log10(np.sum(exact[:, 1:] ** 2) / noise) > 30.0


def test_size_model_gives_the_row_quantization_to_its_node(tmp_path, cli):
    """--auto prices a plan by the bytes of the file: every node and constant the per-token form
    inserts belongs to the MatMul it serves, none is left unplaced (that raised before)."""
    weight = np.random.default_rng(1).normal(size=(K, N)).astype(np.float32)
    _model(tmp_path / "model.onnx", weight)
    np.savez(tmp_path / "cal.npz", x=_inputs(2, seed=2)[:, 0])
    written = _quantize(tmp_path, "per-token", cli)
    model = onnx.load(str(written))
    prepared = onnx.load(str(written.parent / "model.fp32.onnx"))
    size = written.stat().st_size
    parts = attribute(model, size, prepared, {"proj"}, {}, {})
    assert parts.total() == pytest.approx(size)
    io = sum(record_bytes(v) for v in [*model.graph.input, *model.graph.output])
    assert parts.rest == io  # everything else is the node's
    inserted = [n for n in model.graph.node if n.name != "proj"]
    assert len(inserted) > 20
    owned = sum(record_bytes(n) for n in model.graph.node)
    owned += sum(record_bytes(i) for i in model.graph.initializer)
    owned += sum(record_bytes(v) for v in model.graph.value_info)
    assert parts.nodes["proj"] == pytest.approx(owned)
