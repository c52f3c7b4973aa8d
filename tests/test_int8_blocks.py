"""8-bit weights in blocks are a weight-only form (MatMulNBits): a node planned int8 with int8
activations takes one scale per output channel instead, even where the blocks come from a 4-bit
level of the recipe (an int4 base with an int8 override, `--auto`'s int8 candidate on an INT4
preset). Before, ONNX Runtime fused the blocked weight into a MatMulIntegerToFloat that failed
to run ("Attempting to broadcast an axis by a dimension other than 1")."""

from __future__ import annotations

import textwrap

import numpy as np
import onnxruntime
import yaml

from qtool.app.quantize import quantize
from qtool.config.recipe import load_recipe

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    """
)


def _quantize(tmp_path, quantization: dict):
    (tmp_path / "model.py").write_text(MODEL)
    recipe = {
        "model": {"pytorch": "model.py:make_model", "opset": 21},
        "inputs": {"x": [1, 8, 64]},  # batched [1, 8, 64]: the case MatMulIntegerToFloat broke on
        "calibration": {"data": {"synthetic": True, "samples": 4}, "method": "minmax"},
        "quantization": {"op_types": ["MatMul", "Gemm"], **quantization},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return quantize(load_recipe(tmp_path / "recipe.yaml"), progress=False)


def _nodes(result) -> dict[str, dict]:
    return {n["name"]: n for n in result.report["nodes"] if n["precision"] != "float"}


def _runs(result) -> None:
    session = onnxruntime.InferenceSession(
        str(result.model_path), providers=["CPUExecutionProvider"]
    )
    out = session.run(None, {"x": np.ones((1, 8, 64), np.float32)})[0]
    assert out.shape == (1, 8, 64) and np.isfinite(out).all()


def test_an_int8_override_on_a_4bit_base_takes_per_channel_weights(tmp_path):
    result = _quantize(
        tmp_path,
        {
            "weights": {"bits": 4, "block_size": 32},
            "overrides": [{"nodes": "/0/MatMul", "precision": "int8"}],
        },
    )
    nodes = _nodes(result)
    first, second = nodes["/0/MatMul"], nodes["/2/MatMul"]
    assert (first["precision"], first["activations"]) == ("int8", "int8")
    assert first["weight"]["granularity"] == "per-channel" and first["weight"]["block_size"] is None
    assert "one scale per output channel" in first["reason"]
    assert (second["precision"], second["weight"]["block_size"]) == ("int4", 32)
    _runs(result)


def test_weight_only_8bit_blocks_stay_blocks(tmp_path):
    result = _quantize(tmp_path, {"activations": "float", "weights": {"bits": 8, "block_size": 32}})
    for node in _nodes(result).values():
        assert (node["activations"], node["weight"]["block_size"]) == ("float", 32)
    _runs(result)
