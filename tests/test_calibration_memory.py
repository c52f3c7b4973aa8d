"""While ONNX Runtime calibrates, the process holds the float model once: in the session.

The prepared ModelProto and its serialized bytes are let go before the session is created (the
bytes staged as model.fp32.onnx, committed with the stats), and read back afterwards.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.app.calibrate import calibrate
from qtool.app.common import prepare
from qtool.app.quantize import quantize
from qtool.calibration import collect
from qtool.config.recipe import load_recipe
from qtool.errors import DataError


def _recipe(folder: Path, data: dict) -> Path:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 2)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w1"], ["h"], name="fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2"),
        ],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        initializer=[w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, folder / "model.onnx")
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, 4]},
        "calibration": {"data": data, "method": "minmax", "batch_size": 8},
        "output": {"dir": "out"},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_the_session_is_the_only_holder_of_the_model_while_calibrating(
    tmp_path: Path, monkeypatch
) -> None:
    recipe = load_recipe(_recipe(tmp_path, {"synthetic": True, "samples": 16}))
    prepared = prepare(recipe)
    original = prepared.model.serialized
    seen: dict = {}
    real = collect.create_session

    def spy(source, **kwargs):
        session_frame = inspect.currentframe().f_back  # collect._session
        collect_frame = session_frame.f_back
        caller_frame = collect_frame.f_back  # pipeline.statistics.collect_statistics
        seen["collect_locals"] = set(collect_frame.f_locals) | set(session_frame.f_locals)
        seen["holder"] = collect_frame.f_locals.get("holder")
        seen["caller_protos"] = [
            name for name, v in caller_frame.f_locals.items() if isinstance(v, onnx.ModelProto)
        ]
        seen["held"] = (prepared.model.model, prepared.model.serialized)
        seen["staged"] = {
            name: (tmp_path / "out" / name).read_bytes() for name in _temporaries(tmp_path / "out")
        }
        return real(source, **kwargs)

    monkeypatch.setattr(collect, "create_session", spy)
    calibrate(recipe, prepared, progress=False)

    assert "model" not in seen["collect_locals"]  # collect dropped the proto before the session
    assert seen["holder"] == []
    assert seen["caller_protos"] == []  # and nobody up the stack keeps it alive
    assert seen["held"] == (None, None)
    (staged,) = seen["staged"].values()  # the float model, staged once before ORT ran
    assert staged == original
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["model.fp32.onnx", "stats.npz"]
    written = (out / "model.fp32.onnx").read_bytes()
    assert hashlib.sha256(written).hexdigest() == prepared.model.fingerprint
    # read back for later stages (analyze scores the bytes, quantize reads the proto)
    assert prepared.model.serialized == original
    assert prepared.model.model.SerializeToString() == original
    assert prepared.model.float_file is None  # committed: a later run stages its own


def test_a_failed_calibration_removes_the_staged_float_model(tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
    x[11, 2] = np.nan  # the second batch fails after the float model was staged
    np.savez(tmp_path / "calib.npz", x=x)
    recipe = load_recipe(_recipe(tmp_path, {"npz": "calib.npz"}))
    prepared = prepare(recipe)
    with pytest.raises(DataError, match="NaN or Inf in sample 11"):
        calibrate(recipe, prepared, progress=False)
    out = tmp_path / "out"
    assert not out.exists() or list(out.iterdir()) == []


def test_quantize_after_calibrating_writes_the_float_model_once(
    tmp_path: Path, monkeypatch
) -> None:
    import qtool.io

    recipe = load_recipe(_recipe(tmp_path, {"synthetic": True, "samples": 16}))
    writes: list[Path] = []
    real = qtool.io._write_temporary

    def spy(path, write):
        writes.append(Path(path).name)
        return real(path, write)

    monkeypatch.setattr(qtool.io, "_write_temporary", spy)
    result = quantize(recipe, progress=False)
    assert writes.count("model.fp32.onnx") == 1
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "model.fp32.onnx",
        "model.int8.onnx",
        "report.json",
        "stats.npz",
    ]
    assert result.model_path == out / "model.int8.onnx"
