"""Hostile and faulty input: each case fails fast, in one line naming the file, key or tensor.

Cases from issue 10 (a hostile user's tour of the digits example): YAML alias bombs, absurd
integer settings, malicious or mismatched weights files, IR versions newer than ONNX Runtime,
disk full in the middle of writing outputs, tampered stats files, and the CLI's own help/doctor.
"""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path

import pytest
import yaml

from qtool.config.recipe import load_recipe
from qtool.errors import RecipeError

RECIPE = {
    "model": {"onnx": "model.onnx"},
    "inputs": {"x": [1, 4]},
    "calibration": {"data": {"synthetic": True}},
}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "model.onnx").write_bytes(b"only its existence is checked by load_recipe")
    return tmp_path


def _write_recipe(folder: Path, text: str) -> Path:
    path = folder / "recipe.yaml"
    path.write_text(text)
    return path


# --- 1. YAML alias bombs and oversized documents -------------------------------------------------


def _alias_bomb(levels: int = 9, width: int = 10) -> str:
    """The classic billion laughs: each level is a list of `width` aliases to the level below."""
    lines = ['l0: &l0 ["lol"]']
    for level in range(1, levels + 1):
        refs = ", ".join(f"*l{level - 1}" for _ in range(width))
        lines.append(f"l{level}: &l{level} [{refs}]")
    return "\n".join(lines)


def _bomb_under_seed() -> str:
    """The bomb in a key qtool reads (seed), as in the issue."""
    indented = "\n".join("  " + line for line in _alias_bomb().splitlines())
    return yaml.safe_dump(RECIPE) + "seed:\n" + indented + "\n"


def test_alias_bomb_under_seed_fails_fast_naming_the_file(folder: Path) -> None:
    path = _write_recipe(folder, _bomb_under_seed())
    start = time.perf_counter()
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert str(path) in message and "alias" in message
    assert "\n" not in message and len(message) < 300


def test_alias_bomb_through_the_cli_exits_2_in_one_line(folder: Path, cli) -> None:
    path = _write_recipe(folder, _bomb_under_seed())
    result = cli("calibrate", path, "-o", folder / "out", "--no-progress")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(path) in lines[0]
    assert not (folder / "out").exists()


def test_recursive_alias_is_refused(folder: Path) -> None:
    text = yaml.safe_dump(RECIPE) + "seed: &loop [*loop]\n"
    with pytest.raises(RecipeError, match="refers to itself"):
        load_recipe(_write_recipe(folder, text))


def test_a_few_aliases_still_work(folder: Path) -> None:
    """Anchors are legitimate YAML: one data spec shared by calibration and evaluation."""
    text = (
        "model: {onnx: model.onnx}\n"
        "inputs: {x: [1, 4]}\n"
        "calibration:\n  data: &data {synthetic: true, samples: 16}\n"
        "evaluation:\n  data: *data\n"
    )
    recipe = load_recipe(_write_recipe(folder, text))
    assert recipe.evaluation is not None and recipe.evaluation.data.samples == 16
    assert recipe.calibration.data.samples == 16


def test_oversized_recipe_is_refused_without_parsing(folder: Path) -> None:
    text = yaml.safe_dump(RECIPE) + "# " + "x" * (2 << 20) + "\n"
    start = time.perf_counter()
    with pytest.raises(RecipeError, match="larger than 1024 KiB") as info:
        load_recipe(_write_recipe(folder, text))
    assert time.perf_counter() - start < 1.0
    assert str(folder / "recipe.yaml") in str(info.value)


def test_alias_bomb_in_a_base_preset_names_the_preset(folder: Path) -> None:
    (folder / "preset.yaml").write_text(
        "calibration:\n  x:\n" + "\n".join("    " + line for line in _alias_bomb().splitlines())
    )
    text = "base: preset.yaml\n" + yaml.safe_dump(RECIPE)
    with pytest.raises(RecipeError, match="alias") as info:
        load_recipe(_write_recipe(folder, text))
    assert "preset.yaml" in str(info.value) and "base" in str(info.value)


