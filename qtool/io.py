"""Atomic file output: a crash or a bad input never leaves a half-written model or report.

One command's outputs are committed together (`commit_files`): every file is written and fsynced
to a temporary file beside its target first, and only when all of them are on disk are they
renamed into place, so a full disk leaves none of them. Temporary files carry the writer's pid
(`.model.int8.onnx.qtool1234.k2x9a8b1.tmp`) so that the next run can tell a killed run's leftovers
from a concurrent writer's files and remove them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from qtool.errors import OutputError

# Temporary files qtool itself names: ".{target name}.qtool{pid}.{mkstemp's 8 characters}.tmp".
_TEMP_NAME = re.compile(r"^\..+\.qtool(\d+)\.[a-z0-9_]{8}\.tmp$")
# A temporary file this old is stale even when its pid is alive again (pids are reused).
STALE_AFTER_S = 3600.0


def _fail(path: Path, exc: OSError, count: int = 1) -> OutputError:
    kept = f"; none of this run's {count} outputs were written" if count > 1 else ""
    return OutputError(f"{path}: cannot write output ({exc.strerror or exc}){kept}")


def not_a_file(path: Path, what: str = "file") -> str | None:
    """Why `path` cannot be read as a `what` ("is a directory, not a stats file", "stats file
    not found"), or None when it is a file: a message then says which, instead of calling an
    existing folder missing."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return f"is a directory, not a {what}"
    if path.exists():
        return f"is not a regular file (a {what} is wanted)"
    return f"{what} not found"


def _refuse_folder(target: Path) -> None:
    """An output path that names a folder: replacing it would move the folder aside (rename
    cannot put a file over a directory), so it is refused before anything is written."""
    if target.is_dir():
        raise OutputError(f"{target}: is a directory; name a file for this output")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def remove_stale_temporaries(folder: Path, now: float | None = None) -> list[Path]:
    """Delete qtool temporary files in `folder` left by killed runs: their writer's pid is gone,
    or they are older than STALE_AFTER_S. Files of any other name are never touched."""
    removed: list[Path] = []
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        if Path(entry.path) in _LIVE:
            continue
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > STALE_AFTER_S
            if old or not _pid_alive(int(match.group(1))):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:  # raced with another cleaner, or not ours to delete: leave it
            continue
    return removed


# Files this process staged and has not committed or discarded yet: never stale, however long
# the run that staged them takes (a model's calibration can outlast STALE_AFTER_S).
_LIVE: set[Path] = set()


@dataclass(frozen=True)
class Staged:
    """An output already written and fsynced to a temporary file beside its target, for content
    too large to hold as bytes (a model's external data): `commit_files` renames it into place
    with the other outputs. Until then the temporary file can be read (ONNX Runtime sessions open
    the staged model), and `discard` removes it when the run fails before the commit."""

    path: Path

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        _LIVE.discard(self.path)


def _write_temporary(path: Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call `write` on a new temporary file beside `path`, then make it durable; return its path."""
    fd, name = tempfile.mkstemp(
        prefix=f".{path.name}.qtool{os.getpid()}.", suffix=".tmp", dir=path.parent
    )
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def stage(target: Path, write: Callable[[BinaryIO], None]) -> Staged:
    """Stage one output: `write` streams its content into a temporary file beside `target`.

    A full disk raises OutputError naming `target` and leaves nothing behind. The folder's stale
    temporaries (killed runs) are removed first: a staged model's leftovers are gigabytes.
    """
    target = Path(target)
    _refuse_folder(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target.parent)
        tmp = _write_temporary(target, write)
    except OSError as exc:
        raise _fail(target, exc) from None
    _LIVE.add(tmp)
    staged = Staged(tmp)
    weakref.finalize(staged, _forget, tmp)
    return staged


def _forget(tmp: Path) -> None:
    """A staged file whose handle is gone uncommitted (its run failed before the commit) is
    removed with it; a committed one left _LIVE when it was renamed."""
    if tmp in _LIVE:
        tmp.unlink(missing_ok=True)
        _LIVE.discard(tmp)


def commit_files(files: Mapping[Path, bytes | Staged]) -> None:
    """Write all of `files` or none of them.

    Phase 1 writes every file given as bytes to a temporary beside its target (the step a full
    disk fails); a `Staged` file is such a temporary already. Phase 2 renames them into place.
    Should a rename fail midway, the targets already replaced get their previous content back
    (kept as a hard link, or renamed aside where the filesystem has no hard links) and new ones
    are removed, so the folder is as it was before the call. Staged files are removed on failure
    too: none of this run's outputs survive it.
    """
    targets = [Path(p) for p in files]
    if not targets:
        return
    written: dict[Path, Path] = {}
    for path, content in zip(targets, files.values(), strict=True):
        if isinstance(content, Staged):
            if os.path.abspath(content.path.parent) != os.path.abspath(path.parent):
                raise ValueError(f"{content.path} is not staged beside {path}")
            written[path] = content.path
    current: Path | None = None
    try:
        for path in targets:
            _refuse_folder(path)
        for folder in dict.fromkeys(p.parent for p in targets):
            current = folder
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(folder)
        for path, content in zip(targets, files.values(), strict=True):
            if not isinstance(content, Staged):
                current = path
                written[path] = _write_temporary(path, lambda handle, c=content: handle.write(c))
        current = None
        _rename_all({path: written[path] for path in targets})
    except BaseException as exc:
        for tmp in written.values():
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _fail(current or targets[0], exc, len(targets)) from None
        raise
    finally:
        _LIVE.difference_update(written.values())


def _backup(path: Path) -> Path | None:
    """Keep `path`'s current content under a temporary name (None when there is none).

    Only a file is kept: a folder that appeared at the target since commit_files checked it is
    an error, never moved aside."""
    if not path.exists():
        return None
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    backup = path.parent / f".{path.name}.qtool{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        os.link(path, backup)
    except OSError:  # no hard links here (FAT, some network filesystems): move it aside
        os.replace(path, backup)
    return backup


def _rename_all(written: dict[Path, Path]) -> None:
    backups: dict[Path, Path | None] = {}
    done: list[Path] = []
    failed = next(iter(written))
    try:
        for path in written:  # inside the try: a failed backup restores the ones made before it
            failed = path
            backups[path] = _backup(path)
        for path, tmp in written.items():
            failed = path
            os.replace(tmp, path)
            done.append(path)
    except BaseException as exc:  # a full disk, or Ctrl-C between two renames: undo them all
        for path, backup in backups.items():
            try:
                if backup is None:
                    if path in done:
                        path.unlink(missing_ok=True)
                elif path in done or not path.exists():  # replaced, or moved aside: restore
                    os.replace(backup, path)
                else:
                    backup.unlink(missing_ok=True)
            except OSError:  # best effort: the first error is the one to report
                continue
        if isinstance(exc, OSError):
            raise _fail(failed, exc, len(written)) from None
        raise
    for backup in backups.values():  # every output is in place: a leftover is not a failure
        if backup is not None:
            with contextlib.suppress(OSError):
                backup.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write one file atomically (a temporary file in the target folder, then a rename)."""
    commit_files({Path(path): data})


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
