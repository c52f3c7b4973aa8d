"""Hostile stats, Hessian, channel and data archives (issue 21, item 2).

Each forged file is refused before its members are read: within 2 seconds, in one line naming
the file and the member, exit 2 through the CLI. The forgeries are built cheaply: a .npy header
that claims 10**12 elements over a few KiB, and a 2 GiB zip bomb (a deflate stream of zeros)
assembled from one 1 MiB block repeated, with its CRC computed arithmetically, so that each test
takes milliseconds and a few MB of memory however large the file claims to be.
"""

from __future__ import annotations

import io
import struct
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from qtool.errors import CalibrationError, DataError

GIB = 1 << 30
# CPU seconds (time.process_time), not wall time: the suite may share its cores with other work,
# and a zip bomb's cost is CPU (inflating) and memory, not waiting.
LIMIT_S = 2.0

# --- building forged archives -------------------------------------------------------------------


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """zlib's crc32_combine: the CRC-32 of A + B from crc(A), crc(B) and len(B), in O(log len)."""
    if length2 == 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]
    even = _gf2_square(odd)
    odd = _gf2_square(even)
    while True:
        even = _gf2_square(odd)
        if length2 & 1:
            crc1 = _gf2_times(even, crc1)
        length2 >>= 1
        if not length2:
            break
        odd = _gf2_square(even)
        if length2 & 1:
            crc1 = _gf2_times(odd, crc1)
        length2 >>= 1
        if not length2:
            break
    return crc1 ^ crc2


def test_crc32_combine_is_zlibs() -> None:
    a, b = b"qtool stats " * 50, bytes(70_001)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


_BLOCK = 1 << 20