def test_wrong_type_error_stays_one_short_line(folder: Path) -> None:
    """A large wrong value is shown abbreviated, not repr'd in full."""
    values = ", ".join(str(i) for i in range(5000))
    text = yaml.safe_dump(RECIPE) + f"seed: [{values}]\n"
    with pytest.raises(RecipeError, match=r"seed: must be an integer") as info:
        load_recipe(_write_recipe(folder, text))
    assert len(str(info.value)) < 300


# --- 2. calibration.bins and other integers ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("1e30", "must be an integer"),  # YAML 1.1: a string
        ("1.0e+30", "must be an integer"),  # a float
        ("2**40", "must be an integer"),
        ("1099511627776", "must be <= 16384"),  # 2**40 as an integer
        ("1" + "0" * 30, "must be <= 16384"),
        ("1001", "must be even"),
        ("128", "must be >= 256"),
        ("true", "must be an integer"),
    ],
)
def test_bad_bins_fail_at_load_with_the_key_path(folder: Path, value: str, words: str) -> None:
    text = yaml.safe_dump(RECIPE).replace("calibration:\n", f"calibration:\n  bins: {value}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(_write_recipe(folder, text))
    message = str(info.value)
    assert "calibration.bins" in message and words in message and str(folder) in message


def test_even_bins_in_bounds_load(folder: Path) -> None:
    for value in (256, 1002, 16384):
        text = yaml.safe_dump(RECIPE).replace("calibration:\n", f"calibration:\n  bins: {value}\n")
        assert load_recipe(_write_recipe(folder, text)).calibration.bins == value


@pytest.mark.parametrize(
    ("key", "where"),
    [
        ("calibration.batch_size", ("calibration", "batch_size")),
        ("calibration.max_samples", ("calibration", "max_samples")),
        ("calibration.data.samples", ("calibration", "data", "samples")),
        ("seed", ("seed",)),
    ],
)
def test_huge_integers_are_refused_for_every_integer_key(
    folder: Path, key: str, where: tuple[str, ...]
) -> None:
    recipe = copy.deepcopy(RECIPE)
    node = recipe
    for part in where[:-1]:
        node = node[part]
    node[where[-1]] = 2**40
    with pytest.raises(RecipeError, match=re.escape(f"{key}: must be <= ")) as info:
        load_recipe(_write_recipe(folder, yaml.safe_dump(recipe)))
    assert str(folder) in str(info.value)


def test_huge_input_dim_is_refused(folder: Path) -> None:
    recipe = copy.deepcopy(RECIPE)
    recipe["inputs"] = {"x": [1, 2**40]}
    with pytest.raises(RecipeError, match=re.escape("inputs.x[1]: must be <= ")):
        load_recipe(_write_recipe(folder, yaml.safe_dump(recipe)))


# --- 3. weights files ----------------------------------------------------------------------------

TINY_MODEL = """
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make():
    return Tiny()
"""


class _RunsAShellCommand:
    """A pickle payload that would run a command when unpickled without weights_only."""

    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > pwned.txt",))


def _torch_recipe(folder: Path, weights: Path) -> Path:
    (folder / "tiny.py").write_text(TINY_MODEL)
    recipe = {
        "model": {"pytorch": "tiny.py:make", "weights": weights.name},
        "inputs": {"x": [1, 4]},
        "calibration": {"data": {"synthetic": True, "samples": 8}, "method": "minmax"},
    }
    return _write_recipe(folder, yaml.safe_dump(recipe))


def _weights_error(cli, folder: Path, weights: Path) -> str:
    result = cli("calibrate", _torch_recipe(folder, weights), "-o", folder / "out", "--no-progress")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no torch warnings around the error
    line = lines[0]
    assert line.startswith("error:") and str(weights) in line
    assert "weights_only" not in line and "Traceback" not in result.output
    assert not (folder / "out").exists()
    return line


@pytest.mark.parametrize("protocol", [2, 4])
def test_malicious_pickle_is_refused_in_one_line(tmp_path: Path, cli, protocol: int) -> None:
    import pickle

    weights = tmp_path / "evil.pt"
    weights.write_bytes(pickle.dumps({"fc1.weight": _RunsAShellCommand()}, protocol=protocol))
    line = _weights_error(cli, tmp_path, weights)
    assert "refused" in line and "system" in line
    assert not (tmp_path / "pwned.txt").exists()


def test_torch_saved_malicious_object_is_refused(tmp_path: Path, cli) -> None:
    import torch

    weights = tmp_path / "evil.pt"
    torch.save({"fc1.weight": _RunsAShellCommand()}, weights)
    assert "refused" in _weights_error(cli, tmp_path, weights)
    assert not (tmp_path / "pwned.txt").exists()


@pytest.mark.parametrize("content", [b"", b"hello", bytes(range(256)) * 16])
def test_random_bytes_are_not_a_state_dict(tmp_path: Path, cli, content: bytes) -> None:
    weights = tmp_path / "random.pt"
    weights.write_bytes(content)
    assert "not a PyTorch state_dict file" in _weights_error(cli, tmp_path, weights)


def test_state_dict_of_another_architecture_names_the_keys(tmp_path: Path, cli) -> None:
    import torch
    from torch import nn

    other = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Linear(4, 2))
    weights = tmp_path / "other.pt"
    torch.save(other.state_dict(), weights)
    line = _weights_error(cli, tmp_path, weights)
    assert "Tiny" in line
    assert "4 missing keys (fc1.weight, fc1.bias, fc2.weight, fc2.bias)" in line
    assert "6 unexpected keys (0.weight, 0.bias, 2.weight, 2.bias, ... 2 more)" in line


