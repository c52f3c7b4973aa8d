"""The verify stage end to end: what quantize records in report.json and warns about.

qtool/runtime/fusion.py has its own tests (tests/test_fusion.py); these check that quantize records
the truth in report.json, warns about unfused nodes and compares fused with unfused outputs."""

from __future__ import annotations

import onnx


def test_report_records_the_runtime_truth_of_every_quantized_node(digits_run) -> None:
    import json

    report = json.loads((digits_run.out / "report.json").read_text())
    quantized = [n for n in report["nodes"] if n["precision"] != "float"]
    assert quantized and all(n["runtime"]["status"] == "fused" for n in quantized)
    assert {n["runtime"]["runs_as"] for n in quantized} == {"QLinearConv", "QGemm"}
    runtime = report["runtime"]
    assert runtime["planned"] == runtime["fused"] == len(quantized)
    assert set(runtime["fused_vs_unfused_sqnr_db"]) == {"output"}
    assert "fuses 5 of 5 quantized nodes" in digits_run.quantize.output.replace("\n", " ")


def test_quantize_warns_when_ort_cannot_fuse(tmp_path) -> None:
    """The last Conv's output is the graph output, so it gets no QuantizeLinear and ORT cannot
    form QLinearConv: the report and the warnings must say it runs in float."""
    import textwrap

    from qtool.app.quantize import quantize
    from qtool.config.recipe import load_recipe

    (tmp_path / "model.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def make_model():
                torch.manual_seed(0)
                return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3))
            """
        )
    )
    (tmp_path / "recipe.yaml").write_text(
        "model: {pytorch: model.py:make_model}\ninputs: {x: [1, 3, 8, 8]}\n"
        "calibration: {data: {synthetic: true, samples: 8}, method: minmax}\n"
    )
    result = quantize(load_recipe(tmp_path / "recipe.yaml"), progress=False)
    runtime = {n["name"]: n["runtime"] for n in result.report["nodes"] if "runtime" in n}
    last = runtime["/1/Conv"]
    assert last["status"] == "float" and "QuantizeLinear" in last["reason"]
    assert any("/1/Conv" in w and "not fused" in w for w in result.warnings)
    assert result.report["runtime"]["fused"] == result.report["runtime"]["planned"] - 1
    onnx.checker.check_model(onnx.load(str(result.model_path)))
