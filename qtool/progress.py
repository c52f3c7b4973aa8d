"""What a long command shows while it runs: rich bars on a terminal, timed lines anywhere else.

A CI log or a pipe cannot show a redrawn bar or spinner, and rich draws nothing there, so a
two-minute quantize used to print nothing until its end. The CLI wraps each command in
`showing(enabled)`, which picks the display once, for standard error:

- a terminal: the phase (qtool/phases.py) as a spinner line, and each loop's rich bars, as
  before; a bar pauses the spinner while it draws (rich allows one live display at a time);
- anything else: plain lines, each stamped with the time since the command started,
  `[3.2s] phase 'preparing graph' done in 3.1s` when a phase ends, and for the running loop
  `[12.3s] calibrating: 256/1024 samples` at most every INTERVAL_S and once at its end. A ticker
  thread writes the running phase or loop when nothing else was written for INTERVAL_S, so a
  long phase without a loop (an export, an ONNX Runtime session) still shows it is alive.

Loops draw through `bars(enabled, *columns, line=...)`: the rich columns for a terminal, the
line's template for everything else. Without `showing` (library use) a loop draws its rich bars
only when standard error is a terminal, and phases print nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.console import Console
from rich.progress import Progress, ProgressColumn

from qtool.phases import listening

# A progress line at most this often, and at least this often while something runs.
INTERVAL_S = 10.0

Clock = Callable[[], float]
Write = Callable[[str], None]


class Bars(Protocol):
    """What a loop calls: the part of rich's Progress that qtool's loops use."""

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int: ...

    def advance(self, task_id: int, advance: float = 1) -> None: ...

    def update(self, task_id: int, *, advance: float | None = None, **fields: Any) -> None: ...

    def remove_task(self, task_id: int) -> None: ...


class _Display(Protocol):
    def started(self, name: str) -> None: ...

    def ended(self, name: str, ok: bool) -> None: ...

    def bars(
        self, columns: tuple[str | ProgressColumn, ...], line: str, transient: bool
    ) -> contextlib.AbstractContextManager[Bars]: ...


_display: ContextVar[_Display | None] = ContextVar("qtool_progress_display", default=None)


def console() -> Console:
    """The console progress draws on: standard error, so that results on standard output stay
    clean when they are redirected. Resolved per call (tests replace sys.stderr)."""
    return Console(stderr=True)


@contextmanager
def showing(
    enabled: bool,
    *,
    terminal: bool | None = None,
    write: Write | None = None,
    clock: Clock = time.monotonic,
    ticker: bool = True,
    interval: float = INTERVAL_S,
) -> Iterator[None]:
    """Show the enclosed command's phases and loops (nothing when not `enabled`).

    `terminal` None: standard error decides. The rest are for the line display's tests: where
    lines go (default: standard error), the time, whether a thread writes a line when nothing
    else did for `interval` seconds, and that interval."""
    if not enabled:
        yield
        return
    screen = console()
    is_terminal = screen.is_terminal if terminal is None else terminal
    display: _Display
    if is_terminal:
        display = _TerminalDisplay(screen)
    else:
        display = LineDisplay(write or _write_stderr, clock, interval)
    token = _display.set(display)
    try:
        with listening(display), _ticking(display if ticker and not is_terminal else None):
            yield
    finally:
        _display.reset(token)
        if isinstance(display, _TerminalDisplay):
            display.close()


@contextmanager
def bars(
    enabled: bool,
    *columns: str | ProgressColumn,
    line: str,
    transient: bool = True,
) -> Iterator[Bars]:
    """The progress of one loop: `columns` as rich bars on a terminal, `line` elsewhere.

    `line` is a template formatted per task with `count` ("256/1024", or "256" without a total),
    `completed`, `total`, `description` and the task's own fields (`epoch`, `loss`, ...)."""
    display = _display.get()
    if not enabled:
        yield _NoBars()
    elif display is None:  # library use: rich bars when standard error is a terminal
        screen = console()
        with Progress(
            *columns, console=screen, transient=transient, disable=not screen.is_terminal
        ) as progress:
            yield progress
    else:
        with display.bars(columns, line, transient) as shown:
            yield shown


