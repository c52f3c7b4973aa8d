"""INT4 blocked weights: packing against ONNX's reference evaluator, ORT's runtime and its
MatMulNBits fusion (read back from the optimised graph), scale methods, Conv and Gather forms."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from qtool.errors import ModelError
from qtool.write.int4 import (
    BlockwiseWeight,
    dequantize,
    dequantize_node,
    gather_block_quantized_node,
    matmul_nbits_blocker,
    quantize_blockwise,
    quantize_embedding,
    quantize_per_channel,
    to_initializers,
)

ort.set_default_logger_severity(3)


def _weight(k: int, n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((k, n)) * 0.1).astype(np.float32)


def _model(nodes, inits, inputs, outputs, extra_opsets=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), *extra_opsets])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def _matmul_model(bw: BlockwiseWeight, rank: int = 2, gemm_bias: np.ndarray | None = None):
    k, n = bw.values.shape
    nodes = [dequantize_node("w", bw)]
    inits = to_initializers("w", bw)
    if gemm_bias is None:
        nodes.append(helper.make_node("MatMul", ["x", "w_dequantized"], ["y"], name="mm"))
    else:
        inits.append(numpy_helper.from_array(gemm_bias, "bias"))
        nodes.append(helper.make_node("Gemm", ["x", "w_dequantized", "bias"], ["y"], name="mm"))
    lead = ["M"] if rank == 2 else ["B", "M"]
    return _model(
        nodes,
        inits,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, n])],
    )


def _session(
    model: onnx.ModelProto, level, path=None, accuracy_level: int | None = None
) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    if path is not None:
        options.optimized_model_filepath = str(path)
    if accuracy_level is not None:
        # What the DQ -> MatMulNBits fusion writes into MatMulNBits: ORT's default, 4, also
        # quantizes the activations to int8 blocks; 0 keeps them float.
        options.add_session_config_entry(
            "session.qdq_matmulnbits_accuracy_level", str(accuracy_level)
        )
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


CASES = [(64, 32, 32, True), (64, 32, 16, False), (70, 24, 32, True), (70, 24, 16, False)]


@pytest.mark.parametrize(("k", "n", "block", "symmetric"), CASES)
def test_packed_initializers_match_onnx_reference(k, n, block, symmetric):
    bw = quantize_blockwise(_weight(k, n), block_size=block, symmetric=symmetric)
    tensors = to_initializers("w", bw)
    quant = tensors[0]
    assert quant.data_type == (TensorProto.INT4 if symmetric else TensorProto.UINT4)
    assert len(quant.raw_data) == (k * n + 1) // 2  # two per byte
    # ONNX's packing: the first element in the low nibble, the second in the high one.
    first, second = (int(v) & 0xF for v in bw.values.reshape(-1)[:2])
    assert quant.raw_data[0] == first | (second << 4)
    assert bw.scale.shape == (-(-k // block), n)
    model = _model(
        [dequantize_node("w", bw, "out")],
        tensors,
        [],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [k, n])],
    )
    (reference,) = ReferenceEvaluator(model).run(None, {})
    np.testing.assert_array_equal(reference, dequantize(bw))
    (ort_out,) = _session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {})
    np.testing.assert_array_equal(ort_out, dequantize(bw))


@pytest.mark.parametrize(("k", "n", "block", "symmetric"), CASES)
def test_ort_fuses_dq_matmul_into_matmulnbits(tmp_path, k, n, block, symmetric):
    weight = _weight(k, n)
    bw = quantize_blockwise(weight, block_size=block, symmetric=symmetric)
    assert matmul_nbits_blocker(bw) is None
    model = _matmul_model(bw, rank=3)
    x = np.random.default_rng(1).standard_normal((2, 5, k)).astype(np.float32)
    expected = x @ dequantize(bw)
    level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    for accuracy_level in (None, 0):
        path = tmp_path / f"optimized_{accuracy_level}.onnx"
        fused = _session(model, level, path, accuracy_level)
        ops = collections.Counter(node.op_type for node in onnx.load(str(path)).graph.node)
        assert ops == {"MatMulNBits": 1}, ops
        nbits = next(node for node in onnx.load(str(path)).graph.node)
        attrs = {a.name: helper.get_attribute_value(a) for a in nbits.attribute}
        assert (attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]) == (k, n, 4, block)
        got = fused.run(None, {"x": x})[0]
        if attrs["accuracy_level"] == 0:
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        else:  # int8 activations: close, not exact
            rms = np.sqrt(np.mean(expected**2))
            assert np.sqrt(np.mean((got - expected) ** 2)) < 0.05 * rms
    unfused = _session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    np.testing.assert_allclose(unfused.run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
def test_gemm_with_bias_in_matmul_form_fuses(tmp_path, symmetric):
    """A Gemm(transB=1) weight [N, K] written transposed as [K, N] with transB=0 fuses."""
    k, n = 64, 16
    gemm_weight = _weight(n, k)  # transB=1 layout
    bias = np.linspace(-1, 1, n).astype(np.float32)
    bw = quantize_blockwise(gemm_weight.T, block_size=32, symmetric=symmetric)
    path = tmp_path / "optimized.onnx"
    session = _session(
        _matmul_model(bw, gemm_bias=bias), ort.GraphOptimizationLevel.ORT_ENABLE_ALL, path, 0
    )
    ops = collections.Counter(node.op_type for node in onnx.load(str(path)).graph.node)
    assert ops == {"MatMulNBits": 1}, ops
    x = np.random.default_rng(2).standard_normal((3, k)).astype(np.float32)
    np.testing.assert_allclose(
        session.run(None, {"x": x})[0], x @ dequantize(bw) + bias, rtol=1e-4, atol=1e-5
    )


def test_block_size_ort_does_not_fuse_is_reported(tmp_path):
    bw = quantize_blockwise(_weight(48, 8), block_size=24)
    assert "power of two" in matmul_nbits_blocker(bw)
    path = tmp_path / "optimized.onnx"
    _session(_matmul_model(bw), ort.GraphOptimizationLevel.ORT_ENABLE_ALL, path)
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert "MatMulNBits" not in ops and "DequantizeLinear" in ops
    assert "per channel" in matmul_nbits_blocker(quantize_per_channel(_weight(48, 8), axis=1))


@pytest.mark.parametrize("symmetric", [True, False])
def test_minmax_covers_every_block_without_clipping(symmetric):
    weight = _weight(70, 12, seed=3)
    bw = quantize_blockwise(weight, block_size=16, symmetric=symmetric)
    low, high = (-8, 7) if symmetric else (0, 15)
    assert bw.values.dtype == (np.int8 if symmetric else np.uint8)
    assert bw.values.min() >= low and bw.values.max() <= high
    step = np.repeat(bw.scale, 16, axis=0)[:70]
    assert np.all(np.abs(dequantize(bw) - weight) <= step / 2 + 1e-7)
    if symmetric:
        assert bw.zero_point is None
    else:
        assert bw.zero_point.shape == bw.scale.shape and bw.zero_point.max() <= 15


def test_zero_block_quantizes_to_exact_zeros():
    weight = _weight(64, 4)
    weight[:32, 1] = 0.0
    for symmetric in (True, False):
        bw = quantize_blockwise(weight, block_size=32, symmetric=symmetric)
        assert np.all(dequantize(bw)[:32, 1] == 0.0)
        assert np.all(bw.scale > 0)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block", [32, 128])
def test_mse_scales_beat_minmax_on_gaussian_with_outliers(symmetric, block):
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((256, 64)).astype(np.float32)
    outliers = rng.random(weight.shape) < 0.01
    weight[outliers] *= 3.0
    minmax = quantize_blockwise(weight, block_size=block, symmetric=symmetric, method="minmax")
    mse = quantize_blockwise(weight, block_size=block, symmetric=symmetric, method="mse")

    def block_errors(bw):
        return (((dequantize(bw) - weight) ** 2).reshape(256 // block, block, 64)).sum(axis=1)

    # never worse on any block (minmax is a candidate), clearly better in total
    assert np.all(block_errors(mse) <= block_errors(minmax))
    total_mse, total_minmax = block_errors(mse).sum(), block_errors(minmax).sum()
    assert total_mse < 0.96 * total_minmax, (total_mse, total_minmax)


def test_quantization_is_deterministic():
    weight = _weight(96, 40, seed=5)
    a = to_initializers("w", quantize_blockwise(weight, symmetric=False, method="mse"))
    b = to_initializers("w", quantize_blockwise(weight.copy(), symmetric=False, method="mse"))
    assert [t.SerializeToString() for t in a] == [t.SerializeToString() for t in b]


def test_bad_weights_and_arguments_are_rejected():
    weight = _weight(32, 4)
    weight[3, 2] = np.nan
    with pytest.raises(ModelError, match="'fc1.weight'"):
        quantize_blockwise(weight, name="fc1.weight")
    with pytest.raises(ValueError, match="scale method"):
        quantize_blockwise(_weight(32, 4), method="percentile")
    with pytest.raises(ValueError, match="bits"):
        quantize_blockwise(_weight(32, 4), bits=3)


@pytest.mark.parametrize("symmetric", [True, False])
def test_per_channel_int4_conv_runs_in_ort(symmetric):
    rng = np.random.default_rng(6)
    weight = (rng.standard_normal((6, 3, 3, 3)) * 0.2).astype(np.float32)
    bw = quantize_per_channel(weight, symmetric=symmetric, axis=0)
    assert bw.scale.shape == (6,) and bw.block_size is None
    # every output channel's own range reaches an end of the grid: the scales are per channel
    extreme = np.abs(bw.values.reshape(6, -1).astype(int)).max(axis=1)
    assert np.all(extreme >= (7 if symmetric else 15))
    conv_in = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
    conv_out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 6, 6])]
    quantized = _model(
        [dequantize_node("w", bw), helper.make_node("Conv", ["x", "w_dequantized"], ["y"])],
        to_initializers("w", bw),
        conv_in,
        conv_out,
    )
    reference = _model(
        [helper.make_node("Conv", ["x", "w"], ["y"])],
        [numpy_helper.from_array(dequantize(bw), "w")],
        conv_in,
        conv_out,
    )
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    got = _session(quantized, level).run(None, {"x": x})[0]
    want = _session(reference, level).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _gather_model(nodes, inits, d):
    return _model(
        nodes,
        inits,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", d])],
        extra_opsets=[helper.make_opsetid("com.microsoft", 1)],
    )


@pytest.mark.parametrize(
    ("bits", "block", "symmetric"),
    [(4, 32, True), (4, 16, False), (8, 32, False), (4, None, True), (8, None, True)],
)
def test_embedding_tables_gather_in_ort(bits, block, symmetric):
    v, d = 50, 48
    table = _weight(v, d, seed=7)
    bw = quantize_embedding(table, bits=bits, block_size=block, symmetric=symmetric)
    ids = np.array([[0, 7, 49], [3, 3, 12]], dtype=np.int64)
    expected = dequantize(bw)[ids]
    level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    dq_form = _gather_model(
        [dequantize_node("emb", bw), helper.make_node("Gather", ["emb_dequantized", "ids"], ["y"])],
        to_initializers("emb", bw),
        d,
    )
    np.testing.assert_array_equal(_session(dq_form, level).run(None, {"ids": ids})[0], expected)
    if block is not None:
        fused = _gather_model(
            [gather_block_quantized_node("emb", bw, "ids", "y")], to_initializers("emb", bw), d
        )
        got = _session(fused, level).run(None, {"ids": ids})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_gather_block_quantized_rejects_forms_ort_lacks():
    table = _weight(8, 32)
    with pytest.raises(ValueError, match="int8"):
        gather_block_quantized_node(
            "e", quantize_embedding(table, bits=8, symmetric=True), "ids", "y"
        )
    with pytest.raises(ValueError, match="last axis"):
        gather_block_quantized_node("e", quantize_embedding(table, block_size=None), "ids", "y")


def test_signed_scales_use_all_sixteen_levels_and_never_reconstruct_worse():
    from qtool.write.int4 import dequantize, quantize_blockwise

    rng = np.random.default_rng(3)
    weight = rng.standard_normal((64, 24)).astype(np.float32)
    weight[5, :12] = 4.0  # positive outliers: a positive-only scale wastes the -8 level
    plain = quantize_blockwise(weight, block_size=16, bits=4)
    signed = quantize_blockwise(weight, block_size=16, bits=4, signed_scales=True)

    def block_errors(bw):
        diff = (dequantize(bw) - weight).astype(np.float64) ** 2
        return diff.reshape(4, 16, 24).sum(axis=1)

    assert np.all(block_errors(signed) <= block_errors(plain))
    assert block_errors(signed)[0, :12].sum() < 0.9 * block_errors(plain)[0, :12].sum()
    flipped = signed.scale[0, :12] < 0  # most outlier blocks take a negative scale...
    assert flipped.sum() >= 8
    assert np.all(signed.values[5, :12][flipped] == -8)  # ...which puts the outlier on -8
    mse = quantize_blockwise(weight, block_size=16, bits=4, method="mse", signed_scales=True)
    assert np.all(block_errors(mse) <= block_errors(signed) + 1e-12)


@pytest.mark.parametrize(
    ("bits", "symmetric", "method", "signed"),
    [(8, True, "minmax", False), (4, False, "mse", False), (4, True, "minmax", True)],
)
def test_blockwise_in_column_chunks_gives_the_same_bytes(
    monkeypatch, bits, symmetric, method, signed
):
    """A large weight is quantized a few columns at a time (an embedding table whole took four
    float32 copies of itself): the chunks, here 3 columns with a short last block, change no
    byte."""
    from qtool.write import int4

    weight = np.random.default_rng(7).standard_normal((21, 40)).astype(np.float32)
    options = dict(
        bits=bits, block_size=8, symmetric=symmetric, method=method, axis=0, signed_scales=signed
    )
    whole = int4.quantize_blockwise(weight, **options)
    monkeypatch.setattr(int4, "_CHUNK_ELEMENTS", 3 * 24)
    chunked = int4.quantize_blockwise(weight, **options)
    np.testing.assert_array_equal(chunked.values, whole.values)
    np.testing.assert_array_equal(chunked.scale, whole.scale)
    if symmetric:
        assert chunked.zero_point is None and whole.zero_point is None
    else:
        np.testing.assert_array_equal(chunked.zero_point, whole.zero_point)


@pytest.mark.parametrize(
    ("symmetric", "method", "signed"), [(True, "minmax", True), (False, "mse", False)]
)
def test_per_channel_in_column_chunks_gives_the_same_bytes(monkeypatch, symmetric, method, signed):
    """Per-channel quantization (one block of every row per channel) runs on column chunks too,
    here 2 channels at a time: the same bytes."""
    from qtool.write import int4

    weight = np.random.default_rng(8).standard_normal((5, 24)).astype(np.float32)
    weight[3] *= 25.0  # an outlier channel
    options = dict(bits=4, symmetric=symmetric, method=method, axis=0, signed_scales=signed)
    whole = int4.quantize_per_channel(weight, **options)
    monkeypatch.setattr(int4, "_CHUNK_ELEMENTS", 2 * 24)
    chunked = int4.quantize_per_channel(weight, **options)
    np.testing.assert_array_equal(chunked.values, whole.values)
    assert chunked.scale.tobytes() == whole.scale.tobytes()
    if not symmetric:
        np.testing.assert_array_equal(chunked.zero_point, whole.zero_point)
