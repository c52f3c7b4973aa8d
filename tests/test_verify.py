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


def _weight_only_model(tmp_path, level: int):
    """A two-Linear model quantized 4-bit weight-only, MatMulNBits written at `level`."""
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
                return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
            """
        )
    )
    (tmp_path / "recipe.yaml").write_text(
        "model: {pytorch: model.py:make_model}\ninputs: {x: [2, 64]}\n"
        "calibration: {data: {synthetic: true, samples: 4}, method: minmax}\n"
        "quantization:\n  op_types: [MatMul, Gemm]\n  activations: float\n"
        f"  accuracy_level: '{level}'\n  weights: {{bits: 4, block_size: 32}}\n"
    )
    return quantize(load_recipe(tmp_path / "recipe.yaml"), progress=False)


class _Node:
    def __init__(self, activations: str) -> None:
        self.activations = activations


class _Plan:
    """The one thing the gap warning reads of a Plan: the quantized nodes' activations."""

    def __init__(self, *activations: str) -> None:
        self.nodes = [_Node(a) for a in activations]

    def quantized(self):
        return self.nodes


def test_a_weight_only_gap_names_int8_compute_inside_matmulnbits(tmp_path) -> None:
    """Weight-only models have no activation Q/DQ: their fused-vs-unfused gap comes from
    MatMulNBits computing with int8 inputs (accuracy_level 4), and the one warning says so for
    all the outputs below the threshold, not the CPU's requantization."""
    from qtool.ort.cpu import detect_cpu
    from qtool.runtime.fusion import optimized_session
    from qtool.runtime.verify import _fused_gap_warning

    result = _weight_only_model(tmp_path, 4)
    loaded = optimized_session(result.model_path)
    sqnr = {"logits": 25.0, "present.0.key": 28.0, "hidden": 40.0}
    warning = _fused_gap_warning(sqnr, _Plan("float", "float"), loaded, detect_cpu())
    assert warning is not None and "2 outputs" in warning
    assert "'logits' 25.0 dB" in warning and "hidden" not in warning
    assert "accuracy_level 4" in warning and "accuracy_level: 1" in warning
    # a model with activation Q/DQ gets the integer kernels' cause instead
    mixed = _fused_gap_warning(sqnr, _Plan("float", "uint8"), loaded, detect_cpu())
    assert mixed is not None and "accuracy_level 4" not in mixed
    assert _fused_gap_warning({"logits": 31.0}, _Plan("float"), loaded, detect_cpu()) is None


def test_fp32_compute_matmulnbits_is_not_blamed(tmp_path) -> None:
    from qtool.ort.cpu import detect_cpu
    from qtool.runtime.fusion import optimized_session
    from qtool.runtime.verify import _fused_gap_warning

    result = _weight_only_model(tmp_path, 1)
    loaded = optimized_session(result.model_path)
    warning = _fused_gap_warning({"y": 20.0}, _Plan("float"), loaded, detect_cpu())
    assert warning is not None and "accuracy_level 4" not in warning
