"""The CLI end to end on the bundled digits example, and bad input: exit 2, one line, no output.

Accuracies and fingerprints are recomputed here with ONNX Runtime, torch and hashlib directly,
not taken from qtool, so the report and the evaluation JSON are checked against the models.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool import __version__
from qtool.calibration.stats_file import load_stats

OUTPUTS = ("model.int8.onnx", "stats.npz", "report.json")


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_recipe(folder: Path, name: str, recipe: dict) -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def digits_variant(run, name: str, **calibration) -> Path:
    """The example recipe with calibration keys replaced, written next to the original."""
    recipe = yaml.safe_load(run.recipe.read_text())
    recipe["calibration"].update(calibration)
    return write_recipe(run.folder, name, recipe)


def onnx_recipe(run, data: dict, shape: tuple[int, ...] = (1, 1, 8, 8), model: Path | None = None):
    """A recipe on the exported float digits model (no torch export, so runs are fast)."""
    return {
        "model": {"onnx": str(model or run.out / "model.fp32.onnx")},
        "inputs": {"image": list(shape)},
        "calibration": {"data": data, "batch_size": 16, "max_samples": 64, "method": "minmax"},
    }


def accuracy(model_path: Path, x: np.ndarray, y: np.ndarray, optimize: bool = True) -> float:
    options = onnxruntime.SessionOptions()
    if not optimize:
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(
        str(model_path), options, providers=["CPUExecutionProvider"]
    )
    (logits,) = session.run(None, {session.get_inputs()[0].name: x})
    return float((logits.argmax(axis=1) == y).mean())


def assert_clean_failure(result, out: Path, *needles: str) -> None:
    """Exit 2, exactly one line on stderr that names the culprit, and no (partial) outputs."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in result.output
    for name in OUTPUTS:
        assert not (out / name).exists(), name
    if out.exists():
        assert not [p.name for p in out.rglob(".*.tmp")]


@pytest.fixture(scope="module")
def eval_split(digits_run) -> tuple[Path, np.ndarray, np.ndarray]:
    """The example's held-out split as an .npz with `labels`, for recipe-less evaluation."""
    data = load_module(digits_run.folder / "data.py", "cli_test_digits_data")
    _, x_test, _, y_test = data.load_split()
    path = digits_run.folder / "eval.npz"
    np.savez(path, image=x_test, labels=y_test)
    return path, x_test, y_test


@pytest.fixture(scope="module")
def recipe_eval(digits_run, cli, tmp_path_factory) -> tuple[object, dict]:
    path = tmp_path_factory.mktemp("eval") / "f.json"
    args = ["evaluate", digits_run.recipe, "-o", digits_run.out, "--json", path]
    result = cli(*args, "--max-drop", "5", "--latency-runs", "3", "--no-progress")
    return result, json.loads(path.read_text()) if path.is_file() else {}


# ------------------------------------------------------------------------------ happy path


def test_calibrate_then_quantize_with_stats_writes_outputs(digits_run) -> None:
    assert digits_run.calibrate.exit_code == 0, digits_run.calibrate.output
    assert digits_run.quantize.exit_code == 0, digits_run.quantize.output
    for name in ("model.fp32.onnx", *OUTPUTS):
        assert (digits_run.out / name).is_file(), name
    assert not list(digits_run.out.glob(".*.tmp"))
    stats, fingerprint = load_stats(digits_run.out / "stats.npz")
    float_bytes = (digits_run.out / "model.fp32.onnx").read_bytes()
    assert fingerprint == hashlib.sha256(float_bytes).hexdigest()
    # the recipe's max_samples, less the tuning rows its mse ranges are judged on (every 4th)
    assert {s.samples for s in stats.values()} == {512 - 128}
    onnx.checker.check_model(onnx.load(str(digits_run.out / "model.int8.onnx")))


