"""A progress display for work that can take seconds: C-kernel builds, compiles.

    from atbcore.progress import progress

    with progress("compiling LlamaForCausalLM"):
        runner = build_runner(model)

A rich spinner with the elapsed time appears on stderr only when stderr is a terminal
and the work is still running after ``threshold_s`` (2 s by default), and it erases
itself when the work ends; piped output, logs and test runs never see it.
``ATB_PROGRESS=0`` turns it off, ``ATB_PROGRESS=1`` shows it on any stream.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["progress"]


def _wanted(console: Any) -> bool:
    setting = os.environ.get("ATB_PROGRESS", "").strip()
    if setting == "0":
        return False
    return setting == "1" or console.is_terminal


@contextmanager
def progress(description: str, threshold_s: float = 2.0, console: Any = None) -> Iterator[None]:
    """Show a transient spinner named ``description`` while the block runs, once it has
    run for ``threshold_s`` seconds (at once for 0), on a terminal only (see module)."""
    if console is None:
        import sys

        if not (sys.stderr.isatty() or os.environ.get("ATB_PROGRESS") == "1"):
            yield  # the common non-interactive case: not even rich is imported
            return
        from rich.console import Console

        console = Console(stderr=True)
    if not _wanted(console):
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                   console=console, transient=True)
    bar.add_task(description, total=None)
    lock = threading.Lock()
    state = {"started": False, "done": False}

    def start() -> None:
        with lock:
            if not state["done"]:
                bar.start()
                state["started"] = True

    timer = None
    if threshold_s <= 0:
        start()
    else:
        timer = threading.Timer(threshold_s, start)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        with lock:
            state["done"] = True
            if state["started"]:
                bar.stop()