def test_state_dict_with_other_shapes_names_the_tensors(tmp_path: Path, cli) -> None:
    import torch

    state = {
        "fc1.weight": torch.zeros(16, 4),
        "fc1.bias": torch.zeros(16),
        "fc2.weight": torch.zeros(2, 16),
        "fc2.bias": torch.zeros(2),
    }
    weights = tmp_path / "wide.pt"
    torch.save(state, weights)
    line = _weights_error(cli, tmp_path, weights)
    assert "3 tensors do not fit Tiny" in line
    assert "fc1.weight [16, 4] vs [8, 4]" in line and "fc2.weight [2, 16] vs [2, 8]" in line


def test_training_checkpoint_is_not_a_state_dict(tmp_path: Path, cli) -> None:
    import torch

    weights = tmp_path / "checkpoint.pt"
    torch.save({"epoch": 3, "model": {"fc1.weight": torch.zeros(8, 4)}}, weights)
    line = _weights_error(cli, tmp_path, weights)
    assert "2 entries are not tensors (epoch, model)" in line


def test_matching_state_dict_loads(tmp_path: Path) -> None:
    import torch

    from qtool.model.load import load_entry_point, load_weights

    (tmp_path / "tiny.py").write_text(TINY_MODEL)
    make = load_entry_point(f"{tmp_path / 'tiny.py'}:make", "model factory")
    source = make()
    weights = tmp_path / "tiny.pt"
    torch.save(source.state_dict(), weights)
    target = make()
    load_weights(target, weights)
    assert torch.equal(target.fc2.weight, source.fc2.weight)


# --- 4. IR versions newer than ONNX Runtime reads ------------------------------------------------


