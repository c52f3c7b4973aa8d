"""Data sources: re-batching, caps, labels, validation, and each source kind on small files."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from qtool.data.batches import iter_batches
from qtool.data.spec import DataSpec, ImageFolder, InputSpec
from qtool.errors import DataError

VEC = (InputSpec("x", (1, 3)),)


def python_source(tmp_path: Path, body: str, name: str = "source") -> DataSpec:
    """A python entry-point source from a function body, as the recipe reader resolves it."""
    path = tmp_path / f"{name}.py"
    path.write_text("import numpy as np\n\n\ndef batches():\n" + textwrap.indent(body, "    "))
    return DataSpec("calibration.data", python=f"{path}:batches")


CHUNKED = """
start = 0
for size in (7, 50, 3):
    ids = np.arange(start, start + size)
    x = np.stack([ids, -ids, 2 * ids], axis=1).astype(np.float32)
    yield {"x": x}, ids
    start += size
"""


def expected_x(ids: np.ndarray) -> np.ndarray:
    return np.stack([ids, -ids, 2 * ids], axis=1).astype(np.float32)


def test_rebatching_keeps_every_sample_in_order_with_its_label(tmp_path: Path) -> None:
    batches = list(iter_batches(python_source(tmp_path, CHUNKED), VEC, batch_size=16))
    assert [len(b) for b in batches] == [16, 16, 16, 12]
    ids = np.concatenate([b.labels for b in batches])
    np.testing.assert_array_equal(ids, np.arange(60))
    x = np.concatenate([b.inputs["x"] for b in batches])
    np.testing.assert_array_equal(x, expected_x(np.arange(60)))
    for batch in batches:  # labels stay aligned with their sample inside every batch
        np.testing.assert_array_equal(batch.inputs["x"], expected_x(batch.labels))
        assert batch.inputs["x"].dtype == np.float32


@pytest.mark.parametrize("max_samples", [1, 7, 16, 37, 60, 1000])
def test_max_samples_caps_exactly(tmp_path: Path, max_samples: int) -> None:
    spec = python_source(tmp_path, CHUNKED)
    batches = list(iter_batches(spec, VEC, batch_size=16, max_samples=max_samples))
    ids = np.concatenate([b.labels for b in batches])
    np.testing.assert_array_equal(ids, np.arange(min(max_samples, 60)))
    assert all(len(b) == 16 for b in batches[:-1])


def test_npy_source_streams_the_files_in_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((600, 1, 3)).astype(np.float32)  # more than one internal chunk
    labels = rng.integers(0, 10, 600)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "labels.npy", labels)
    spec = DataSpec(
        "calibration.data", npy={"x": tmp_path / "x.npy"}, labels=tmp_path / "labels.npy"
    )
    batches = list(iter_batches(spec, (InputSpec("x", (1, 1, 3)),), batch_size=100))
    assert [len(b) for b in batches] == [100] * 6
    np.testing.assert_array_equal(np.concatenate([b.inputs["x"] for b in batches]), x)
    np.testing.assert_array_equal(np.concatenate([b.labels for b in batches]), labels)


def test_npz_source_converts_float_dtype_and_keeps_labels(tmp_path: Path) -> None:
    x = np.arange(30, dtype=np.float64).reshape(10, 3)
    np.savez(tmp_path / "d.npz", x=x, labels=np.arange(10))
    spec = DataSpec("evaluation.data", npz=tmp_path / "d.npz")
    batches = list(iter_batches(spec, VEC, batch_size=4))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert all(b.inputs["x"].dtype == np.float32 for b in batches)
    np.testing.assert_array_equal(np.concatenate([b.inputs["x"] for b in batches]), x)
    np.testing.assert_array_equal(np.concatenate([b.labels for b in batches]), np.arange(10))


def test_compressed_npz_streams_in_order_across_chunks(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((150, 2, 3)).astype(np.float32)
    labels = rng.integers(0, 5, 150)
    np.savez_compressed(tmp_path / "d.npz", labels=labels, x=x, unused=np.zeros(3))
    spec = DataSpec("calibration.data", npz=tmp_path / "d.npz")
    batches = list(iter_batches(spec, (InputSpec("x", (1, 2, 3)),), batch_size=40))
    assert [len(b) for b in batches] == [40, 40, 40, 30]
    np.testing.assert_array_equal(np.concatenate([b.inputs["x"] for b in batches]), x)
    np.testing.assert_array_equal(np.concatenate([b.labels for b in batches]), labels)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed], ids=["stored", "deflated"])
def test_npz_members_read_the_same_stored_or_compressed(tmp_path: Path, save) -> None:
    """Stored members are read straight into the batch arrays (their own read path): the
    values, the order across members and chunks, and writability (torch.from_numpy in QAT
    warns on read-only arrays) must match the compressed path."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((150, 2, 3)).astype(np.float32)
    ids = rng.integers(0, 1000, (150, 4))
    labels = rng.integers(0, 5, 150)
    save(tmp_path / "d.npz", ids=ids, labels=labels, x=x)
    spec = DataSpec("calibration.data", npz=tmp_path / "d.npz")
    inputs = (InputSpec("x", (1, 2, 3)), InputSpec("ids", (1, 4), "int64"))
    batches = list(iter_batches(spec, inputs, batch_size=40))
    np.testing.assert_array_equal(np.concatenate([b.inputs["x"] for b in batches]), x)
    np.testing.assert_array_equal(np.concatenate([b.inputs["ids"] for b in batches]), ids)
    np.testing.assert_array_equal(np.concatenate([b.labels for b in batches]), labels)
    assert all(b.inputs["x"].flags.writeable for b in batches)


