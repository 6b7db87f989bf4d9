"""A GraphOp's hot call: the last plain call's bound program again (a mixin).

After a call through the general path with no plugin, profiler, CUDA graph or output
tensors, the GraphOp remembers ``_hot = (raw signature, plan, program key,
framework)``. A call with the same raw signature (type, shape, dtype, device of each
input: what picks the plan) runs that program directly while :meth:`hot_ready` holds.
Front-ends with their own guards (``atb_torch``'s ``FastCall``, which also knows its
weights are unchanged) call the program themselves after :meth:`hot_ready` and report
the run with :meth:`note_hot_run`.
"""

from __future__ import annotations

from typing import Any

from ..runtime.config import get_config
from ..tensor import convert, raw_signature

__all__ = ["GraphOpHot", "RememberedCall"]


class GraphOpHot:
    """The hot-call half of :class:`~atbcore.graph.graph_op.GraphOp` (state lives there)."""

    def hot_ready(self) -> bool:
        """Whether the remembered program may run as is now: the GraphOp is alive and
        no plugin or profiler has to see the run."""
        return not (self._destroyed or self._plugins_active() or self._profiling())

    def note_hot_run(self, plan: Any) -> None:
        """Record a run of ``plan``'s remembered program made by a front-end (what
        :meth:`_run_hot` records: a plan-cache hit, the last plan and its launches)."""
        if self._cache is not None:
            self._cache.hits += 1
        self.last_plan, self.last_launches = plan, plan.launches

    def _run_hot(self, inputs: list, raw_now: tuple | None = None, keep: bool = False) -> Any:
        """The last call's bound program again, when this call has its signature and
        nothing else could change what runs (no plugins, profiling or CUDA graphs, the
        plan still cached): no descriptors, lookups or conversions of same-framework
        tensors (``keep``: into the program's own output buffers). None: general path."""
        hot = self._hot
        if hot is None:
            return None
        raw, plan, key, framework = hot
        if raw_now is None:
            raw_now = raw_signature(inputs)
        if plan.released or raw is None or not self.hot_ready():
            return None
        if raw_now is not raw:
            if raw_now != raw:
                return None
            # keep the caller's equal signature: a feeder that hands the same one each
            # step (a decode loop's) is then matched by identity, not element by element
            self._hot = (raw_now, plan, key, framework)
        entry = plan.entry_native
        xs = inputs if framework == entry else [convert(x, entry) for x in inputs]
        outs = plan.run_program(key, None, xs, keep)
        if outs is None:  # released or evicted meanwhile: the general path
            return None
        self.note_hot_run(plan)
        return outs if framework == entry else [convert(o, framework) for o in outs]

    def _profiling(self) -> bool:
        return bool(self.profile if self.profile is not None else get_config().enable_profiling)


class RememberedCall:
    """The core half of a front-end's guarded fast call: the bound program the core
    GraphOp ``core`` remembered for ``inputs`` (its last plain call), run again by
    :meth:`run` while :meth:`GraphOpHot.hot_ready` holds. The front-end guards
    everything else that decides the result (its inputs' signature, its weights)."""

    __slots__ = ("core", "plan", "key")

    def __init__(self, core: Any, plan: Any, key: Any) -> None:
        self.core, self.plan, self.key = core, plan, key

    @classmethod
    def of(cls, core: Any, inputs: list) -> "RememberedCall | None":
        """The program ``core`` remembered, when it was for inputs of ``inputs``'s
        raw signature and takes them as they are (no conversion); else None."""
        hot = core._hot if core is not None else None
        if hot is None or core.cuda_graph:
            return None
        raw, plan, key, framework = hot
        if raw is None or framework != plan.entry_native or raw != raw_signature(inputs):
            return None
        return cls(core, plan, key)

    def run(self, inputs: Any) -> list | None:
        """The outputs (fresh tensors of the inputs' framework), or None: a plugin or
        profiler must see the run, the GraphOp was destroyed, or the program is gone."""
        core = self.core
        if not core.hot_ready():
            return None
        outs = self.plan.run_program(self.key, None, inputs)
        if outs is not None:
            core.note_hot_run(self.plan)
        return outs
