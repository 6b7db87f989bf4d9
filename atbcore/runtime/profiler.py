"""Per-node profiling of plan runs, exportable as a Chrome trace (Perfetto opens it).

The executor records one :class:`NodeEvent` per bound call when profiling is on
(``atbcore.get_config().enable_profiling`` or ``profile=True``). On CUDA each node is
bracketed by device synchronisations so its time is the device time of its kernels,
not the time to enqueue them; this slows the run, as profiling should be opt-in.

    prof = Profiler()
    ...run with profiler=prof...
    prof.export_chrome_trace("trace.json")   # {"traceEvents": [{"ph": "X", ...}, ...]}
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NodeEvent", "Profiler"]


@dataclass(frozen=True)
class NodeEvent:
    """One node's run: wall-clock start and duration in nanoseconds."""

    name: str
    op: str
    start_ns: int
    dur_ns: int
    run: int
    backend: str = ""
    impl: str = ""
    launches: int = 0
    stream: int = 0
    args: dict[str, Any] = field(default_factory=dict)


class Profiler:
    """Collects :class:`NodeEvent` s across runs of one or more plans."""

    def __init__(self, name: str = "atb") -> None:
        self.name = name
        self.events: list[NodeEvent] = []
        self.runs = 0
        self._origin = time.perf_counter_ns()

    def now(self) -> int:
        return time.perf_counter_ns()

    def begin_run(self) -> int:
        """Start a new run; returns its index (used as the trace's thread row)."""
        self.runs += 1
        return self.runs - 1

    def record(self, event: NodeEvent) -> None:
        self.events.append(event)

    def clear(self) -> None:
        self.events.clear()
        self.runs = 0

    # ------------------------------------------------------------------ reports
    def totals(self) -> dict[str, dict[str, float]]:
        """Per node name: ``{"calls", "total_us", "mean_us"}`` over all runs."""
        out: dict[str, dict[str, float]] = {}
        for e in self.events:
            d = out.setdefault(e.name, {"calls": 0, "total_us": 0.0})
            d["calls"] += 1
            d["total_us"] += e.dur_ns / 1e3
        for d in out.values():
            d["mean_us"] = d["total_us"] / d["calls"]
        return out

    def table(self) -> str:
        """A text table of per-node mean times, slowest first."""
        rows = sorted(self.totals().items(), key=lambda kv: -kv[1]["total_us"])
        lines = [f"{'node':32} {'calls':>6} {'mean us':>10} {'total us':>10}"]
        for name, d in rows:
            lines.append(f"{name[:32]:32} {int(d['calls']):6d} {d['mean_us']:10.1f} "
                         f"{d['total_us']:10.1f}")
        return "\n".join(lines)

    def to_chrome_trace(self) -> dict[str, Any]:
        """The trace as a dict in the Chrome trace event format: complete events
        (``"ph": "X"``) with microsecond ``ts``/``dur``; one process per profiler,
        one thread row per stream."""
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": self.name}}]
        streams = sorted({e.stream for e in self.events})
        for s in streams:
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": s,
                           "args": {"name": f"stream {s}"}})
        for e in self.events:
            args = {"op": e.op, "backend": e.backend, "kernel": e.impl, "launches": e.launches,
                    "run": e.run, **e.args}
            events.append({"name": e.name, "cat": e.op, "ph": "X", "pid": 0, "tid": e.stream,
                           "ts": (e.start_ns - self._origin) / 1e3, "dur": e.dur_ns / 1e3,
                           "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def export_chrome_trace(self, path: str | os.PathLike) -> str:
        """Write the trace JSON to ``path`` (open it at ui.perfetto.dev); returns the path."""
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(), f, default=str)
        return path
