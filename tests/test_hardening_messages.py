"""Every error is one line that names what the user wrote (issue 21, items 4 and the usage box).

Bad options and missing arguments of every command print `error: ...` naming the option or
argument and exit 2, like every other error, instead of Typer's five-line usage box (--help and
a bare `qtool` still print the help). Hostile inputs (a node reading a tensor nothing defines,
an operator ONNX does not know, folders where files belong and files where folders belong) fail
in one line naming the file, node, tensor or option, and never move or replace a user's folder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import OutputError
from qtool.io import commit_files, not_a_file, stage


def one_line(result, *words: str) -> str:
    """The run's error line, checked: exit 2, one line on stderr, naming every word."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and "╭" not in result.output, result.output
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# --- usage errors: one line, naming the option or argument ---------------------------------------

USAGE = {
    "analyze --samples 0": (["analyze", "r.yaml", "--samples", "0"], ["'--samples'", "analyze"]),
    "stats merge, no files": (["stats", "merge"], ["'files'", "stats merge"]),
    "stats merge, no --output": (["stats", "merge", "a.npz"], ["'--output'"]),
    "calibrate, no recipe": (["calibrate"], ["'recipe'", "calibrate"]),
    "quantize, unknown option": (["quantize", "r.yaml", "--bogus"], ["--bogus"]),
    "qat, no recipe": (["qat"], ["'recipe'"]),
    "evaluate --batch-size x": (["evaluate", "--batch-size", "x"], ["'--batch-size'"]),
    "evaluate --accuracy-level 7": (["evaluate", "--accuracy-level", "7"], ["'--accuracy-level'"]),
    "calibrate --shard, no value": (["calibrate", "r.yaml", "--shard"], ["'--shard'"]),
    "doctor, extra argument": (["doctor", "extra"], ["extra", "doctor"]),
    "unknown command": (["nosuch"], ["'nosuch'"]),
}


@pytest.mark.parametrize("case", USAGE)
def test_usage_errors_are_one_line_naming_the_option(cli, case) -> None:
    args, words = USAGE[case]
    line = one_line(cli(*args), *words)
    assert "--help" in line  # where to read the usage instead of a box


@pytest.mark.parametrize("args", [[], ["stats"]])
def test_a_group_without_a_command_still_prints_its_help(cli, args) -> None:
    result = cli(*args)
    assert result.exit_code == 2
    assert "Usage: qtool" in result.output and "Commands" in result.output


@pytest.mark.parametrize("args", [["--help"], ["quantize", "--help"], ["stats", "merge", "-h"]])
def test_help_is_unchanged(cli, args) -> None:
    result = cli(*args)
    if args[-1] == "-h":  # no short help option: an ordinary usage error, in one line
        one_line(result, "-h")
        return
    assert result.exit_code == 0 and "Usage: qtool" in result.output
    assert "╭─ Options" in result.output


# --- models that name internals ------------------------------------------------------------------


def _model(reads: str = "r", output: str = "y", relu: tuple[str, str] = ("Relu", "")):
    rng = np.random.default_rng(0)
    op_type, domain = relu
    nodes = [
        helper.make_node("Gemm", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node(op_type, ["h"], ["r"], name="act", domain=domain),
        helper.make_node("Gemm", [reads, "w2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "internal_graph_name",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", 2])],
        [
            numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w1"),
            numpy_helper.from_array(rng.standard_normal((8, 2)).astype(np.float32), "w2"),
        ],
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _recipe(folder: Path, model) -> Path:
    onnx.save(model, folder / "model.onnx")
    np.savez(folder / "data.npz", x=np.ones((8, 4), np.float32))
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, 4]},
        "calibration": {"data": {"npz": "data.npz"}, "batch_size": 4},
        "evaluation": {"data": {"npz": "data.npz"}},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


COMMANDS = [["calibrate"], ["quantize"], ["analyze", "--samples", "4"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_node_reading_an_undefined_tensor_is_named(tmp_path, cli, command) -> None:
    """Was: "element type of tensor 'y' ... cannot be inferred" (or, with op_types excluding
    the reader, "no node can be quantized with quantization.op_types")."""
    recipe = _recipe(tmp_path, _model(reads="r_typo"))
    line = one_line(cli(command[0], recipe, *command[1:], "--no-progress"))
    assert line == (
        f"error: {tmp_path / 'model.onnx'}: node 'fc2' (Gemm) reads tensor 'r_typo', which no "
        "node, initializer or graph input defines"
    )


def test_an_undefined_graph_output_is_named(tmp_path, cli) -> None:
    """Was: ONNX Runtime's "Graph output (ghost) does not exist", about a temporary model."""
    recipe = _recipe(tmp_path, _model(output="ghost"))
    one_line(
        cli("quantize", recipe, "--no-progress"),
        str(tmp_path / "model.onnx"),
        "graph output 'ghost'",
    )


def test_an_operator_onnx_does_not_define_is_named_with_its_domain(tmp_path, cli) -> None:
    recipe = _recipe(tmp_path, _model(relu=("FancyRelu", "my.ops")))
    line = one_line(cli("quantize", recipe, "--no-progress"), str(tmp_path / "model.onnx"))
    assert "node 'act' is FancyRelu of domain 'my.ops'" in line and "output 'r'" in line
    assert "internal_graph_name" not in line


def test_an_opset_upgrade_failure_names_the_file_not_the_graph(tmp_path, cli) -> None:
    model = _model()
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("my.ops", 1))
    recipe = _recipe(tmp_path, model)
    line = one_line(cli("quantize", recipe, "--no-progress"), str(tmp_path / "model.onnx"))
    assert "internal_graph_name" not in line


# --- folders where files belong, files where folders belong -------------------------------------


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, cli) -> Path:
    folder = tmp_path_factory.mktemp("messages")
    recipe = _recipe(folder, _model())
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.output
    return recipe


