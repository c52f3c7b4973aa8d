"""Named phases of a long command (exporting, preparing, calibrating), for what the CLI shows.

Exporting a PyTorch model or preparing a large graph takes seconds before the first progress bar
appears; without a word, a user cannot tell work from a hang. The pipeline marks each phase with
`phase(name)`; whoever wants to show them (qtool/progress.py: a spinner on a terminal, a timed
line per phase elsewhere) installs a listener with `listening`. Without a listener a phase costs
nothing and prints nothing, so library use stays silent.

Phases nest: the listener hears each start and end, innermost last.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol


class Listener(Protocol):
    """Told when a phase starts and when it ends (`ok` False: it raised)."""

    def started(self, name: str) -> None: ...

    def ended(self, name: str, ok: bool) -> None: ...


_listener: ContextVar[Listener | None] = ContextVar("qtool_phase_listener", default=None)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the enclosed work as `name`; the enclosing phase (if any) resumes after it."""
    listener = _listener.get()
    if listener is None:
        yield
        return
    listener.started(name)
    ok = False
    try:
        yield
        ok = True
    finally:
        listener.ended(name, ok)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Send the phases of the enclosed calls to `listener`."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)
