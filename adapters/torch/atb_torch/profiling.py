"""Profiles of atb_torch runs, for later export.

With ``atb.init(enable_profiling=True)`` every GraphOp records one event per graph
node per run (the core executor's :class:`~atbcore.runtime.profiler.Profiler`), and
every standalone atb_torch module call records one event (module name, op, time).
On CUDA the times are bracketed by synchronisations, as the core profiler does.
Nothing is recorded under ``torch.compile`` tracing.

    atb.init(enable_profiling=True)
    model(x)
    atb.export_chrome_trace("trace.json")      # all GraphOps + module calls, Perfetto
    print(atb.profile_table())
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from typing import Any

import torch

from atbcore.runtime.config import get_config
from atbcore.runtime.profiler import NodeEvent, Profiler

__all__ = ["module_profiler", "record_module_call", "track", "profilers", "events",
           "export_chrome_trace", "profile_table", "clear_profiles", "EmptyTraceWarning"]


class EmptyTraceWarning(UserWarning):
    """An exported trace has no events (profiling off, or nothing run yet)."""

_MODULES = Profiler("atb_torch modules")
_TRACKED: "weakref.WeakSet[Profiler]" = weakref.WeakSet()
_ORDER: "weakref.WeakKeyDictionary[Profiler, int]" = weakref.WeakKeyDictionary()


def _enabled() -> bool:
    return get_config().enable_profiling and not torch.compiler.is_compiling()


def module_profiler() -> Profiler | None:
    """The profiler standalone module calls record into, or None when off."""
    return _MODULES if _enabled() else None


def record_module_call(prof: Profiler, module: Any, t0: int, out: Any) -> None:
    """Record one module call that started at ``t0`` (ns); syncs CUDA first."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if isinstance(first, torch.Tensor) and first.is_cuda:
        torch.cuda.synchronize(first.device)
    label = getattr(module, "name", None) or type(module).__name__
    prof.record(NodeEvent(label, getattr(module, "op_name", "") or type(module).__name__, t0,
                          prof.now() - t0, prof.runs))


def track(prof: Profiler) -> Profiler:
    """Include a GraphOp's profiler in exports (held weakly)."""
    _TRACKED.add(prof)
    _ORDER.setdefault(prof, len(_ORDER) + 1)
    return prof


def profilers() -> list[Profiler]:
    """The module-call profiler and every live GraphOp profiler, oldest first."""
    return [_MODULES] + sorted(_TRACKED, key=lambda p: _ORDER.get(p, 0))


def events() -> list[tuple[str, NodeEvent]]:
    """``(profiler name, event)`` for everything recorded so far."""
    return [(p.name, e) for p in profilers() for e in p.events]


def export_chrome_trace(path: str | os.PathLike) -> str:
    """Write every recorded event as one Chrome trace JSON (one process row per
    GraphOp, one for standalone modules); returns the path.

    With nothing recorded the file is still written (a valid, empty trace), and an
    :class:`EmptyTraceWarning` says why: profiling is off (``atb.init(enable_profiling=
    True)`` before the runs turns it on) or nothing has run since it was turned on."""
    out: list[dict[str, Any]] = []
    evs = events()
    if not evs:
        why = ("profiling is off; call atb.init(enable_profiling=True) before the runs to "
               "record them" if not get_config().enable_profiling else
               "nothing ran since profiling was turned on (or clear_profiles() emptied it)")
        warnings.warn(f"export_chrome_trace({os.fspath(path)!r}): the trace is empty: {why}",
                      EmptyTraceWarning, stacklevel=2)
    origin = min((e.start_ns for _, e in evs), default=0)
    for pid, prof in enumerate(profilers()):
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                    "args": {"name": prof.name}})
        for e in prof.events:
            out.append({"name": e.name, "cat": e.op, "ph": "X", "pid": pid, "tid": e.stream,
                        "ts": (e.start_ns - origin) / 1e3, "dur": e.dur_ns / 1e3,
                        "args": {"op": e.op, "backend": e.backend, "kernel": e.impl,
                                 "launches": e.launches, "run": e.run}})
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
    return path


def profile_table() -> str:
    """Per profiler, a table of per-node mean times (slowest first)."""
    parts = []
    for p in profilers():
        if p.events:
            parts.append(f"[{p.name}]\n{p.table()}")
    return "\n\n".join(parts) if parts else "(no events recorded; atb.init(enable_profiling=True))"


def clear_profiles() -> None:
    """Forget every recorded event."""
    for p in profilers():
        p.clear()