def _gemm_model(ir_version: int | None = None, extra_type: int | None = None):
    """A Gemm + Relu + Gemm model built with onnx.helper, which stamps onnx's own IR version."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((8, 2)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2"),
    ]
    if extra_type is not None:  # an unused initializer of a type only a newer IR has
        inits.append(helper.make_tensor("newer", extra_type, [2], [0.0, 1.0]))
    graph = helper.make_graph(
        nodes,
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if ir_version is not None:
        model.ir_version = ir_version
    return model


def _onnx_recipe(folder: Path, model) -> Path:
    import onnx

    onnx.save(model, folder / "model.onnx")
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, 4]},
        "calibration": {
            "data": {"synthetic": True, "samples": 16},
            "method": "minmax",
            "batch_size": 8,
        },
    }
    return _write_recipe(folder, yaml.safe_dump(recipe))


def test_ir_version_newer_than_ort_is_written_as_one_ort_loads(tmp_path: Path, cli) -> None:
    import onnx
    import onnxruntime

    from qtool.ort.sessions import max_ir_version

    newest = max_ir_version()
    model = _gemm_model(ir_version=newest + 1)  # what a newer onnx than this ORT's would write
    recipe = _onnx_recipe(tmp_path, model)
    out = tmp_path / "out"
    with pytest.raises(Exception, match="IR version"):  # the premise: ORT refuses it as it is
        onnxruntime.InferenceSession(
            str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"]
        )
    result = cli("quantize", recipe, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    for name in ("model.int8.onnx", "model.fp32.onnx"):
        written = onnx.load(str(out / name))
        assert written.ir_version == newest
        onnxruntime.InferenceSession(str(out / name), providers=["CPUExecutionProvider"])


def test_max_ir_version_is_what_ort_loads() -> None:
    import onnxruntime

    from qtool.ort.sessions import max_ir_version

    newest = max_ir_version()
    for version, loads in ((newest, True), (newest + 1, False)):
        model = _gemm_model(ir_version=version)
        if loads:
            onnxruntime.InferenceSession(model.SerializeToString())
        else:
            with pytest.raises(Exception, match="IR version"):
                onnxruntime.InferenceSession(model.SerializeToString())


def test_model_needing_a_newer_ir_than_ort_reads_names_the_file(tmp_path: Path, cli) -> None:
    from onnx import TensorProto

    from qtool.model.load import required_ir_version
    from qtool.ort.sessions import max_ir_version

    model = _gemm_model(extra_type=TensorProto.FLOAT6E2M3)
    required, reason = required_ir_version(model)
    assert (required, reason) == (14, "element type FLOAT6E2M3")
    if required <= max_ir_version():
        pytest.skip("the installed onnxruntime reads IR 14: no model here is too new for it")
    recipe = _onnx_recipe(tmp_path, model)
    result = cli("calibrate", recipe, "-o", tmp_path / "out", "--no-progress")
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert str(tmp_path / "model.onnx") in line and "IR version 14" in line
    assert "FLOAT6E2M3" in line and "onnxruntime" in line


def test_session_on_a_too_new_file_names_the_file(tmp_path: Path) -> None:
    import onnx

    from qtool.errors import ModelError
    from qtool.ort.sessions import create_session, max_ir_version

    path = tmp_path / "new.onnx"
    onnx.save(_gemm_model(ir_version=max_ir_version() + 1), path)
    with pytest.raises(ModelError, match="IR version") as info:
        create_session(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


# --- 5. disk full: outputs committed together; stale temporaries cleaned -------------------------


def _fail_on_call(monkeypatch, target, name: str, failing_call: int) -> list[int]:
    """Make `target.name` raise ENOSPC on its `failing_call`-th call (1-based)."""
    import errno

    real = getattr(target, name)
    calls = [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] == failing_call:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, patched)
    return calls


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob(".*.tmp")) if folder.exists() else []


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_commit_files_writes_all_or_nothing(tmp_path: Path, monkeypatch, where: str) -> None:
    import os

    from qtool.errors import OutputError
    from qtool.io import commit_files

    out = tmp_path / "out"
    out.mkdir()
    (out / "b.bin").write_bytes(b"previous b")  # an earlier run's output, to be kept intact
    files = {out / "a.bin": b"new a", out / "b.bin": b"new b", out / "c.bin": b"new c"}
    calls = _fail_on_call(monkeypatch, os, where, failing_call=2)
    with pytest.raises(OutputError, match="No space left on device") as info:
        commit_files(files)
    assert calls[0] >= 2
    assert "none of this run's 3 outputs were written" in str(info.value)
    assert str(out / "b.bin") in str(info.value)
    assert sorted(p.name for p in out.iterdir()) == ["b.bin"]
    assert (out / "b.bin").read_bytes() == b"previous b"
    monkeypatch.undo()
    commit_files(files)
    assert {p: p.read_bytes() for p in files} == files
    assert _temporaries(out) == []


def test_commit_files_rolls_back_without_hard_links(tmp_path: Path, monkeypatch) -> None:
    import os

    from qtool.errors import OutputError
    from qtool.io import commit_files

    (tmp_path / "a.bin").write_bytes(b"old a")
    (tmp_path / "b.bin").write_bytes(b"old b")

    def no_links(*_args, **_kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    real_replace = os.replace
    renamed: list[bytes] = []

    def replace(src, dst):
        """Moving aside and renaming a.bin succeed; the first rename into b.bin fails."""
        if Path(src).name.startswith(".b.bin") and Path(dst).name == "b.bin" and not renamed:
            renamed.append((Path(dst).parent / "a.bin").read_bytes())
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OutputError):
        commit_files({tmp_path / "a.bin": b"new a", tmp_path / "b.bin": b"new b"})
    assert renamed == [b"new a"]  # b.bin failed after a.bin was replaced; a.bin is restored
    assert (tmp_path / "a.bin").read_bytes() == b"old a"
    assert (tmp_path / "b.bin").read_bytes() == b"old b"
    assert _temporaries(tmp_path) == []


# The float model is staged before calibration (so its bytes are not held while ORT runs), the
# stats file after it: the first fsync is the float model's, the second the stats file's.
@pytest.mark.parametrize(("failing_call", "victim"), [(1, "model.fp32.onnx"), (2, "stats.npz")])
def test_calibrate_on_a_full_disk_leaves_no_outputs(
    tmp_path: Path, monkeypatch, cli, failing_call: int, victim: str
) -> None:
    import os

    recipe = _onnx_recipe(tmp_path, _gemm_model(ir_version=8))
    out = tmp_path / "out"
    _fail_on_call(monkeypatch, os, "fsync", failing_call=failing_call)
    result = cli("calibrate", recipe, "-o", out, "--no-progress")
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "No space left on device" in line and str(out / victim) in line
    assert list(out.iterdir()) == []


def test_quantize_on_a_full_disk_keeps_the_previous_outputs(
    tmp_path: Path, monkeypatch, cli
) -> None:
    import os

    recipe = _onnx_recipe(tmp_path, _gemm_model(ir_version=8))
    out = tmp_path / "out"
    assert cli("calibrate", recipe, "-o", out, "--no-progress").exit_code == 0
    stats = out / "stats.npz"
    first = cli("quantize", recipe, "--stats", stats, "-o", out, "--no-progress")
    assert first.exit_code == 0, first.output
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["model.fp32.onnx", "model.int8.onnx", "report.json", "stats.npz"]
    _fail_on_call(monkeypatch, os, "replace", failing_call=3)  # the report's rename
    result = cli("quantize", recipe, "--stats", stats, "-o", out, "--no-progress")
    assert result.exit_code == 2, result.output
    assert "none of this run's 3 outputs were written" in result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_stale_temporaries_of_killed_runs_are_removed(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from qtool.io import STALE_AFTER_S, atomic_write_bytes

    # A pid that is certainly dead: a child that has exited and been reaped.
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = int(child.stdout)
    alive = os.getppid()
    dead_tmp = tmp_path / f".model.int8.onnx.qtool{dead}.abcd1234.tmp"
    old_tmp = tmp_path / f".stats.npz.qtool{alive}.zz9_0000.tmp"
    fresh_tmp = tmp_path / f".report.json.qtool{alive}.k2x9a8b1.tmp"  # a concurrent writer's
    other = [tmp_path / ".model.int8.onnx.abcd1234.tmp", tmp_path / "notes.tmp"]  # not qtool's
    for path in (dead_tmp, old_tmp, fresh_tmp, *other):
        path.write_bytes(b"partial")
    hour_ago = time.time() - STALE_AFTER_S - 60
    os.utime(old_tmp, (hour_ago, hour_ago))
    atomic_write_bytes(tmp_path / "report.json", b"{}\n")
    assert not dead_tmp.exists() and not old_tmp.exists()
    assert fresh_tmp.exists() and all(p.exists() for p in other)
    assert (tmp_path / "report.json").read_bytes() == b"{}\n"


# --- 6. tampered stats files ---------------------------------------------------------------------


def _real_stats_file(path: Path, bins: int = 256) -> None:
    """A stats file as calibration writes it: observers fed real (random) activations."""
    import numpy as np

    from qtool.calibration.observers import HistogramObserver
    from qtool.calibration.stats_file import save_stats

    rng = np.random.default_rng(0)
    stats = []
    for name in ("conv1_out", "relu_out"):
        observer = HistogramObserver(name, bins * 2)
        for _ in range(3):
            observer.update(rng.standard_normal((4, 16)).astype(np.float32) * 3)
        stats.append(observer.result())
    save_stats(path, stats, "f" * 64, bins, "d" * 64)


def _rewrite(path: Path, index_edit=None, counts_edit=None) -> None:
    """Rewrite a stats zip with its index (a dict) and/or second tensor's counts changed."""
    import io
    import json
    import zipfile

    import numpy as np

    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    index = json.loads(members["index.json"])
    if index_edit is not None:
        index_edit(index)
    members["index.json"] = json.dumps(index).encode()
    if counts_edit is not None:
        member = index["tensors"][1]["counts"]
        buffer = io.BytesIO()
        np.save(buffer, counts_edit(np.load(io.BytesIO(members[member]))))
        members[member] = buffer.getvalue()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def _set(key: str, value):
    def edit(index: dict) -> None:
        index["tensors"][1][key] = value

    return edit


