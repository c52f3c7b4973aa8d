"""Named phases of a long command (exporting, preparing, calibrating), for the CLI's status line.

Exporting a PyTorch model or preparing a large graph takes seconds before the first progress bar
appears; without a word, a user cannot tell work from a hang. The pipeline marks each phase with
`phase(name)`; whoever wants to show them (the CLI) installs a listener with `listening`. Without
a listener a phase costs nothing and prints nothing, so library use stays silent.

A phase ends before the stage that draws its own progress bar starts (calibration, evaluation),
so the listener's status line and that bar are never on screen together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# Called with the phase now running, or None when none is.
Listener = Callable[[str | None], None]

_listener: ContextVar[Listener | None] = ContextVar("qtool_phase_listener", default=None)
_current: ContextVar[str | None] = ContextVar("qtool_phase", default=None)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the enclosed work as `name`; the enclosing phase (if any) resumes after it."""
    listener = _listener.get()
    if listener is None:
        yield
        return
    outer = _current.get()
    token = _current.set(name)
    listener(name)
    try:
        yield
    finally:
        _current.reset(token)
        listener(outer)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Send the phases of the enclosed calls to `listener`."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)
