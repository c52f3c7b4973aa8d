"""4-bit MatMul weights written as MatMulNBits: the same node ORT's own fusion makes, per CPU.

The reference is ONNX Runtime itself: the QDQ form (blocked DequantizeLinear -> MatMul) is given
to ORT, which fuses it into MatMulNBits and saves the graph; qtool's direct writer must produce
the same initializers byte for byte and the same attributes, so the two models compute the same
numbers, and the compute type (accuracy level) is then in the file, not in a session option.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.ort.accuracy_level import ACCURACY_LEVEL_KEY
from qtool.ort.cpu import resolve_cpu
from qtool.plan.settings import QuantizationSpec
from qtool.write.int4 import dequantize_node, quantize_blockwise, to_initializers
from qtool.write.matmul_nbits import (
    accuracy_level_for,
    matmul_nbits_node,
    nbits_initializers,
    nbits_level,
    read_nbits_weight,
)


def _graph_model(nodes, initializers, k: int, n: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return model


def _ort_fused(model: onnx.ModelProto, level: int, tmp: Path) -> onnx.ModelProto:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp / "fused.onnx")
    options.add_session_config_entry(ACCURACY_LEVEL_KEY, str(level))
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(tmp / "fused.onnx"))


@pytest.mark.parametrize(
    "k, block, symmetric, level",
    [(64, 16, True, 1), (40, 16, True, 4), (96, 32, False, 1), (72, 32, False, 4)],
)
def test_written_node_is_byte_identical_to_orts_fusion(tmp_path, k, block, symmetric, level):
    n = 6
    rng = np.random.default_rng(k)
    weight = rng.standard_normal((k, n)).astype(np.float32)
    bw = quantize_blockwise(weight, block_size=block, bits=4, symmetric=symmetric, name="w")
    qdq = _graph_model(
        [dequantize_node("w", bw, "w_dq"), helper.make_node("MatMul", ["x", "w_dq"], ["y"])],
        to_initializers("w", bw),
        k,
        n,
    )
    fused = _ort_fused(qdq, level, tmp_path)
    [theirs] = [node for node in fused.graph.node if node.op_type == "MatMulNBits"]
    matmul = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    ours = matmul_nbits_node(matmul, "w", bw, None, level)
    attributes = {a.name: helper.get_attribute_value(a) for a in theirs.attribute}
    attributes.pop("weight_prepacked", None)  # ORT's own bookkeeping flag, default 0
    assert {a.name: helper.get_attribute_value(a) for a in ours.attribute} == attributes

    their_inits = {i.name: numpy_helper.to_array(i) for i in fused.graph.initializer}
    our_inits = nbits_initializers("w", bw)
    assert len(our_inits) == sum(1 for name in theirs.input if name) - 1  # all but x
    their_names = [i for i in theirs.input[1:] if i]
    for ours_tensor, their_name in zip(our_inits, their_names, strict=True):
        mine, reference = numpy_helper.to_array(ours_tensor), their_inits[their_name]
        assert mine.dtype == reference.dtype and mine.shape == reference.shape, their_name
        assert mine.tobytes() == reference.tobytes(), their_name

    read_back = read_nbits_weight(ours, {t.name: numpy_helper.to_array(t) for t in our_inits})
    for field in ("values", "scale", "zero_point"):
        expected, got = getattr(bw, field), getattr(read_back, field)
        if expected is None:
            assert got is None
        else:
            assert got.dtype == expected.dtype and np.array_equal(got, expected), field

    direct = _graph_model([ours], our_inits, k, n)
    x = rng.standard_normal((3, k)).astype(np.float32)
    run = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (direct, fused)
    ]
    np.testing.assert_array_equal(run[0].run(None, {"x": x})[0], run[1].run(None, {"x": x})[0])


@pytest.mark.parametrize(
    "cpu, level",
    [
        ("avx2", 1),
        ("avx512", 1),
        ("avx512-vnni", 4),
        ("avx-vnni", 4),
        ("arm64-dotprod", 4),
        ("arm64", 1),
    ],
)
def test_accuracy_level_follows_the_deployment_cpu(cpu, level):
    chosen, why = accuracy_level_for(resolve_cpu(cpu))
    assert chosen == level
    assert ("int8 compute" if level == 4 else "fp32 compute") in why


def test_recipe_chooses_format_and_level():
    cpu = resolve_cpu("avx512-vnni")
    assert nbits_level(QuantizationSpec(), cpu)[0] == 4
    assert nbits_level(QuantizationSpec(accuracy_level="1"), cpu) == (
        1,
        "fp32 compute: set by quantization.accuracy_level",
    )
    assert nbits_level(QuantizationSpec(int4_format="qdq"), cpu)[0] is None
    assert nbits_level(QuantizationSpec(target="tensorrt"), cpu)[0] is None