def test_evaluate_writes_json_with_both_accuracies(digits_run, recipe_eval, eval_split) -> None:
    result, report = recipe_eval
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout
    _, x_test, y_test = eval_split
    assert report["samples"] == len(y_test)
    (out,) = report["outputs"]  # the digits CNN has one output
    assert report["gated_output"] == out["name"] and report["labels"] is True
    fp32, quant = out["fp32_accuracy"], out["fused"]["accuracy"]
    assert fp32 >= 0.95
    assert fp32 - quant <= 0.02
    one_sample = 1.0 / len(y_test)
    assert fp32 == pytest.approx(
        accuracy(digits_run.out / "model.fp32.onnx", x_test, y_test), abs=one_sample
    )
    assert quant == pytest.approx(
        accuracy(digits_run.out / "model.int8.onnx", x_test, y_test), abs=one_sample
    )
    unfused = accuracy(digits_run.out / "model.int8.onnx", x_test, y_test, optimize=False)
    assert out["unfused"]["accuracy"] == pytest.approx(unfused, abs=one_sample)
    (gate,) = report["gates"]  # --max-drop 5 on the command line
    assert (gate["gate"], gate["metric"], gate["limit"], gate["passed"]) == (
        "max_drop",
        "accuracy",
        5.0,
        True,
    )
    assert gate["value"] == pytest.approx((fp32 - quant) * 100)
    assert report["passed"] is True
    # The exported float model still computes what the PyTorch model does.
    model_module = load_module(digits_run.folder / "model.py", "cli_test_digits_model")
    module = model_module.make_model()
    module.load_state_dict(torch.load(digits_run.folder / "weights.pt", weights_only=True))
    with torch.no_grad():
        logits = module.eval()(torch.from_numpy(x_test)).numpy()
    assert fp32 == pytest.approx(float((logits.argmax(1) == y_test).mean()), abs=one_sample)


def test_negative_max_drop_is_bad_input(digits_run, cli) -> None:
    args = ["evaluate", digits_run.recipe, "-o", digits_run.out, "--max-drop", "-1"]
    result = cli(*args, "--latency-runs", "1", "--no-progress")
    assert result.exit_code == 2, result.output
    assert "--max-drop" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_unreachable_sqnr_floor_exits_1(digits_run, recipe_eval, cli, tmp_path) -> None:
    _, report = recipe_eval
    sqnr = report["outputs"][0]["fused"]["sqnr_db"]
    assert sqnr < 200  # an int8 model cannot reach 200 dB, so this floor cannot be met
    junit = tmp_path / "gates.xml"
    args = ["evaluate", digits_run.recipe, "-o", digits_run.out, "--min-sqnr", "200"]
    result = cli(*args, "--junit", junit, "--latency-runs", "1", "--no-progress")
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.stderr and "SQNR" in result.stderr
    assert "PASS" in result.stdout  # the recipe's max_drop gate still passes on its own
    suite = ET.fromstring(junit.read_bytes()).find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")


def test_evaluate_without_recipe_on_npz(digits_run, recipe_eval, eval_split, cli, tmp_path) -> None:
    npz, _, y_test = eval_split
    out = tmp_path / "g.json"
    args = ["evaluate", "--fp32", digits_run.out / "model.fp32.onnx"]
    args += ["--quant", digits_run.out / "model.int8.onnx", "--data", npz, "--json", out]
    result = cli(*args, "--latency-runs", "3", "--no-progress")
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["samples"] == len(y_test)
    assert report["gates"] == []  # no recipe, no gate options: nothing to pass or fail
    _, from_recipe = recipe_eval
    # Same held-out data through the recipe's python source: the same numbers.
    assert report["outputs"] == from_recipe["outputs"]


def test_report_lists_every_float_node_with_precision_and_reason(digits_run) -> None:
    report = json.loads((digits_run.out / "report.json").read_text())
    float_model = onnx.load(str(digits_run.out / "model.fp32.onnx"))
    assert [n["name"] for n in report["nodes"]] == [n.name for n in float_model.graph.node]
    for node in report["nodes"]:
        assert node["precision"] in {"int8", "float"}
        assert isinstance(node["reason"], str) and node["reason"]
    quant_model = onnx.load(str(digits_run.out / "model.int8.onnx"))
    producer = {out: n.op_type for n in quant_model.graph.node for out in n.output}
    by_name = {n.name: n for n in quant_model.graph.node}
    for node in report["nodes"]:
        if node["precision"] == "int8":  # every input of a quantized node is dequantized
            inputs = by_name[node["name"]].input
            assert {producer.get(i) for i in inputs} == {"DequantizeLinear"}, node["name"]
    ops = [n.op_type for n in float_model.graph.node]
    int8 = [n["op_type"] for n in report["nodes"] if n["precision"] == "int8"]
    assert sorted(int8) == sorted(op for op in ops if op in ("Conv", "Gemm", "MatMul"))