def deflated_zeros(prefix: bytes, zeros: int) -> tuple[bytes, int, int]:
    """A raw deflate stream of `prefix` then `zeros` zero bytes (a multiple of 1 MiB), with its
    CRC-32 and inflated size, built in ~1 ms: after a full flush deflate starts afresh on a byte
    boundary, so every 1 MiB block of zeros compresses to the same ~1 KiB, repeated."""
    assert zeros % _BLOCK == 0
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = compressor.compress(prefix) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(bytes(_BLOCK)) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(bytes(_BLOCK)) + compressor.flush(zlib.Z_FULL_FLUSH)
    assert again == block  # the premise of the repetition
    tail = compressor.flush()
    crc_zeros = zlib.crc32(bytes(_BLOCK))
    length = _BLOCK
    while length < zeros:  # CRC of 2**k blocks of zeros by doubling
        crc_zeros = crc32_combine(crc_zeros, crc_zeros, length)
        length *= 2
    assert length == zeros, "zeros must be a power of two times 1 MiB"
    crc = crc32_combine(zlib.crc32(prefix), crc_zeros, zeros)
    return head + block * (zeros // _BLOCK - 1) + again + tail, crc, len(prefix) + zeros


def write_zip(path: Path, members: dict[str, bytes], raw: dict[str, tuple[bytes, int, int]]):
    """A zip of `members` (stored) and `raw` members given as (deflate stream, CRC, size): the
    central directory says what the caller says, whatever the stream holds."""
    entries = [(n, 0, d, zlib.crc32(d), len(d)) for n, d in members.items()]
    entries += [(n, 8, stream, crc, size) for n, (stream, crc, size) in raw.items()]
    local, central = io.BytesIO(), io.BytesIO()
    for name, method, data, crc, size in entries:
        offset = local.tell()
        encoded = name.encode()
        header = struct.pack(
            "<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0x21, crc, len(data), size,
            len(encoded), 0,
        )  # fmt: skip
        local.write(header + encoded + data)
        central.write(
            struct.pack(
                "<4sHHHHHHIIIHHHHHII",
                b"PK\x01\x02",
                20,
                20,
                0,
                method,
                0,
                0x21,
                crc,
                len(data),
                size,
                len(encoded),
                0,
                0,
                0,
                0,
                0o644 << 16,
                offset,
            )  # fmt: skip
            + encoded
        )
    directory = central.getvalue()
    end = struct.pack(
        "<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(directory),
        local.tell(), 0,
    )  # fmt: skip
    path.write_bytes(local.getvalue() + directory + end)


def npy_header(shape: tuple[int, ...], dtype: str = "<i8") -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": dtype, "fortran_order": False, "shape": shape}
    )
    return buffer.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def members_of(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


# --- the forgeries, applied to one member of a real file -----------------------------------------


def _claims_1e12(original: bytes) -> tuple[dict, dict]:
    """The issue's case: a header claiming 10**12 elements (7.28 TiB) over 4 KiB of data."""
    return {"data": npy_header((10**12,)) + bytes(4096)}, {}


def _zip_bomb(original: bytes) -> tuple[dict, dict]:
    """The issue's case: a member that inflates to 2 GiB (plus a valid header) from 2 MB."""
    return {}, {"raw": deflated_zeros(npy_header((GIB // 8,)), 2 * GIB)}


def _header_says_more(original: bytes) -> tuple[dict, dict]:
    """Header for 10 more elements than the member holds (a truncated or edited member)."""
    counts = np.load(io.BytesIO(original))
    return {"data": npy_header((counts.size + 10,)) + counts.tobytes()}, {}


def _header_says_less(original: bytes) -> tuple[dict, dict]:
    """Data appended after what the header describes."""
    return {"data": original + bytes(800)}, {}


def _too_large_for_bins(original: bytes) -> tuple[dict, dict]:
    """A real array, far larger than the file's bins allow (8 MB of counts)."""
    return {"data": npy_bytes(np.zeros(10**6, np.int64))}, {}


FORGERIES = {
    "header-claims-1e12": (_claims_1e12, "ends inside an array"),
    "zip-bomb-2GiB": (_zip_bomb, "zip bomb"),
    "header-says-more": (_header_says_more, "ends inside an array"),
    "header-says-less": (_header_says_less, "more than its .npy header"),
    "larger-than-bins-allow": (_too_large_for_bins, "are expected here"),
}


def forge(source: Path, dest: Path, member: str, forgery) -> None:
    """`source` with `member` replaced by what `forgery(original bytes)` makes."""
    members = members_of(source)
    stored, raw = forgery(members[member])
    if "data" in stored:
        members[member] = stored["data"]
    else:
        del members[member]
    write_zip(dest, members, {member: raw["raw"]} if raw else {})


# --- a calibrated tiny model ---------------------------------------------------------------------


def _gemm_model():
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
    graph = helper.make_graph(
        nodes,
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory, cli) -> Path:
    """A folder with model.onnx, recipe.yaml, out/stats.npz and two shard runs (shard0, shard1)."""
    import onnx

    folder = tmp_path_factory.mktemp("calibrated")
    onnx.save(_gemm_model(), folder / "model.onnx")
    recipe = {
        "model": {"onnx": "model.onnx"},
        "inputs": {"x": [1, 4]},
        "calibration": {
            "data": {"synthetic": True, "samples": 16},
            "method": "minmax",
            "batch_size": 4,
        },
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    for out, shard in (("out", None), ("shard0", "0/2"), ("shard1", "1/2")):
        args = ["calibrate", folder / "recipe.yaml", "-o", folder / out, "--no-progress"]
        result = cli(*args, *(["--shard", shard] if shard else []))
        assert result.exit_code == 0, result.output
    return folder


def _one_line_naming(result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name", FORGERIES)
def test_forged_stats_member_through_quantize(calibrated: Path, tmp_path: Path, cli, name) -> None:
    forgery, words = FORGERIES[name]
    bad = tmp_path / "stats.npz"
    forge(calibrated / "out" / "stats.npz", bad, "counts_1.npy", forgery)
    start = time.process_time()
    result = cli(
        "quantize", calibrated / "recipe.yaml", "--stats", bad, "-o", tmp_path / "out",
        "--no-progress",
    )  # fmt: skip
    elapsed = time.process_time() - start
    _one_line_naming(result, str(bad), "'counts_1.npy'", words)
    assert elapsed < LIMIT_S, f"{elapsed:.2f} s"
    assert not (tmp_path / "out" / "model.int8.onnx").exists()


@pytest.mark.parametrize("name", ["header-claims-1e12", "zip-bomb-2GiB"])
def test_forged_shard_through_stats_merge(calibrated: Path, tmp_path: Path, cli, name) -> None:
    forgery, words = FORGERIES[name]
    bad = tmp_path / "shard1" / "stats.npz"
    bad.parent.mkdir()
    forge(calibrated / "shard1" / "stats.npz", bad, "counts_0.npy", forgery)
    start = time.process_time()
    result = cli(
        "stats", "merge", calibrated / "shard0" / "stats.npz", bad, "-o", tmp_path / "merged.npz"
    )
    elapsed = time.process_time() - start
    _one_line_naming(result, str(bad), "'counts_0.npy'", words)
    assert elapsed < LIMIT_S, f"{elapsed:.2f} s"
    assert not (tmp_path / "merged.npz").exists()


def test_zip_bomb_as_index_json_is_refused(calibrated: Path, tmp_path: Path) -> None:
    from qtool.calibration.stats_file import read_stats_file

    members = members_of(calibrated / "out" / "stats.npz")
    del members["index.json"]
    bad = tmp_path / "stats.npz"
    write_zip(bad, members, {"index.json": deflated_zeros(b"{", 2 * GIB)})
    start = time.process_time()
    with pytest.raises(CalibrationError, match=r"member 'index.json' would inflate") as info:
        read_stats_file(bad)
    assert time.process_time() - start < LIMIT_S and str(bad) in str(info.value)


def test_member_that_understates_its_size_is_read_only_that_far(
    calibrated: Path, tmp_path: Path
) -> None:
    """The central directory says the histogram's size, the stream inflates to 2 GiB: zipfile
    stops at the declared size (the CRC is of those bytes), so the member costs what it declares
    and reads as the zero histogram it begins with."""
    from qtool.calibration.stats_file import read_stats_file

    members = members_of(calibrated / "out" / "stats.npz")
    original = members.pop("counts_1.npy")
    header = original[: len(npy_header((1,)))]
    declared = header + bytes(len(original) - len(header))
    stream, _, _ = deflated_zeros(header, 2 * GIB)
    bad = tmp_path / "stats.npz"
    write_zip(bad, members, {"counts_1.npy": (stream, zlib.crc32(declared), len(declared))})
    start = time.process_time()
    loaded = read_stats_file(bad)
    assert time.process_time() - start < LIMIT_S
    assert not loaded.stats[1].counts.any()


def test_stats_bins_beyond_the_recipe_maximum_are_refused(calibrated: Path, tmp_path: Path):
    import json

    from qtool.calibration.spec import MAX_BINS as RECIPE_MAX_BINS
    from qtool.calibration.stats_file import MAX_BINS, read_stats_file

    assert MAX_BINS == RECIPE_MAX_BINS
    members = members_of(calibrated / "out" / "stats.npz")
    index = json.loads(members["index.json"])
    index["bins"] = 2**40
    members["index.json"] = json.dumps(index).encode()
    bad = tmp_path / "stats.npz"
    write_zip(bad, members, {})
    with pytest.raises(CalibrationError, match=f"at most {MAX_BINS}"):
        read_stats_file(bad)


# --- Hessian and channel files -------------------------------------------------------------------


def _hessian_file(path: Path) -> str:
    from qtool.calibration.hessian_file import save_hessians
    from qtool.calibration.hessians import HessianAccumulator

    accumulator = HessianAccumulator(6)
    accumulator.update(np.random.default_rng(0).standard_normal((10, 6)))
    save_hessians(path, {"x": accumulator}, "f" * 64)
    return "xtx_0.npy"


def _channel_file(path: Path) -> str:
    from qtool.calibration.channels import ChannelObserver, save_channels

    observer = ChannelObserver("x", rows=8)
    observer.update(np.random.default_rng(0).standard_normal((20, 6)).astype(np.float32))
    save_channels(path, {"x": observer.result()}, "f" * 64, None)
    return "tensor_0_sample.npy"


def _load(kind: str, path: Path):
    if kind == "hessians":
        from qtool.calibration.hessian_file import load_hessians

        return load_hessians(path, "f" * 64)
    from qtool.calibration.channels import load_channels

    return load_channels(path, "f" * 64)


@pytest.mark.parametrize("kind", ["hessians", "channels"])
@pytest.mark.parametrize("name", ["header-claims-1e12", "zip-bomb-2GiB", "header-says-less"])
def test_forged_side_file_member_is_refused(tmp_path: Path, kind: str, name: str) -> None:
    good = tmp_path / "good.npz"
    member = (_hessian_file if kind == "hessians" else _channel_file)(good)
    _load(kind, good)  # the untouched file loads
    forgery, words = FORGERIES[name]
    bad = tmp_path / f"{kind}.npz"
    forge(good, bad, member, forgery)
    start = time.process_time()
    with pytest.raises(CalibrationError) as info:
        _load(kind, bad)
    message = str(info.value)
    assert time.process_time() - start < LIMIT_S
    assert str(bad) in message and repr(member) in message and "\n" not in message, message
    if name != "header-claims-1e12":  # here the index's shape is the first thing that differs
        assert words in message, message


# --- calibration data ----------------------------------------------------------------------------


def _data_spec(path: Path):
    from qtool.data.spec import DataSpec

    return DataSpec("calibration.data", npz=path)


def _inputs():
    from qtool.data.spec import InputSpec

    return (InputSpec("x", (1, 4)),)


def test_data_member_claiming_1e12_samples_is_refused(tmp_path: Path) -> None:
    from qtool.data.batches import count_samples_hint, iter_batches

    path = tmp_path / "d.npz"
    write_zip(path, {"x.npy": npy_header((10**12, 4), "<f4") + bytes(4096)}, {})
    start = time.process_time()
    for call in (
        lambda: count_samples_hint(_data_spec(path), None),
        lambda: list(iter_batches(_data_spec(path), _inputs(), batch_size=8)),
    ):
        with pytest.raises(DataError, match=r"ends inside an array .*'x.npy'") as info:
            call()
        assert str(path) in str(info.value)
    assert time.process_time() - start < LIMIT_S


def test_data_member_with_a_huge_sample_shape_is_refused_before_reading(tmp_path: Path) -> None:
    """A consistent header (the data is there) whose sample shape is not the declared one: the
    shape is compared before a row is read, so no 10**6-value row is allocated per sample."""
    from qtool.data.batches import iter_batches

    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((2, 10**6), np.float32))
    with pytest.raises(DataError, match=r"input 'x' has sample shape \[1000000\]"):
        list(iter_batches(_data_spec(path), _inputs(), batch_size=8))


def test_data_zip_bomb_costs_only_the_rows_asked_for(tmp_path: Path) -> None:
    """2 GiB of (valid) zero samples deflated into 2 MB: data files may deflate hundreds of
    times (padding), so it is not refused, but max_samples bounds what is inflated."""
    from qtool.data.batches import iter_batches

    rows = 2 * GIB // 16  # [rows, 4] float32: 2 GiB
    path = tmp_path / "d.npz"
    write_zip(path, {}, {"x.npy": deflated_zeros(npy_header((rows, 4), "<f4"), 2 * GIB)})
    start = time.process_time()
    batches = list(iter_batches(_data_spec(path), _inputs(), batch_size=8, max_samples=64))
    assert time.process_time() - start < LIMIT_S
    assert sum(len(b) for b in batches) == 64


def test_npy_labels_claiming_1e12_values_are_refused(tmp_path: Path) -> None:
    from qtool.data.batches import iter_batches
    from qtool.data.spec import DataSpec

    np.save(tmp_path / "x.npy", np.zeros((8, 4), np.float32))
    (tmp_path / "labels.npy").write_bytes(npy_header((10**12,)) + bytes(64))
    spec = DataSpec(
        "calibration.data", npy={"x": tmp_path / "x.npy"}, labels=tmp_path / "labels.npy"
    )
    with pytest.raises(DataError, match=r"labels\.npy: ends inside an array"):
        list(iter_batches(spec, _inputs(), batch_size=8))
