"""A large model whose weights are in the user's data files: read lazily from there, its float
copy hashed at once but written only when a stage opens it or the recipe keeps it.

`STAGE_WEIGHTS_THRESHOLD` is lowered to LIMIT so a ~340 KB model stored with external data
(tests/test_external_data.py's `mlp`) takes the path of a 256 MB+ one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from test_external_data import LIMIT, assert_no_temporaries, mlp, save_external, write_case

from qtool.errors import ModelError
from qtool.model import external_data
from qtool.model.load import load_onnx
from qtool.pipeline import finish, float_model


@pytest.fixture
def large(monkeypatch):
    monkeypatch.setattr(external_data, "STAGE_WEIGHTS_THRESHOLD", LIMIT)


@pytest.fixture
def writes(monkeypatch) -> list[Path]:
    """The paths of the deferred float stages that were written."""
    written: list[Path] = []
    real = external_data.StagedModel._written

    def spy(self):
        if not self.written:
            written.append(self.path)
        return real(self)

    monkeypatch.setattr(external_data.StagedModel, "_written", spy)
    return written


def test_large_external_weights_stay_in_the_users_data_file(large, tmp_path):
    source = save_external(mlp(), tmp_path / "source.onnx")
    model = load_onnx(source)
    data = (tmp_path / "source.onnx.data").resolve()
    large = [t for t in model.graph.initializer if external_data.raw_nbytes(t) >= 1024]
    assert large and all(external_data.lazy_file(t)[0] == data for t in large)
    assert not any(t.HasField("raw_data") for t in large)
    np.testing.assert_array_equal(
        external_data.tensor_array(model.graph.initializer[0]),
        onnx.numpy_helper.to_array(mlp().graph.initializer[0]),
    )


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("outside", "is not a file in the model's folder"),
        ("short", "ends before offset"),
    ],
)
def test_a_bad_external_reference_is_named(large, tmp_path, damage, message):
    (tmp_path / "model").mkdir()
    source = save_external(mlp(), tmp_path / "model" / "source.onnx")
    if damage == "outside":  # a file that exists, beside the model's folder
        (tmp_path / "model" / "source.onnx.data").rename(tmp_path / "elsewhere.data")
        model = onnx.load(source, load_external_data=False)
        for tensor in model.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = "../elsewhere.data"
        onnx.save(model, source)
    else:
        data = tmp_path / "model" / "source.onnx.data"
        data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ModelError, match=message) as error:
        load_onnx(source)
    assert str(source) in str(error.value) and "\n" not in str(error.value)


def _quantize(cli, folder: Path, bits: int) -> dict[str, bytes]:
    folder.mkdir()
    recipe, _ = write_case(folder, mlp(), float_model="auto")
    if bits == 4:
        spec = yaml.safe_load(recipe.read_text())
        spec["quantization"] = {"weights": {"bits": 4, "block_size": 32}}
        recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = cli("quantize", recipe, "--no-progress")
    assert result.exit_code == 0, result.stderr
    out = folder / "out"
    assert_no_temporaries(out)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "report.json"}


@pytest.mark.parametrize("bits", [4, 8])
def test_the_float_copy_is_written_only_when_a_stage_opens_it(
    bits, large, writes, cli, tmp_path, monkeypatch
):
    """Over protobuf's limit the float copy is not kept (`output.float_model: auto`). 4-bit
    round to nearest opens no float session, so it is never written; static int8 calibrates,
    so it is written then. Either way the model is the one an eager stage writes."""
    monkeypatch.setattr(external_data, "EXTERNAL_DATA_THRESHOLD", LIMIT)
    monkeypatch.setattr(finish, "SPEED_CHECK_MAX_BYTES", LIMIT)  # not timed, as a large one
    deferred = _quantize(cli, tmp_path / "deferred", bits)
    assert len(writes) == (0 if bits == 4 else 1)
    assert "model.fp32.onnx.data" not in deferred
    monkeypatch.setattr(float_model, "DEFER_HELD_BYTES", 0)  # staged when frozen, as before
    eager = _quantize(cli, tmp_path / "eager", bits)
    assert deferred == eager


def test_a_float_copy_kept_is_written_at_the_commit(large, writes, cli, tmp_path):
    """Under the limit `auto` keeps the float copy: a deferred stage is written to be committed,
    the same files an eager one commits."""
    files = _quantize(cli, tmp_path / "kept", 4)
    assert len(writes) == 1
    model = onnx.load(tmp_path / "kept" / "out" / "model.fp32.onnx")
    source = onnx.load(tmp_path / "kept" / "source.onnx")
    assert [t.name for t in model.graph.initializer] == [t.name for t in source.graph.initializer]
    assert "model.fp32.onnx.data" in files


def test_a_data_file_changed_before_the_write_is_an_error(large, tmp_path):
    source = save_external(mlp(), tmp_path / "source.onnx")
    model = load_onnx(source)
    staged = external_data.stage_model(model, tmp_path / "out" / "model.fp32.onnx", defer=True)
    data = tmp_path / "source.onnx.data"
    content = bytearray(data.read_bytes())
    content[10] ^= 0xFF
    data.write_bytes(bytes(content))
    with pytest.raises(ModelError, match="changed on disk while qtool ran"):
        _ = staged.session_path
    assert not [p for p in (tmp_path / "out").iterdir() if ".qtool" in p.name]