def test_quantize_is_deterministic(digits_run, cli, tmp_path) -> None:
    other = tmp_path / "again"
    result = cli("quantize", digits_run.recipe, "-o", other, "--no-progress")
    assert result.exit_code == 0, result.output
    for name in ("model.int8.onnx", "stats.npz", "model.fp32.onnx"):
        assert (other / name).read_bytes() == (digits_run.out / name).read_bytes(), name
    first = json.loads((digits_run.out / "report.json").read_text())
    second = json.loads((other / "report.json").read_text())
    assert first.pop("files") != second.pop("files")
    assert first == second


def test_stats_do_not_depend_on_batch_size(digits_run, cli, tmp_path) -> None:
    files = []
    for batch_size in (1, 32):
        recipe = digits_variant(
            digits_run, f"bs{batch_size}.yaml", batch_size=batch_size, max_samples=96
        )
        out = tmp_path / f"bs{batch_size}"
        result = cli("calibrate", recipe, "-o", out, "--no-progress")
        assert result.exit_code == 0, result.output
        files.append((out / "stats.npz").read_bytes())
    assert files[0] == files[1]


def test_version(cli) -> None:
    version = cli("--version")
    assert version.exit_code == 0 and __version__ in version.stdout


def test_doctor_runs(cli) -> None:
    doctor = cli("doctor")
    assert doctor.exit_code == 0, doctor.output
    assert onnxruntime.__version__ in doctor.stdout


def test_doctor_names_each_kernel_backend(cli) -> None:
    doctor = cli("doctor")
    assert doctor.exit_code == 0, doctor.output
    assert "kernels[cpu]" in doctor.stdout


def test_installed_console_script_reports_bad_input(tmp_path) -> None:
    script = Path(sys.executable).parent / "qtool"
    executable = str(script) if script.is_file() else shutil.which("qtool")
    assert executable, "the qtool console script is not installed"
    missing = tmp_path / "missing.yaml"
    proc = subprocess.run(
        [executable, "quantize", str(missing), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "not found" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ bad input


def test_missing_recipe_file(cli, tmp_path) -> None:
    out = tmp_path / "out"
    result = cli("quantize", tmp_path / "nope.yaml", "-o", out, "--no-progress")
    assert_clean_failure(result, out, "nope.yaml")


def test_malformed_recipe(digits_run, cli, tmp_path) -> None:
    text = digits_run.recipe.read_text().replace("  batch_size: 32", "\tbatch_size: 32")
    recipe = tmp_path / "tabbed.yaml"
    recipe.write_text(text)
    line = text.splitlines().index("\tbatch_size: 32") + 1
    out = tmp_path / "out"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert_clean_failure(result, out, "tabbed.yaml", f"line {line}")


def test_input_shape_that_does_not_match_the_model(digits_run, cli, tmp_path) -> None:
    npz = tmp_path / "calib.npz"
    np.savez(npz, image=np.zeros((4, 1, 9, 9), np.float32))
    recipe = write_recipe(
        tmp_path, "r.yaml", onnx_recipe(digits_run, {"npz": str(npz)}, (1, 1, 9, 9))
    )
    out = tmp_path / "out"
    assert_clean_failure(cli("quantize", recipe, "-o", out, "--no-progress"), out, "inputs.image")
    assert not (out / "model.fp32.onnx").exists()


def test_nan_in_calibration_data(digits_run, cli, tmp_path) -> None:
    x = np.random.default_rng(0).random((40, 1, 8, 8), dtype=np.float32)
    x[21, 0, 3, 4] = np.nan
    np.savez(tmp_path / "nan.npz", image=x)
    recipe = write_recipe(tmp_path, "r.yaml", onnx_recipe(digits_run, {"npz": "nan.npz"}))
    out = tmp_path / "out"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert_clean_failure(result, out, "'image'", "sample 21")


def test_npz_without_the_input_array(digits_run, cli, tmp_path) -> None:
    np.savez(tmp_path / "wrong.npz", pixels=np.zeros((8, 1, 8, 8), np.float32))
    recipe = write_recipe(tmp_path, "r.yaml", onnx_recipe(digits_run, {"npz": "wrong.npz"}))
    out = tmp_path / "out"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert_clean_failure(result, out, "wrong.npz", "'image'")


def test_python_data_entry_point_that_raises(digits_run, cli, tmp_path) -> None:
    (tmp_path / "broken.py").write_text(
        "import numpy as np\n\n\ndef batches():\n"
        "    yield {'image': np.zeros((16, 1, 8, 8), np.float32)}\n"
        "    raise OSError('camera unplugged')\n"
    )
    data = {"python": "broken.py:batches"}
    recipe = write_recipe(tmp_path, "r.yaml", onnx_recipe(digits_run, data))
    out = tmp_path / "out"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert_clean_failure(result, out, "broken.py:batches", "camera unplugged")


def test_stats_from_a_different_model(digits_run, cli, tmp_path) -> None:
    weight = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["image", "W"], ["y"], transB=1)],
        "tiny",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(weight, "W")],
    )
    tiny = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(tiny, str(tmp_path / "tiny.onnx"))
    tiny_recipe = onnx_recipe(
        digits_run, {"synthetic": True, "samples": 16}, (1, 4), tmp_path / "tiny.onnx"
    )
    calibrated = cli(
        "calibrate",
        write_recipe(tmp_path, "tiny.yaml", tiny_recipe),
        "-o",
        tmp_path / "tiny",
        "--no-progress",
    )
    assert calibrated.exit_code == 0, calibrated.output
    foreign = tmp_path / "tiny" / "stats.npz"
    recipe = write_recipe(tmp_path, "r.yaml", onnx_recipe(digits_run, {"synthetic": True}))
    out = tmp_path / "out"
    result = cli("quantize", recipe, "--stats", foreign, "-o", out, "--no-progress")
    assert_clean_failure(result, out, str(foreign))


