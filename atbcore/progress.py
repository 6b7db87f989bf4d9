"""A progress display for work that can take seconds: C-kernel builds, compiles.

    from atbcore.progress import progress

    with progress("compiling LlamaForCausalLM"):
        runner = build_runner(model)

    with progress("preparing weights", total=len(layers)) as advance:
        for layer in layers:
            prepare(layer)
            advance()                       # one step done: "3/32" and a bar

A rich spinner with the elapsed time (with ``total``: a bar and "done/total") appears
on stderr only when stderr is a terminal and the work is still running after
``threshold_s`` (2 s by default), and it erases itself when the work ends; piped
output, logs and test runs never see it. ``ATB_PROGRESS=0`` turns it off everywhere,
``ATB_PROGRESS=1`` shows it on any stream; a caller's ``enabled=False`` turns it off,
``enabled=True`` shows it on any stream (``ATB_PROGRESS=0`` still wins). The
``advance`` callable the block gets counts steps whether or not anything is shown.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["progress"]


def _wanted(console: Any, enabled: bool | None) -> bool:
    setting = os.environ.get("ATB_PROGRESS", "").strip()
    if setting == "0" or enabled is False:
        return False
    return setting == "1" or bool(enabled) or console.is_terminal


def _quiet() -> Callable[[int], None]:
    return lambda steps=1: None


@contextmanager
def progress(description: str, threshold_s: float = 2.0, console: Any = None, *,
             total: int | None = None, enabled: bool | None = None
             ) -> Iterator[Callable[[int], None]]:
    """Show a transient display named ``description`` while the block runs, once it has
    run for ``threshold_s`` seconds (at once for 0), on a terminal only (see module).
    The block gets ``advance(steps=1)``: with ``total`` the display counts those steps."""
    if console is None:
        import sys

        forced = enabled is True or os.environ.get("ATB_PROGRESS", "").strip() == "1"
        if enabled is False or not (sys.stderr.isatty() or forced):
            yield _quiet()  # the common non-interactive case: not even rich is imported
            return
        from rich.console import Console

        # forced onto a stream that is not a terminal: rich draws a live display only
        # on terminals, so it is told to treat this one as one
        console = Console(stderr=True, force_terminal=True if forced else None)
    if not _wanted(console, enabled):
        yield _quiet()
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)

    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    bar = Progress(*columns, TimeElapsedColumn(), console=console, transient=True)
    task = bar.add_task(description, total=total)
    lock = threading.Lock()
    state = {"started": False, "done": False}

    def start() -> None:
        with lock:
            if not state["done"]:
                bar.start()
                state["started"] = True

    def advance(steps: int = 1) -> None:
        if not state["done"]:
            bar.advance(task, steps)

    timer = None
    if threshold_s <= 0:
        start()
    else:
        timer = threading.Timer(threshold_s, start)
        timer.daemon = True
        timer.start()
    try:
        yield advance
    finally:
        if timer is not None:
            timer.cancel()
        with lock:
            state["done"] = True
            if state["started"]:
                bar.stop()
