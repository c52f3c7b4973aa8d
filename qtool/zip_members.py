"""Bounded reading of zip members and the .npy arrays inside them (.npz files).

Stats, Hessian and channel files and calibration data arrive from elsewhere (shards copied
between machines, a colleague's output folder, a data pipeline), and a damaged or hostile one
must fail at once, in one line naming the file and member, not after minutes of inflating or with
a numpy allocation error. So nothing of a member is read before its zip entry is checked
(`check_member`): its declared size against the caller's limit and against what the file can
hold (a stored member lies inside the file; a deflated one inflates at most MAX_INFLATION times
when the caller asks, and never more than deflate itself can). Then `NpyMember` reads only the
.npy header and checks shape x itemsize against the member's declared size, so the caller can
compare the shape with what it expects before the array is allocated; the data is then read in
slices, asking zipfile for exactly that many bytes (zipfile itself stops at the declared size,
whatever the compressed stream holds, and checks the CRC at the end).

The error type is the caller's (CalibrationError for qtool's own files, DataError for data).
"""

from __future__ import annotations

import errno
import io
import math
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np

from qtool.errors import QtoolError

# A member over INFLATION_FLOOR bytes may inflate at most MAX_INFLATION times its compressed
# size. qtool stores Hessians and channel samples uncompressed and deflates histograms (at most
# 2 * 16384 int64 = 256 KiB, under the floor, so their zero runs may compress any amount).
MAX_INFLATION = 100
INFLATION_FLOOR = 1 << 20
# Deflate cannot compress better than 1032:1 (258-byte matches in 2-bit codes): a member that
# claims more is lying about its size, whatever the caller's own limit.
DEFLATE_MAX_RATIO = 1032
# numpy writes headers of 64-128 bytes; version 1.0 allows 65535, and numpy itself refuses more
# than 10000 by default (max_header_size).
MAX_NPY_HEADER_BYTES = 10_000
# Data is read in slices of this size into the array's own memory.
_READ_CHUNK = 16 << 20
# What zipfile and zlib raise for a damaged member (CRC, a bad deflate stream, a short file).
READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError)


def damage(exc: BaseException, what: str) -> str:
    """What a READ_ERRORS exception says about the file `what` ("stats file"), for a message:
    "cannot read the stats file (Permission denied)" when the OS refused it (it is not damaged,
    and calibrating again will not help), else "corrupt stats file (...)"."""
    if isinstance(exc, PermissionError) or (isinstance(exc, OSError) and exc.errno == errno.EIO):
        return f"cannot read the {what} ({exc.strerror or exc})"
    return f"corrupt {what} ({type(exc).__name__}: {str(exc)[:200]})"


def _amount(count: int) -> str:
    """A byte or element count for a message: exact up to 15 digits, else 3 significant ones."""
    return str(count) if count < 10**15 else f"{count:.3e}"


def _archive_size(archive: zipfile.ZipFile) -> int:
    return os.fstat(archive.fp.fileno()).st_size


def check_member(
    path: Path,
    archive: zipfile.ZipFile,
    member: str,
    where: str = "",
    *,
    limit: int | None = None,
    max_inflation: int | None = MAX_INFLATION,
    error: type[QtoolError],
) -> zipfile.ZipInfo:
    """The zip entry of `member`, refused before any of it is read when it declares more than
    `limit` bytes or more than the file can hold (see the module docstring). `where` prefixes
    the member in messages ("tensor 'x': "); `max_inflation` None: only deflate's own bound
    (data files, whose padding may legitimately deflate 500x)."""

    def fail(problem: str) -> QtoolError:
        return error(f"{path}: {where}member {member!r} {problem}")

    try:
        info = archive.getinfo(member)
    except KeyError:
        raise fail("is missing") from None
    size, packed = info.file_size, info.compress_size
    if info.compress_type == zipfile.ZIP_STORED:
        if packed != size:
            raise fail(f"is stored uncompressed but declares {size} bytes in {packed}")
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        ratio = size / max(packed, 1)
        if size > INFLATION_FLOOR and ratio > DEFLATE_MAX_RATIO:
            raise fail(
                f"declares {_amount(size)} bytes from {packed} deflated ({ratio:.0f}:1, more than "
                "deflate can reach): a damaged or forged zip entry"
            )
        if max_inflation is not None and size > INFLATION_FLOOR and ratio > max_inflation:
            raise fail(
                f"would inflate {packed} bytes to {_amount(size)} ({ratio:.0f}:1, above "
                f"{max_inflation}:1): a zip bomb, not statistics"
            )
    else:
        raise fail(
            f"uses zip compression method {info.compress_type}; only stored and deflated "
            "members are read"
        )
    if info.header_offset + packed > _archive_size(archive):
        raise fail(f"declares {_amount(packed)} bytes past the end of the file (truncated?)")
    if limit is not None and size > limit:
        raise fail(f"declares {_amount(size)} bytes; at most {_amount(limit)} are expected here")
    return info


