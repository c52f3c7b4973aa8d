"""What each command imports: `--help` and ONNX-source runs must not pay for torch or sklearn.

torch alone takes seconds to import; a CI job that quantizes an ONNX file should never load it.
The check runs in a fresh interpreter, since this test process has imported everything already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HEAVY = ("torch", "sklearn", "transformers")


def _modules_after(code: str, cwd: Path) -> set[str]:
    script = textwrap.dedent(code) + "\nimport sys\nprint(' '.join(sorted(sys.modules)))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_help_imports_neither_onnx_nor_torch(tmp_path):
    loaded = _modules_after(
        """
        from typer.testing import CliRunner
        from qtool.cli import app
        assert CliRunner().invoke(app, ["--help"]).exit_code == 0
        """,
        tmp_path,
    )
    assert not loaded & {"torch", "onnx", "onnxruntime", "sklearn"}


def test_onnx_source_quantize_and_evaluate_never_import_torch(tmp_path):
    weight = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx"
    )
    (tmp_path / "recipe.yaml").write_text(
        "model: {onnx: m.onnx}\ninputs: {x: [4, 16]}\n"
        "calibration: {data: {synthetic: true, samples: 8}, batch_size: 4}\n"
        "evaluation: {data: {synthetic: true, samples: 8}}\n"
    )
    loaded = _modules_after(
        """
        from typer.testing import CliRunner
        from qtool.cli import app
        for args in (["quantize", "recipe.yaml", "--no-progress"],
                     ["evaluate", "recipe.yaml", "--latency-runs", "1", "--no-progress"]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 0, result.output
        """,
        tmp_path,
    )
    assert "onnxruntime" in loaded  # the check would be void if nothing had run
    assert not loaded & set(HEAVY), loaded & set(HEAVY)
