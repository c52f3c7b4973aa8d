"""The zip container shared by the stats, Hessian and channel files: members written
byte-for-byte reproducibly, and one reader for the index and per-tensor entries.

numpy's savez stamps the current time into the zip, so two identical calibrations would differ;
every member written here carries one fixed timestamp and fixed permissions instead. The side
files (Hessians, per-channel statistics) share one index layout (`format`, `model_sha256`,
`data_sha256`, `tensors`), so they share the checks that refuse a file from another model or
other data, instead of each repeating them with its own wording.

Reading is bounded, because these files come from elsewhere (shards copied between machines, a
colleague's output folder) and a damaged or hostile one must fail in a second, naming the file
and member, rather than after minutes of inflating or with a numpy allocation error: every
member goes through qtool.zip_members, whose size limit each reader derives from the index (a
histogram of 2 * bins int64 counts, a Hessian triangle of F(F+1)/2 float64, a channel sample of
rows x channels float32), and whose .npy header is compared with the index before the array is
allocated.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from qtool.errors import CalibrationError
from qtool.zip_members import READ_ERRORS, damage, read_member

_FIXED_TIME = (1980, 1, 1, 0, 0, 0)

# index.json: ~150 bytes a tensor, so 16 MiB is 100000 tensors (a 70B-parameter LLM observes
# under 1000); JSON parsing takes ~10x the text in memory, so this also bounds that.
MAX_INDEX_BYTES = 16 << 20


def write_member(
    archive: zipfile.ZipFile, name: str, data: bytes, compress_type: int = zipfile.ZIP_DEFLATED
) -> None:
    info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
    info.compress_type = compress_type
    info.external_attr = 0o644 << 16
    archive.writestr(info, data)


class _Named(Protocol):
    name: str


Entry = TypeVar("Entry", bound=_Named)


def read_index(path: Path, archive: zipfile.ZipFile, kind: str, file_format: str) -> dict:
    """The archive's index.json, checked to be a `kind` file of `file_format` with a tensor list."""
    if "index.json" not in archive.NameToInfo:
        raise CalibrationError(f"{path}: corrupt {kind} file (no index.json)")
    try:
        index = json.loads(
            read_member(path, archive, "index.json", MAX_INDEX_BYTES, error=CalibrationError)
        )
    except (ValueError, RecursionError) as exc:
        raise CalibrationError(f"{path}: corrupt {kind} file (index.json: {exc})") from None
    if not isinstance(index, dict) or index.get("format") != file_format:
        found = index.get("format") if isinstance(index, dict) else None
        raise CalibrationError(f"{path}: not a qtool {kind} file (format {found!r})")
    if not isinstance(index.get("tensors"), list):
        raise CalibrationError(f"{path}: corrupt {kind} file (no tensor list)")
    return index


def index_field(path: Path, kind: str, file_format: str, field: str) -> object:
    """One field of a `kind` file's index (None when the index has no such field)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return read_index(Path(path), archive, kind, file_format).get(field)
    except READ_ERRORS as exc:
        raise CalibrationError(f"{path}: corrupt {kind} file ({exc})") from None


def load_entries(
    path: Path,
    kind: str,
    file_format: str,
    model_fingerprint: str,
    read_entry: Callable[[zipfile.ZipFile, dict, object], Entry],
    data_sha256: str | None = None,
) -> dict[str, Entry]:
    """Every tensor entry of a `kind` file, by name, after checking that it was collected on
    the model with `model_fingerprint` (and on the calibration data `data_sha256`, when given).

    `read_entry(archive, index, entry)` reads and checks one entry of the index's tensor list."""
    try:
        with zipfile.ZipFile(path) as archive:
            index = read_index(path, archive, kind, file_format)
            if index.get("model_sha256") != model_fingerprint:
                raise CalibrationError(
                    f"{path}: collected on a different model than the one being quantized "
                    "(re-run `qtool calibrate`)"
                )
            if data_sha256 is not None and index.get("data_sha256") != data_sha256:
                raise CalibrationError(
                    f"{path}: collected on other calibration data than the stats file beside it "
                    "(re-run `qtool calibrate`)"
                )
            entries: dict[str, Entry] = {}
            for raw in index["tensors"]:
                entry = read_entry(archive, index, raw)
                if entry.name in entries:
                    raise CalibrationError(f"{path}: tensor {entry.name!r} is listed twice")
                entries[entry.name] = entry
    except READ_ERRORS as exc:
        raise CalibrationError(f"{path}: {damage(exc, f'{kind} file')}") from None
    return entries