def read_member(
    path: Path,
    archive: zipfile.ZipFile,
    member: str,
    limit: int,
    *,
    error: type[QtoolError],
) -> bytes:
    """A small member's bytes (index.json), its declared size checked first."""
    info = check_member(path, archive, member, limit=limit, error=error)
    with archive.open(info) as handle:
        data = handle.read(info.file_size + 1)
    if len(data) != info.file_size:
        raise error(f"{path}: member {member!r} holds {len(data)} bytes, not {info.file_size}")
    return data


class NpyMember:
    """One .npy member: its header read and checked, its data not yet (`read`).

    Opening reads at most MAX_NPY_HEADER_BYTES of the member. The header's shape x itemsize must
    equal the member's declared size less the header (`allow_trailing`: at most that, as np.load
    reads it), so a header that claims 10**12 elements in a 4 KiB member is refused here, before
    the caller compares the shape with its index and long before anything is allocated. Use as a
    context manager (it holds the member open); `handle` is left just after the header.
    """

    def __init__(
        self,
        path: Path,
        archive: zipfile.ZipFile,
        member: str,
        where: str = "",
        *,
        limit: int | None = None,
        max_inflation: int | None = MAX_INFLATION,
        allow_trailing: bool = False,
        error: type[QtoolError],
    ) -> None:
        self.path, self.member, self.where, self.error = path, member, where, error
        self.info = check_member(
            path, archive, member, where, limit=limit, max_inflation=max_inflation, error=error
        )
        self.handle = archive.open(self.info)
        try:
            self.shape, self.fortran, self.dtype, header = self._read_header()
        except BaseException:
            self.handle.close()
            raise
        self.header_bytes = header
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        available = self.info.file_size - header
        described = f"{self.dtype} {list(self.shape)}, {_amount(self.nbytes)} bytes"
        if self.nbytes > available:
            self.handle.close()
            raise error(
                f"{path}: ends inside an array ({where}member {member!r}: its .npy header says "
                f"{described}, but it holds {available})"
            )
        if self.nbytes < available and not allow_trailing:
            self.handle.close()
            raise self.fail(
                f"holds {available} bytes of data, more than its .npy header's {described} "
                "(damaged or edited)"
            )

    def fail(self, problem: str) -> QtoolError:
        return self.error(f"{self.path}: {self.where}member {self.member!r} {problem}")

    def _read_header(self) -> tuple[tuple[int, ...], bool, np.dtype, int]:
        """(shape, fortran order, dtype, header bytes) from the member's first bytes."""
        try:
            magic = self.handle.read(8)
            if len(magic) != 8 or magic[:6] != np.lib.format.MAGIC_PREFIX:
                raise self.fail("is not a .npy array (no NUMPY magic)")
            if magic[6] not in (1, 2, 3):
                raise self.fail(f"is a .npy array of unknown format version {magic[6]}")
            length_bytes = 2 if magic[6] == 1 else 4
            length_field = self.handle.read(length_bytes)
            length = int.from_bytes(length_field, "little")
            if len(length_field) != length_bytes or length > MAX_NPY_HEADER_BYTES:
                raise self.fail(f"has a .npy header of {length} bytes (numpy writes ~128)")
            text = self.handle.read(length)
            buffer = io.BytesIO(magic + length_field + text)
            version = np.lib.format.read_magic(buffer)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read(buffer, max_header_size=MAX_NPY_HEADER_BYTES)
        except (ValueError, SyntaxError, RecursionError) as exc:
            raise self.fail(f"is not a .npy array ({str(exc).splitlines()[0][:120]})") from None
        if dtype.hasobject:
            raise self.fail("holds Python objects; only numeric arrays are read")
        if any(dim < 0 for dim in shape):
            raise self.fail(f"has a .npy header with a negative dimension {list(shape)}")
        return shape, fortran, dtype, 8 + length_bytes + length

    def read(self) -> np.ndarray:
        """The array, read in slices straight into its own (writable) memory."""
        if self.fortran:
            array = np.empty(self.shape[::-1], dtype=self.dtype)
        else:
            array = np.empty(self.shape, dtype=self.dtype)
        view = memoryview(array.reshape(-1).view(np.uint8)) if self.nbytes else memoryview(b"")
        done = 0
        while done < self.nbytes:
            count = self.handle.readinto(view[done : done + _READ_CHUNK])
            if not count:
                raise self.fail(f"ends after {done} of {self.nbytes} bytes (truncated)")
            done += count
        return array.T if self.fortran else array

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> NpyMember:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