@pytest.mark.parametrize(
    ("index_edit", "counts_edit", "words"),
    [
        (None, lambda c: c[:-2], "histogram has shape [510], but the file's bins (256) make 512"),
        (None, lambda c: c.reshape(2, -1), "histogram has shape [2, 256]"),
        (None, lambda c: c.astype("float64"), "non-negative integers, got dtype float64"),
        (None, lambda c: c - 1, "non-negative integers"),
        (_set("min", float("nan")), None, "min is nan"),
        (_set("max", float("inf")), None, "max is inf"),
        (_set("half_range", float("-inf")), None, "half_range is -inf"),
        (_set("half_range", 0.5), None, "half-range 0.5 does not cover"),
        (_set("min", 1e9), None, "is above max"),
        (_set("min", "low"), None, "min must be a number, got 'low'"),
        (_set("samples", 0), None, "samples must be a positive integer"),
    ],
)
def test_tampered_stats_file_is_refused_naming_file_and_tensor(
    tmp_path: Path, index_edit, counts_edit, words: str
) -> None:
    from qtool.calibration.stats_file import load_stats
    from qtool.errors import CalibrationError

    path = tmp_path / "stats.npz"
    _real_stats_file(path)
    load_stats(path)  # the untouched file loads
    _rewrite(path, index_edit, counts_edit)
    with pytest.raises(CalibrationError) as info:
        load_stats(path)
    message = str(info.value)
    assert message.startswith(f"{path}: tensor 'relu_out': ") and words in message, message


