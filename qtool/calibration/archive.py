"""Zip members written byte-for-byte reproducibly, shared by the stats and Hessian files.

numpy's savez stamps the current time into the zip, so two identical calibrations would differ;
every member written here carries one fixed timestamp and fixed permissions instead.
"""

from __future__ import annotations

import zipfile

_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def write_member(
    archive: zipfile.ZipFile, name: str, data: bytes, compress_type: int = zipfile.ZIP_DEFLATED
) -> None:
    info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
    info.compress_type = compress_type
    info.external_attr = 0o644 << 16
    archive.writestr(info, data)