def _write_stderr(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@contextmanager
def _ticking(display: LineDisplay | None) -> Iterator[None]:
    """A daemon thread that lets `display` write a line when INTERVAL_S passed without one."""
    if display is None:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(max(0.05, display.next_due() - display.clock())):
            display.poll()

    thread = threading.Thread(target=tick, name="qtool-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class _NoBars:
    """--no-progress: every call does nothing."""

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        return 0

    def advance(self, task_id: int, advance: float = 1) -> None:
        pass

    def update(self, task_id: int, *, advance: float | None = None, **fields: Any) -> None:
        pass

    def remove_task(self, task_id: int) -> None:
        pass


class _TerminalDisplay:
    """The phase as a spinner line; a loop's rich bars in its place while they draw."""

    def __init__(self, screen: Console) -> None:
        self._console = screen
        self._status = screen.status("", spinner="dots")
        self._phases: list[str] = []
        self._drawing = False

    def started(self, name: str) -> None:
        self._phases.append(name)
        self._show()

    def ended(self, name: str, ok: bool) -> None:
        self._phases.pop()
        self._show()

    def _show(self) -> None:
        if self._phases and not self._drawing:
            self._status.start()
            self._status.update(f"{self._phases[-1]}...")  # at once, not at the next tick
        else:
            self._status.stop()

    @contextmanager
    def bars(
        self, columns: tuple[str | ProgressColumn, ...], line: str, transient: bool
    ) -> Iterator[Bars]:
        self._drawing = True
        self._status.stop()
        try:
            with Progress(*columns, console=self._console, transient=transient) as progress:
                yield progress
        finally:
            self._drawing = False
            self._show()

    def close(self) -> None:
        self._status.stop()


@dataclass
class _Task:
    description: str
    total: float | None
    fields: dict[str, Any]
    started: float
    completed: float = 0.0
    finished: float | None = None  # when `completed` reached `total`

    @property
    def running(self) -> bool:
        return self.total is None or self.completed < self.total


@dataclass
class _Phase:
    name: str
    started: float


@dataclass
class LineDisplay:
    """Timed plain lines (see the module docstring). Thread-safe: the loop, the phases and the
    ticker thread call it."""

    write: Write
    clock: Clock = time.monotonic
    interval: float = INTERVAL_S
    start: float = field(init=False)
    last_line: float = field(init=False)
    _phases: list[_Phase] = field(default_factory=list, init=False)
    _loops: list[_Loop] = field(default_factory=list, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False)

    def __post_init__(self) -> None:
        self.start = self.last_line = self.clock()

    def _emit(self, text: str, now: float) -> None:
        self.write(f"[{now - self.start:.1f}s] {text}")
        self.last_line = now

    def next_due(self) -> float:
        return self.last_line + self.interval

    def started(self, name: str) -> None:
        with self._lock:
            self._phases.append(_Phase(name, self.clock()))

    def ended(self, name: str, ok: bool) -> None:
        with self._lock:
            phase = self._phases.pop()
            if ok:  # a failed phase's error line follows, and says more
                now = self.clock()
                self._emit(f"phase '{phase.name}' done in {now - phase.started:.1f}s", now)

    def poll(self) -> None:
        """Write what runs now when INTERVAL_S passed since the last line."""
        with self._lock:
            now = self.clock()
            if now - self.last_line < self.interval:
                return
            if self._loops:
                for text in self._loops[-1].lines():
                    self._emit(text, now)
            elif self._phases:
                phase = self._phases[-1]
                self._emit(f"{phase.name}: running for {now - phase.started:.1f}s", now)
            else:
                self._emit("still working", now)

    @contextmanager
    def bars(
        self, columns: tuple[str | ProgressColumn, ...], line: str, transient: bool
    ) -> Iterator[Bars]:
        loop = _Loop(self, line)
        with self._lock:
            self._loops.append(loop)
        ok = False
        try:
            yield loop
            ok = True
        finally:
            with self._lock:
                self._loops.remove(loop)
                if ok:  # the loop's last state, once, with its time
                    now = self.clock()
                    for text in loop.lines(final=now):
                        self._emit(text, now)


class _Loop:
    """One `bars` context of the line display: its tasks, as lines."""

    def __init__(self, display: LineDisplay, line: str) -> None:
        self._display = display
        self._line = line
        self._tasks: dict[int, _Task] = {}
        self._next = 0

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        with self._display._lock:
            self._next += 1
            self._tasks[self._next] = _Task(description, total, fields, self._display.clock())
            return self._next

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(self, task_id: int, *, advance: float | None = None, **fields: Any) -> None:
        with self._display._lock:
            task = self._tasks[task_id]
            if advance is not None:
                task.completed += advance
                if not task.running and task.finished is None:
                    task.finished = self._display.clock()
            if "description" in fields:
                task.description = fields.pop("description")
            task.fields.update(fields)
        self._display.poll()

    def remove_task(self, task_id: int) -> None:
        with self._display._lock:
            del self._tasks[task_id]

    def lines(self, final: float | None = None) -> list[str]:
        """A line per running task (the last task when none runs: between QAT epochs); with
        `final`, the loop's end time, a line per task with the time it took."""
        tasks = list(self._tasks.values())
        if final is None:
            tasks = [t for t in tasks if t.running] or tasks[-1:]
        texts = []
        for task in tasks:
            count = f"{task.completed:g}" + ("" if task.total is None else f"/{task.total:g}")
            values = {
                **task.fields,
                "description": task.description,
                "completed": task.completed,
                "total": task.total,
                "count": count,
            }
            text = self._line.format(**values)
            if final is not None:
                ended = final if task.finished is None else task.finished
                text += f", done in {ended - task.started:.1f}s"
            texts.append(text)
        return texts
