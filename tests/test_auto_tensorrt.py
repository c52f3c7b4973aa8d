"""`quantize --auto` for TensorRT chooses among fp8, int8 and fp16 per node (issue 20, item 3).

The digits CNN prepared at opset 21 (float8 Q/DQ need 19) with target tensorrt and FP16
elsewhere: the analysis measures every weighted node at int8 and fp16, and at fp8 where TensorRT's
FP8 kernels take it (conv3 and fc1; the small layers stay out), the knapsack prices
them from the files the writer builds (fp8 and int8 one byte a weight, fp16 two), and the plan
verified is the one written, strongly typed and within the budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import yaml

from qtool.app.common import prepare
from qtool.config.recipe import load_recipe


def test_auto_on_tensorrt_offers_fp8_int8_and_fp16(digits_dir, cli) -> None:
    recipe = digits_dir / "recipe-auto-trt.yaml"
    recipe.write_text(
        "base: recipe.yaml\n"
        "model: {opset: 21}\n"
        "quantization: {target: tensorrt, float_type: fp16}\n"
        "mixed_precision: {budget: {min_sqnr: 30}, samples: 64}\n"
        "output: {dir: out-auto-trt}\n"
    )
    out = digits_dir / "out-auto-trt"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    mixed = report["mixed_precision"]
    assert mixed["passed"] and mixed["analysis"]["candidates"] == ["fp8", "int8", "fp16", "float"]
    nodes = {node["name"]: node for node in mixed["nodes"]}
    for node in nodes.values():
        assert {"int8", "fp16"} <= set(node["choices"]), node
    # fp8 only where TensorRT's FP8 kernels take the node (conv1: 1 input channel, conv2: 16,
    # fc2: N = 10 stay out, qtool/plan/ops/tensorrt_fp8.py), and the notes say why
    assert {n for n, node in nodes.items() if "fp8" in node["choices"]} == {
        "/conv3/Conv",
        "/fc1/Gemm",
    }
    assert any("TensorRT's FP8 kernels gain nothing" in note for note in mixed["notes"]), mixed[
        "notes"
    ]
    sizes = {p: c["bytes"] for p, c in nodes["/conv3/Conv"]["choices"].items()}
    assert sizes["fp8"] < sizes["fp16"] < sizes["float"]  # priced from the files written
    assert set(mixed["references"]) >= {"fp8", "int8", "fp16", "float"}
    weighted = ("Conv", "Gemm")
    chosen = {n["name"]: n["precision"] for n in report["nodes"] if n["op_type"] in weighted}
    assert set(chosen.values()) <= {"fp8", "int8", "fp16", "float"}
    model = onnx.load(str(mixed["files"]["model"]))
    onnx.checker.check_model(model, full_check=True)
    assert report["tensorrt"]["placement"]["passed"], report["tensorrt"]["placement"]
    assert mixed["measured"]["sqnr_db"] >= 30.0
    # plan.yaml pins the chosen precisions as overrides a recipe reads back to the same plan
    overrides = yaml.safe_load(Path(mixed["files"]["plan"]).read_text())["quantization"]
    pinned = digits_dir / "recipe-pinned-trt.yaml"
    pinned.write_text(
        "base: recipe.yaml\n"
        "model: {opset: 21}\n"
        + yaml.safe_dump(
            {"quantization": {"target": "tensorrt", "float_type": "fp16", **overrides}}
        )
    )
    layout = prepare(load_recipe(pinned)).layout
    planned = {n.name: n.precision for n in layout.plan if n.name in chosen}
    assert planned == chosen
