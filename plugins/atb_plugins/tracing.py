"""Built-in plugin: log every hook call and its duration (``ATB_TRACE_PLUGINS=1``).

Uses pluggy's hook-call monitoring (``PluginManager.add_hookcall_monitoring``),
so it sees every call of every ``atb_*`` hook through the manager, with the
plugins that implement it, whether it raised, and how long it took. Records go
to the ``atb.plugins.trace`` logger (INFO) and to ``manager.trace_records``
(the last 1000, as :class:`TraceRecord`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from atbcore.plugin import hookimpl
from atbcore.plugin.loader import env_flag

__all__ = ["TraceRecord", "install", "trace_logger", "atb_configure"]

trace_logger = logging.getLogger("atb.plugins.trace")


@dataclass(frozen=True)
class TraceRecord:
    """One traced hook call: hook name, implementing plugins (call order),
    argument names, duration in milliseconds, and the exception type name if it raised."""

    hook: str
    plugins: tuple[str, ...]
    args: tuple[str, ...]
    ms: float
    error: str | None = None


def _show_info() -> None:
    # The user asked for traces: make INFO records of this logger visible even if
    # the atb logger is quieter, without changing the level of anything else.
    if trace_logger.getEffectiveLevel() > logging.INFO:
        trace_logger.setLevel(logging.INFO)
    if not trace_logger.handlers and not logging.getLogger("atb").handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ATB] %(message)s"))
        trace_logger.addHandler(handler)


def install(manager: Any, maxlen: int = 1000) -> None:
    """Start tracing ``manager``'s hook calls (once per manager)."""
    if getattr(manager, "trace_records", None) is not None:
        return
    records: deque[TraceRecord] = deque(maxlen=maxlen)
    manager.trace_records = records
    local = threading.local()  # start times: hook calls nest (a hook may call hooks)

    def before(hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        stack = getattr(local, "stack", None)
        if stack is None:
            stack = local.stack = []
        stack.append(time.perf_counter())

    def after(outcome: Any, hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        ms = (time.perf_counter() - local.stack.pop()) * 1e3
        error = type(outcome.exception).__name__ if outcome.exception is not None else None
        rec = TraceRecord(hook_name, tuple(i.plugin_name for i in reversed(impls)),
                          tuple(kwargs), ms, error)
        records.append(rec)
        trace_logger.info("hook %s(%s) [%s] %.3f ms%s", hook_name, ", ".join(rec.args),
                          ", ".join(rec.plugins) or "no plugins", ms,
                          f" raised {error}" if error else "")

    _show_info()
    manager.add_undo(manager.add_hookcall_monitoring(before, after))


@hookimpl
def atb_configure(manager: Any) -> None:
    """Install tracing on the manager when ``ATB_TRACE_PLUGINS`` is on."""
    if env_flag("ATB_TRACE_PLUGINS"):
        install(manager)
