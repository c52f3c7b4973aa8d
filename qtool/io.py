"""Atomic file output: a crash or a bad input never leaves a half-written model or report."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from qtool.errors import OutputError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the target folder, then rename it into place."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write output ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, path)
    except BaseException as exc:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        if isinstance(exc, OSError):
            raise OutputError(f"{path}: cannot write output ({exc.strerror or exc})") from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
