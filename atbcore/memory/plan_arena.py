"""``PlanArena``: the one arena the plans of a GraphOp share, reserved from the pool.

A GraphOp keeps a plan per shape bucket (see :mod:`atbcore.runtime.plan_cache`). A
run writes its intermediates into an arena at the offsets the memory planner chose,
so a run needs the arena to itself for its duration. The plans of one GraphOp
therefore run under one lock — this arena's :attr:`PlanArena.lock`, which every
attached plan takes as its own ``plan.lock`` — and, since no two of them ever run at
the same time, they can all write into the same bytes. The arena is sized for the
largest plan attached so far:

* attaching a plan that fits changes nothing;
* attaching a larger one reserves the larger block first (so a pool that cannot hold
  it raises :class:`~atbcore.errors.PoolExhaustedError` with the old block, the old
  plans and the pool untouched), then, holding the lock (no run in flight), points
  every attached plan at the new block, drops their bound programs (they hold views
  of the old block; the next call binds again) and frees the old block to the pool;
* a plan released (evicted from its cache, or dropped) detaches; when the last one
  goes, the block goes back to the pool.

    arena = PlanArena("mlp")
    arena.attach(plan, pool)     # plan.arena_block is arena.block, plan.lock is arena.lock
    arena.stats()                # {"bytes": ..., "plans": ..., "grown": ...}
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["PlanArena"]


class PlanArena:
    """The shared arena of one GraphOp's plans; see the module docstring."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        # held by every run of an attached plan; reentrant, because a garbage collection
        # inside a run or an attach may drop a plan, whose finalizer detaches it here
        self.lock = threading.RLock()
        self.block: Any = None
        self._plans: dict[int, weakref.ref] = {}
        self.grown = 0  # how many times a larger plan replaced the block

    @property
    def nbytes(self) -> int:
        """Bytes of the shared block (0 when no plan holds it)."""
        return 0 if self.block is None else self.block.nbytes

    def attach(self, plan: Any, pool: Any) -> None:
        """Give ``plan`` (an :class:`~atbcore.runtime.executor.ExecPlan` that has not
        run yet) this arena: its lock, and a block of at least its ``arena_bytes``."""
        need = plan.memory.arena_bytes
        with self.lock:
            old = self.block
            if old is None or old.freed or old.pool is not pool or old.nbytes < need:
                new = pool.alloc(max(need, 0 if old is None or old.freed else old.nbytes))
                new = new.pin() if hasattr(new, "pin") else new
                self.block = new
                for other in self._live_plans():
                    other.programs.clear()  # bound to views of the old block
                    other.arena_block = new
                if old is not None:
                    self.grown += 1
                    if not old.freed:
                        old.free()
            plan.arena_block = self.block
            plan.lock = self.lock
            key = id(plan)
            self._plans[key] = weakref.ref(plan)
            plan.arena_note = (f"reserved {self.block.nbytes} B from the pool, shared by the "
                               f"plans of {self.name} (this one needs {need} B)")
            # a plan released or dropped detaches; the last one frees the block
            plan.arena_finalizer = weakref.finalize(plan, self._detach, key)

    def _live_plans(self) -> list[Any]:
        return [p for p in (r() for r in list(self._plans.values())) if p is not None]

    def _detach(self, key: int) -> None:
        with self.lock:
            self._plans.pop(key, None)
            if not self._plans and self.block is not None:
                if not self.block.freed:
                    self.block.free()
                self.block = None

    def stats(self) -> dict[str, int]:
        """``bytes`` of the shared block, attached ``plans``, times ``grown``."""
        with self.lock:
            return {"bytes": self.nbytes, "plans": len(self._plans), "grown": self.grown}