def test_stats_file_index_bins_must_match_what_observers_make(tmp_path: Path) -> None:
    from qtool.calibration.stats_file import load_stats
    from qtool.errors import CalibrationError

    path = tmp_path / "stats.npz"
    _real_stats_file(path)

    def double_bins(index: dict) -> None:
        index["bins"] = 512

    _rewrite(path, double_bins)
    with pytest.raises(CalibrationError, match=r"tensor 'conv1_out': histogram has shape \[512\]"):
        load_stats(path)
    _rewrite(path, lambda index: index.update(bins=None))
    with pytest.raises(CalibrationError, match="bins must be an even integer, got None"):
        load_stats(path)


def test_tampered_stats_through_quantize_exit_2(tmp_path: Path, cli) -> None:
    recipe = _onnx_recipe(tmp_path, _gemm_model(ir_version=8))
    out = tmp_path / "out"
    assert cli("calibrate", recipe, "-o", out, "--no-progress").exit_code == 0
    stats = out / "stats.npz"
    _rewrite(stats, _set("max", float("nan")))
    result = cli("quantize", recipe, "--stats", stats, "-o", out, "--no-progress")
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert str(stats) in line and "max is nan" in line
    assert not (out / "model.int8.onnx").exists()


# --- 7. help and doctor --------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["calibrate"], ["quantize"], ["evaluate"], ["doctor"]])
def test_help_shows_no_type_for_flags(cli, command: list[str]) -> None:
    result = cli(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "--help" in result.stdout and "<bool>" not in result.stdout
    if command:
        assert "--progress" in result.stdout or command == ["doctor"]
    if command == ["quantize"]:
        assert "<path>" in result.stdout  # options that take a value keep their type


_SESSION_ON = """
import sys
import onnxruntime
session = onnxruntime.InferenceSession(sys.stdin.buffer.read(), providers=[sys.argv[1]])
print(session.get_providers()[0])
"""


def _provider_used(provider: str) -> bool:
    """Independently of qtool: does a session asked for `provider` really run on it? (In a child
    process: a GPU provider without its libraries may abort the process.)"""
    import subprocess
    import sys

    model = _gemm_model(ir_version=8).SerializeToString()
    child = subprocess.run(
        [sys.executable, "-c", _SESSION_ON, provider], input=model, capture_output=True
    )
    return child.returncode == 0 and child.stdout.decode().split() == [provider]


def test_doctor_says_which_providers_can_run(cli) -> None:
    import onnxruntime

    result = cli("doctor")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    (running_line,) = [line for line in lines if line.startswith("ORT providers that run here:")]
    running = running_line.split(":", 1)[1].strip().split(", ")
    assert "CPUExecutionProvider" in running
    for provider in onnxruntime.get_available_providers():
        if provider in running:
            assert provider == "CPUExecutionProvider" or _provider_used(provider), provider
        else:
            (line,) = [line for line in lines if line.startswith(f"ORT provider {provider}:")]
            assert "cannot run here (" in line
            assert not _provider_used(provider), provider


def test_provider_probe_reports_errors_and_crashes(monkeypatch) -> None:
    import onnxruntime

    from qtool.ort import sessions as ort_session

    real = onnxruntime.get_available_providers
    monkeypatch.setattr(
        onnxruntime, "get_available_providers", lambda: [*real(), "BogusExecutionProvider"]
    )
    status = ort_session.provider_status()
    assert status["CPUExecutionProvider"] == "runs"
    assert status["BogusExecutionProvider"].startswith("cannot run here (")
    monkeypatch.setattr(ort_session, "_PROBE_SCRIPT", "import os; os.abort()")
    status = ort_session.provider_status()
    assert status["BogusExecutionProvider"].startswith("cannot run here (loading it crashed")


# --- 8. phases shown while work happens ----------------------------------------------------------

PHASES = [
    "exporting PyTorch model",
    "preparing graph",
    "calibrating: loading the model into ONNX Runtime",
    "verifying what ONNX Runtime runs",
]


def _tiny_torch_recipe(folder: Path) -> Path:
    import torch

    from qtool.model.load import load_entry_point

    (folder / "tiny.py").write_text(TINY_MODEL)
    make = load_entry_point(f"{folder / 'tiny.py'}:make", "model factory")
    torch.manual_seed(0)
    weights = folder / "tiny.pt"
    torch.save(make().state_dict(), weights)
    return _torch_recipe(folder, weights)


class _Recorder:
    """A phase listener that records ("start", name) and ("end", name, ok)."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def started(self, name: str) -> None:
        self.seen.append(("start", name))

    def ended(self, name: str, ok: bool) -> None:
        self.seen.append(("end", name, ok))


def test_pipeline_reports_each_phase_in_order(tmp_path: Path) -> None:
    from qtool.app.quantize import quantize
    from qtool.phases import listening

    recipe = load_recipe(_tiny_torch_recipe(tmp_path), tmp_path / "out")
    recorder = _Recorder()
    with listening(recorder):
        quantize(recipe, progress=False)
    assert recorder.seen == [e for n in PHASES for e in (("start", n), ("end", n, True))]
    assert (tmp_path / "out" / "model.int8.onnx").is_file()


def test_phases_are_silent_without_a_listener(tmp_path: Path, capsys) -> None:
    from qtool.model.load import export_pytorch

    recipe = load_recipe(_tiny_torch_recipe(tmp_path))
    export_pytorch(recipe.model, recipe.inputs)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_cli_shows_the_phases_on_a_terminal(tmp_path: Path, cli, monkeypatch) -> None:
    import io

    from rich.console import Console

    from qtool import progress

    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=100)
    monkeypatch.setattr(progress, "console", lambda: terminal)
    recipe = _tiny_torch_recipe(tmp_path)
    result = cli("quantize", recipe, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    drawn = screen.getvalue()
    positions = [drawn.find(f"{name}...") for name in PHASES]
    assert -1 not in positions and positions == sorted(positions), positions
    bar = drawn.find("samples", positions[2])  # the calibration bar: after its phase ends
    assert positions[2] < bar < positions[3]

    screen.truncate(0)
    screen.seek(0)
    quiet = cli("quantize", recipe, "-o", tmp_path / "out2", "--no-progress")
    assert quiet.exit_code == 0 and screen.getvalue() == ""
