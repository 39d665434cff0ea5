"""Rich helpers shared by every layer: one console on stderr, progress bars, spinners."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

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
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    count = DownloadColumn() if in_bytes else MofNCompleteColumn()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), count, TimeElapsedColumn(),
                  TimeRemainingColumn(), console=con or console(), transient=transient,
                  disable=quiet()) as p:
        yield p


def convert_with_progress(fn: Callable, description: str, con=None):
    """Run fn(progress_cb) where progress_cb(name, i, total) advances one bar."""
    with progress_bar(con) as p:
        task = p.add_task(description, total=None)

        def cb(name: str, i: int, total: int) -> None:
            p.update(task, completed=i, total=total, description=f"{description}: {name}")

        result = fn(cb)
        p.update(task, description=description)
    return result