def _folder_with_a_file(tmp_path: Path) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "keep.txt").write_text("the user's")
    return folder


def test_folders_given_as_files_are_named_and_left_alone(quantized, tmp_path, cli) -> None:
    out = quantized.parent / "out"
    mine = _folder_with_a_file(tmp_path)
    cases = [
        (["calibrate", mine], f"{mine}: is a directory, not a recipe file"),
        (["quantize", quantized, "--stats", mine], f"{mine}: is a directory, not a stats file"),
        (["analyze", quantized, "--stats", mine], f"{mine}: is a directory, not a stats file"),
        (["stats", "merge", mine, "-o", tmp_path / "m.npz"], f"{mine}: is a directory"),
        (["stats", "merge", out / "stats.npz", "-o", mine], f"{mine}: is a directory"),
        (["evaluate", quantized, "--json", mine], f"--json {mine}: is a directory"),
        (["evaluate", quantized, "--junit", mine], f"--junit {mine}: is a directory"),
        (["analyze", quantized, "--plot", mine], f"--plot {mine}: is a directory"),
        (
            ["evaluate", "--fp32", mine, "--quant", out / "model.int8.onnx", "--data", mine],
            f"--fp32 {mine}: is a directory, not a model file",
        ),
        (
            ["evaluate", "--fp32", out / "model.fp32.onnx", "--quant", mine, "--data", mine],
            f"--data {mine}: is a directory, not a data file",
        ),
    ]
    for args, words in cases:
        one_line(cli(*args, *([] if args[0] == "stats" else ["--no-progress"])), words)
        assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"], args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # nothing moved aside


def test_a_recipe_naming_a_folder_as_its_model(tmp_path, cli) -> None:
    recipe = _recipe(tmp_path, _model())
    (tmp_path / "model.onnx").unlink()
    (tmp_path / "model.onnx").mkdir()
    one_line(cli("quantize", recipe, "--no-progress"), "model.onnx: is a directory, not a file")


def test_an_output_folder_that_is_a_file(quantized, tmp_path, cli) -> None:
    blocker = tmp_path / "out-file"
    blocker.write_text("not a folder")
    line = one_line(cli("quantize", quantized, "-o", blocker, "--no-progress"))
    assert line == f"error: --output-dir {blocker}: is a file, not a folder"
    recipe = yaml.safe_load(quantized.read_text())
    recipe["output"] = {"dir": str(blocker)}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "model.onnx").write_bytes((quantized.parent / "model.onnx").read_bytes())
    (tmp_path / "data.npz").write_bytes((quantized.parent / "data.npz").read_bytes())
    one_line(cli("calibrate", tmp_path / "recipe.yaml", "--no-progress"), "output.dir", "a file")
    assert blocker.read_text() == "not a folder"


def test_commit_never_moves_a_folder_aside(tmp_path) -> None:
    """Was: the folder was renamed to a hidden temporary, the file put in its place, and the
    error claimed nothing was written."""
    mine = _folder_with_a_file(tmp_path)
    with pytest.raises(OutputError, match="is a directory"):
        commit_files({mine: b"{}", tmp_path / "other.json": b"{}"})
    with pytest.raises(OutputError, match="is a directory"):
        stage(mine, lambda handle: handle.write(b"x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert (mine / "keep.txt").read_text() == "the user's"


def test_not_a_file_says_which(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    assert not_a_file(tmp_path / "f") is None
    assert not_a_file(tmp_path, "stats file") == "is a directory, not a stats file"
    assert not_a_file(tmp_path / "missing", "stats file") == "stats file not found"


# --- files the OS refuses to read (root reads through chmod 000: the refusal is simulated) -----


def _refuse(monkeypatch, target: Path) -> None:
    import builtins
    import zipfile

    real_open, real_zip, real_read = builtins.open, zipfile.ZipFile, Path.read_bytes

    def refused(path) -> bool:
        return str(path) == str(target)

    def denied(path):
        return PermissionError(13, "Permission denied", str(path))

    def open_(file, *args, **kwargs):
        if refused(file):
            raise denied(file)
        return real_open(file, *args, **kwargs)

    def zip_(file, *args, **kwargs):
        if refused(file):
            raise denied(file)
        return real_zip(file, *args, **kwargs)

    def read_bytes(self):
        if refused(self):
            raise denied(self)
        return real_read(self)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(zipfile, "ZipFile", zip_)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("model.onnx", "cannot read the model file"),
        ("out/stats.npz", "cannot read the stats file (Permission denied)"),
        ("data.npz", "Permission denied"),
    ],
)
def test_unreadable_files_are_named_not_called_corrupt(
    quantized, tmp_path, cli, monkeypatch, name, words
) -> None:
    target = quantized.parent / name
    _refuse(monkeypatch, target)
    stats = ["--stats", quantized.parent / "out" / "stats.npz"] if name.startswith("out") else []
    result = cli("quantize", quantized, *stats, "-o", tmp_path / "out", "--no-progress")
    line = one_line(result, str(target), words)
    assert "corrupt" not in line