@pytest.mark.parametrize("compression", ["stored", "deflated"])
def test_npz_member_shorter_than_its_header_names_the_file(tmp_path: Path, compression) -> None:
    """A member whose .npy header promises more rows than it holds (a truncated write)."""
    import io
    import zipfile

    full = io.BytesIO()
    np.save(full, np.ones((100, 3), np.float32))
    short = full.getvalue()[: -50 * 3 * 4]  # the header for 100 rows, the data of 50
    kind = zipfile.ZIP_STORED if compression == "stored" else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(tmp_path / "d.npz", "w", kind) as archive:
        archive.writestr("x.npy", short)
    spec = DataSpec("calibration.data", npz=tmp_path / "d.npz")
    with pytest.raises(DataError, match=r"d\.npz: ends inside an array"):
        list(iter_batches(spec, VEC, batch_size=10))


def test_npz_arrays_of_different_lengths_are_an_error(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.zeros((10, 3), np.float32), labels=np.arange(9))
    spec = DataSpec("calibration.data", npz=tmp_path / "d.npz")
    with pytest.raises(DataError, match=r"d\.npz.*different sample counts"):
        list(iter_batches(spec, VEC, batch_size=4))


def test_unreadable_npz_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "d.npz").write_bytes(b"not a zip archive at all")
    spec = DataSpec("calibration.data", npz=tmp_path / "d.npz")
    with pytest.raises(DataError, match=r"d\.npz"):
        list(iter_batches(spec, VEC, batch_size=4))


def test_labels_on_some_chunks_only_is_an_error(tmp_path: Path) -> None:
    body = 'yield {"x": np.zeros((3, 3), np.float32)}, np.arange(3)\n'
    body += 'yield {"x": np.zeros((3, 3), np.float32)}\n'
    with pytest.raises(DataError, match=r"calibration\.data: .*labels"):
        list(iter_batches(python_source(tmp_path, body), VEC, batch_size=4))


def test_synthetic_is_seeded_and_sized() -> None:
    inputs = (InputSpec("x", (1, 2, 5)), InputSpec("ids", (1, 4), "int64"))
    spec = DataSpec("calibration.data", synthetic=True, samples=70)

    def collect(seed: int) -> dict[str, np.ndarray]:
        batches = list(iter_batches(spec, inputs, batch_size=32, seed=seed))
        assert [len(b) for b in batches] == [32, 32, 6]
        assert all(b.labels is None for b in batches)
        return {n: np.concatenate([b.inputs[n] for b in batches]) for n in ("x", "ids")}

    first, again, other = collect(5), collect(5), collect(6)
    assert first["x"].shape == (70, 2, 5) and first["x"].dtype == np.float32
    assert first["ids"].shape == (70, 4) and first["ids"].dtype == np.int64
    for name in ("x", "ids"):
        np.testing.assert_array_equal(first[name], again[name])
    assert not np.array_equal(first["x"], other["x"])
    assert first["x"].std() > 0.5  # random values, not a constant fill


