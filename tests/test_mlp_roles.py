"""The `mlp-down` role: a gated MLP's down projection, found from the graph's structure.

A decoder's largest activation outliers sit in the input of down(act(gate(x)) * up(x)); recipes
select that MatMul by role (exporters name it node_linear_6 or /mlp/down_proj/MatMul). Plain
MLPs (no gate) and a product of two projections without a non-linearity play no role.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml

from qtool.config.recipe import load_recipe
from qtool.pipeline.planning import float_tensors, plan
from qtool.plan.attention import node_roles

DIM, HIDDEN, TOKENS = 16, 24, 4


class _Blocks(torch.nn.Module):
    """SwiGLU, GeGLU (tanh GELU), a plain ReLU MLP and a bilinear product, one after another."""

    def __init__(self) -> None:
        super().__init__()
        names = ("swi_gate", "swi_up", "geg_gate", "geg_up", "bil_a", "bil_b", "plain_in")
        for name in names:
            setattr(self, name, torch.nn.Linear(DIM, HIDDEN, bias=False))
        for name in ("swi_down", "geg_down", "bil_out", "plain_out"):
            setattr(self, name, torch.nn.Linear(HIDDEN, DIM, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.swi_down(torch.nn.functional.silu(self.swi_gate(x)) * self.swi_up(x))
        gelu = torch.nn.functional.gelu(self.geg_gate(x), approximate="tanh")
        x = x + self.geg_down(self.geg_up(x) * gelu)  # the gate on the Mul's other side
        x = x + self.bil_out(self.bil_a(x) * self.bil_b(x))
        return x + self.plain_out(torch.relu(self.plain_in(x)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mlp")
    path = folder / "model.onnx"
    torch.onnx.export(
        _Blocks().eval(),
        (torch.randn(1, TOKENS, DIM),),
        str(path),
        input_names=["x"],
        output_names=["y"],
        opset_version=17,
        dynamo=False,
    )
    np.savez(folder / "cal.npz", x=np.random.default_rng(0).normal(size=(8, TOKENS, DIM)))
    return path


def _by_role(model: onnx.ModelProto) -> dict[str, set[str]]:
    by_role: dict[str, set[str]] = collections.defaultdict(set)
    for name, played in node_roles(model, float_tensors(model)).items():
        for role in played:
            by_role[role].add(name)
    return by_role


def test_down_projections_of_gated_mlps_play_mlp_down(exported: Path):
    model = onnx.shape_inference.infer_shapes(onnx.load(str(exported)))
    assert _by_role(model)["mlp-down"] == {"/swi_down/MatMul", "/geg_down/MatMul"}


def test_an_override_by_role_keeps_the_down_inputs_float(exported: Path):
    recipe = exported.parent / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"onnx": "model.onnx"},
                "inputs": {"x": [1, TOKENS, DIM]},
                "calibration": {"data": {"npz": "cal.npz"}, "method": "minmax"},
                "quantization": {
                    "op_types": ["MatMul"],
                    "overrides": [{"roles": ["mlp-down"], "activations": "float"}],
                },
            }
        )
    )
    model = onnx.shape_inference.infer_shapes(onnx.load(str(exported)))
    layout = plan(model, load_recipe(recipe).quantization, "minmax", "test")
    activations = {node.name: node.activations for node in layout.plan.quantized()}
    assert {n for n, a in activations.items() if a == "float"} == {
        "/swi_down/MatMul",
        "/geg_down/MatMul",
    }
    assert activations["/plain_out/MatMul"] == activations["/bil_out/MatMul"] != "float"
