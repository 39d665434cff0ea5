"""Rich helpers shared by every layer: one console on stderr, progress bars, spinners. On a
terminal they redraw in place; into a pipe or a log they print plain lines instead."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

NARROW = 100  # columns below which a progress bar drops its bar and time-left columns

_console = None


def console():
    """The stderr console for progress and messages (stdout stays clean for results)."""
    global _console
    if _console is None:
        from rich.console import Console

        _console = Console(stderr=True, highlight=False, soft_wrap=True)
    return _console


def out_console():
    """stdout console; wide when piped so tables are not squeezed to 80 columns."""
    from rich.console import Console

    width = None if sys.stdout.isatty() else 160
    return Console(highlight=False, soft_wrap=True, width=width)


def quiet() -> bool:
    return bool(os.environ.get("DSQ_QUIET")) or not sys.stderr.isatty() and bool(os.environ.get("CI"))


@contextmanager
def progress_bar(con=None, transient: bool = False, in_bytes: bool = False) -> Iterator:
    """A rich Progress on a terminal (its columns fitted to the width); plain lines (LineProgress)
    into a pipe or a log."""
    from rich.progress import Progress

    con = con or console()
    if not con.is_terminal and not quiet():
        yield LineProgress(con, in_bytes)
        return
    with Progress(*_columns(con.width, in_bytes), console=con, transient=transient, disable=quiet()) as p:
        yield p


def _columns(width: int, in_bytes: bool) -> list:
    """The description (cut with an ellipsis to leave the other columns room), a bar, the count,
    the time taken and left; below NARROW columns no bar and no time left, so the count always shows."""
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    from rich.table import Column

    fixed = Column(no_wrap=True)
    count = DownloadColumn(table_column=fixed) if in_bytes else MofNCompleteColumn(table_column=fixed)
    others = (24 if in_bytes else 12) + 8  # the count, the time taken, the gaps
    if width >= NARROW:
        bar = min(40, width // 5)
        others += bar + 10
    text = TextColumn("[bold]{task.description}",
                      table_column=Column(no_wrap=True, overflow="ellipsis", max_width=max(10, width - others)))
    if width < NARROW:
        return [text, count, TimeElapsedColumn(table_column=fixed)]
    return [text, BarColumn(bar_width=bar), count, TimeElapsedColumn(table_column=fixed), TimeRemainingColumn()]


class LineProgress:
    """rich Progress's add_task / update / advance as plain lines, for a pipe or a log: a task's
    start, its count at each tenth of the way (each step, up to 20 steps) or after `every` seconds
    without a line, and its end."""

    def __init__(self, con, in_bytes: bool = False, every: float = 10.0):
        self.con, self.in_bytes, self.every = con, in_bytes, every
        self.tasks: list[dict] = []

    def add_task(self, description: str, total: float | None = None, **_) -> int:
        self.tasks.append({"description": description, "total": total, "completed": 0, "shown": 0,
                           "t0": time.monotonic(), "last": time.monotonic()})
        self.con.print(f"{description} ...", markup=False, highlight=False)
        return len(self.tasks) - 1

    def update(self, task: int, completed: float | None = None, total: float | None = None,
               description: str | None = None, advance: float | None = None, **_) -> None:
        t = self.tasks[task]
        for key, value in (("completed", completed), ("total", total), ("description", description)):
            if value is not None:
                t[key] = value
        if advance:
            t["completed"] += advance
        self._maybe_print(t)

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def _maybe_print(self, t: dict) -> None:
        mark = self._mark(t)
        now = time.monotonic()
        if mark != t["shown"] if mark is not None else now - t["last"] >= self.every:
            t["shown"], t["last"] = mark, now
            self.con.print(self._line(t, now), markup=False, highlight=False)

    @staticmethod
    def _mark(t: dict) -> int | None:
        """Which tenth of the way (or which step, up to 20 steps) the task is at; None: total unknown."""
        total = t["total"]
        if not total:
            return None
        return int(t["completed"]) if total <= 20 else int(10 * t["completed"] / total)

    def _line(self, t: dict, now: float) -> str:
        done, total = t["completed"], t["total"]
        if self.in_bytes:
            count = f"{done / 2**20:.1f}" + (f"/{total / 2**20:.1f} MiB" if total else " MiB")
        else:
            count = f"{int(done)}" + (f"/{int(total)}" if total else "")
        return f"{t['description']}: {count} ({now - t['t0']:.0f}s)"


@contextmanager
def status(text: str, con=None) -> Iterator:
    """A spinner with a line of status (`.update(text)`) on a terminal; into a pipe or a log, each
    new status a line, at most one every few seconds."""
    con = con or console()
    if con.is_terminal or quiet():
        with con.status(text) as st:
            yield st
        return
    yield _LineStatus(con, text)


class _LineStatus:
    def __init__(self, con, text: str, every: float = 5.0):
        self.con, self.every, self.last = con, every, time.monotonic()
        con.print(text, markup=False, highlight=False)

    def update(self, text: str) -> None:
        if time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            self.con.print(text, markup=False, highlight=False)


def convert_with_progress(fn: Callable, description: str, con=None):
    """Run fn(progress_cb) where progress_cb(name, i, total) advances one bar."""
    with progress_bar(con) as p:
        task = p.add_task(description, total=None)

        def cb(name: str, i: int, total: int) -> None:
            p.update(task, completed=i, total=total, description=f"{description}: {name}")

        result = fn(cb)
        p.update(task, description=description)
    return result