def test_onnx_file_that_is_not_onnx(digits_run, cli, tmp_path) -> None:
    bad = tmp_path / "garbage.onnx"
    bad.write_bytes(np.random.default_rng(7).bytes(4096))
    recipe = write_recipe(
        tmp_path, "r.yaml", onnx_recipe(digits_run, {"synthetic": True}, model=bad)
    )
    out = tmp_path / "out"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert_clean_failure(result, out, "garbage.onnx")


def test_error_line_keeps_bracketed_text(digits_run, cli, tmp_path) -> None:
    np.savez(tmp_path / "e.npz", image=np.zeros((4, 1, 9, 9), np.float32))
    recipe = onnx_recipe(digits_run, {"synthetic": True}, (1, 1, 9, 9))
    recipe["evaluation"] = {"data": {"npz": "e.npz"}}
    path = write_recipe(tmp_path, "r.yaml", recipe)
    # Evaluate the digits outputs with 9x9 data: evaluate's own input check names the shape.
    result = cli("evaluate", path, "-o", digits_run.out, "--no-progress")
    assert result.exit_code == 2, result.output
    model = onnx.load(str(digits_run.out / "model.fp32.onnx"))
    batch_dim = model.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    assert batch_dim  # the exported batch axis is symbolic and has a lowercase name
    assert f"[{batch_dim}, 1, 8, 8]" in result.stderr, result.stderr


def test_output_dir_below_a_file(digits_run, cli, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    recipe = write_recipe(tmp_path, "r.yaml", onnx_recipe(digits_run, {"synthetic": True}))
    out = blocker / "out"
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert_clean_failure(result, out, str(blocker))


def test_doctor_reports_the_int8_relevant_cpu_features(cli) -> None:
    from qtool.ort.cpu import detect_cpu

    doctor = cli("doctor")
    assert doctor.exit_code == 0, doctor.output
    text = " ".join(doctor.stdout.split())
    cpu = detect_cpu()
    for feature in sorted(cpu.features):
        assert feature in text
    expected = "saturating 16-bit sums" if cpu.u8s8_saturates else "do not saturate"
    assert (expected in text) or (cpu.vnni and "no saturation" in text)