def test_chunk_with_wrong_sample_shape_names_the_input(tmp_path: Path) -> None:
    body = 'yield {"x": np.zeros((4, 3), np.float32)}\nyield {"x": np.zeros((4, 5), np.float32)}\n'
    spec = python_source(tmp_path, body)
    with pytest.raises(DataError, match=r"calibration\.data.*'x'.*\[5\].*\[3\]"):
        list(iter_batches(spec, VEC, batch_size=2))


def test_nan_names_the_input_and_the_sample(tmp_path: Path) -> None:
    x = np.zeros((10, 3), np.float32)
    x[6, 1] = np.nan
    np.savez(tmp_path / "d.npz", x=x)
    spec = DataSpec("calibration.data", npz=tmp_path / "d.npz")
    with pytest.raises(DataError, match=r"'x'.*sample 6"):
        list(iter_batches(spec, VEC, batch_size=4))


def test_missing_and_unexpected_inputs_are_named(tmp_path: Path) -> None:
    spec = python_source(tmp_path, 'yield {"y": np.zeros((2, 3), np.float32)}\n')
    with pytest.raises(DataError, match=r"missing x.*unexpected y"):
        list(iter_batches(spec, VEC, batch_size=2))


def test_raising_entry_point_is_a_data_error(tmp_path: Path) -> None:
    body = 'yield {"x": np.zeros((2, 3), np.float32)}\nraise RuntimeError("disk on fire")\n'
    spec = python_source(tmp_path, body)
    with pytest.raises(DataError, match=r"source\.py:batches: raised RuntimeError: disk on fire"):
        list(iter_batches(spec, VEC, batch_size=4))


def test_empty_source_is_an_error(tmp_path: Path) -> None:
    spec = python_source(tmp_path, "return iter(())\n")
    with pytest.raises(DataError, match="no samples"):
        list(iter_batches(spec, VEC, batch_size=4))


def test_image_folder_reads_classes_and_normalises(tmp_path: Path) -> None:
    image_module = pytest.importorskip("PIL.Image")
    colours = {"cat": [(255, 0, 0), (0, 255, 0)], "dog": [(10, 20, 30)], "emu": [(0, 0, 255)]}
    for label, fills in colours.items():
        (tmp_path / label).mkdir()
        for k, fill in enumerate(fills):
            # 7x5 source images resized to 4x6: uniform images stay uniform under resampling
            image_module.new("RGB", (5, 7), fill).save(tmp_path / label / f"{k}.png")
    mean, std = (0.5, 0.25, 0.0), (0.5, 0.25, 2.0)
    folder = ImageFolder(tmp_path, "pixels", size=(4, 6), mode="RGB", mean=mean, std=std)
    spec = DataSpec("calibration.data", images=folder)
    inputs = (InputSpec("pixels", (1, 3, 4, 6)),)
    batches = list(iter_batches(spec, inputs, batch_size=3))
    assert [len(b) for b in batches] == [3, 1]
    pixels = np.concatenate([b.inputs["pixels"] for b in batches])
    labels = np.concatenate([b.labels for b in batches])
    assert pixels.shape == (4, 3, 4, 6) and pixels.dtype == np.float32
    fills = [fill for label in sorted(colours) for fill in colours[label]]
    expected_labels = [i for i, label in enumerate(sorted(colours)) for _ in colours[label]]
    np.testing.assert_array_equal(labels, expected_labels)
    for sample, fill in zip(pixels, fills, strict=True):
        want = (np.asarray(fill, np.float32) / 255.0 - np.asarray(mean)) / np.asarray(std)
        np.testing.assert_allclose(
            sample, np.broadcast_to(want[:, None, None], (3, 4, 6)), atol=1e-6
        )


def test_grayscale_image_folder_without_classes_has_no_labels(tmp_path: Path) -> None:
    image_module = pytest.importorskip("PIL.Image")
    image_module.new("L", (8, 8), 51).save(tmp_path / "a.png")
    folder = ImageFolder(tmp_path, "img", size=(8, 8), mode="L", mean=(0.0,), std=(1.0,))
    (batch,) = iter_batches(DataSpec("d", images=folder), (InputSpec("img", (1, 1, 8, 8)),), 4)
    assert batch.labels is None
    np.testing.assert_allclose(batch.inputs["img"], np.full((1, 1, 8, 8), 0.2), atol=1e-6)
