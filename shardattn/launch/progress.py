"""Progress of a long run (the launcher, calibration): phases, counts, and the time left.

On a terminal a rich progress bar (on stderr, cleared when done) shows the phase, its count and
its elapsed and, with ``eta=True``, remaining time. Off a terminal (a pipe, a log file, CI) it
prints lines instead: a phase's line once the run has gone on for ``quiet_s`` seconds (a quick run
prints none), then, while a phase runs, a line every ``every_s`` seconds with its count, elapsed
and remaining time. A small daemon thread wakes the line mode up while the caller's work blocks.

>>> import io
>>> out = io.StringIO()
>>> p = RunProgress("demo", file=out, terminal=False, quiet_s=0.0, every_s=0.0, clock=iter(range(100)).__next__)
>>> p.phase("timing", total=4); p.advance(2); p.tick(); p.close()
>>> print(out.getvalue().strip())
demo: timing
demo: timing 2/4, 2 s, about 2 s left
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["RunProgress", "format_seconds"]


def format_seconds(s: float) -> str:
    """``"42 s"``, ``"3 min 20 s"``, ``"2 h 5 min"``.

    >>> format_seconds(42.4), format_seconds(200), format_seconds(7500)
    ('42 s', '3 min 20 s', '2 h 5 min')
    """
    s = max(0, round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class RunProgress:
    """Phases of a run with counts (see the module docstring).

    Args:
        name: the prefix of each line (``"shardattn.launch"``).
        enabled: ``False`` shows nothing (other ranks, ``--no-progress``).
        file: where lines and the bar go (default stderr).
        terminal: draw a bar (default: whether ``file`` is a terminal).
        eta: estimate the time left of a counted phase from its pace so far.
        quiet_s: off a terminal, say nothing until the run is this old.
        every_s: off a terminal, repeat the running phase's count this often.
        clock: seconds, monotonic (tests pass their own).
        thread: off a terminal, wake up by a daemon thread (tests call :meth:`tick` themselves).
    """

    def __init__(
        self,
        name: str,
        *,
        enabled: bool = True,
        file: IO[str] | None = None,
        terminal: bool | None = None,
        eta: bool = True,
        quiet_s: float = 2.0,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        thread: bool | None = None,
    ) -> None:
        self.name, self.enabled, self.eta = name, enabled, eta
        self.file = sys.stderr if file is None else file
        self.terminal = bool(getattr(self.file, "isatty", lambda: False)()) if terminal is None else terminal
        self.quiet_s, self.every_s, self._clock = quiet_s, every_s, clock
        self._lock = threading.Lock()
        self._start = clock()
        self._phase: str | None = None
        self._total: int | None = None
        self._done = 0
        self._phase_t0 = self._start
        self._said_at: float | None = None  # when the running phase last printed a line
        self._bar: Any = None
        self._task: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not enabled:
            return
        if self.terminal:
            self._start_bar()
        elif thread if thread is not None else clock is time.monotonic:
            self._thread = threading.Thread(target=self._watch, name=f"{name} progress", daemon=True)
            self._thread.start()

    # -- the caller's side ------------------------------------------------------------------------
    def phase(self, name: str, total: int | None = None) -> None:
        """Start phase ``name`` (ending the one before), with ``total`` steps to :meth:`advance` through."""
        if not self.enabled:
            return
        with self._lock:
            self._phase, self._total, self._done = name, total, 0
            self._phase_t0 = self._clock()
            self._said_at = None
            if self._bar is not None:
                self._bar.reset(self._task, total=total, description=name)
            elif self._phase_t0 - self._start >= self.quiet_s:
                self._say(name)

    def relabel(self, name: str) -> None:
        """Rename the running phase, keeping its count and pace (one phase over several kinds of work,
        so the time left covers them all); off a terminal the new name is printed at once."""
        if not self.enabled:
            return
        with self._lock:
            self._phase = name
            if self._bar is not None:
                self._bar.update(self._task, description=name)
            elif self._clock() - self._start >= self.quiet_s:
                self._say(self._status(self._clock()))

    def advance(self, n: int = 1) -> None:
        """``n`` more steps of the running phase done."""
        if not self.enabled:
            return
        with self._lock:
            self._done += n
            if self._bar is not None:
                self._bar.advance(self._task, n)

    def tick(self) -> None:
        """Off a terminal: print the running phase's line when one is due (the thread calls it)."""
        if not self.enabled or self._bar is not None:
            return
        with self._lock:
            now = self._clock()
            if self._phase is None or now - self._start < self.quiet_s:
                return
            if self._said_at is None:  # the phase began before the run was old enough to say so
                self._say(self._phase)
            elif now - self._said_at >= self.every_s:
                self._say(self._status(now))

    @property
    def elapsed(self) -> float:
        """Seconds since the run's progress began."""
        return self._clock() - self._start

    def close(self) -> None:
        """Stop the bar or the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside ---------------------------------------------------------------------------------
    def _status(self, now: float) -> str:
        elapsed = now - self._phase_t0
        text = f"{self._phase}"
        if self._total:
            text += f" {self._done}/{self._total}"
        text += f", {format_seconds(elapsed)}"
        if self.eta and self._total and self._done:
            left = elapsed / self._done * (self._total - self._done)
            text += f", about {format_seconds(left)} left"
        return text

    def _say(self, text: str) -> None:
        self._said_at = self._clock()
        print(f"{self.name}: {text}", file=self.file, flush=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            self.tick()

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns: list[Any] = [SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn()]
        columns += [MofNCompleteColumn(), TimeElapsedColumn()]
        if self.eta:
            columns.append(TimeRemainingColumn())
        self._bar = Progress(*columns, console=Console(file=self.file), transient=True)
        self._task = self._bar.add_task(self.name, total=None)
        self._bar.start()
