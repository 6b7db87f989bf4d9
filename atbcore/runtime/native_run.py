"""A bound program's consecutive C calls made as one native call.

A decode step is ~60 bound C calls of 3-20 us each; the Python around each (the
bound call's closure, its slot reads, the ctypes call) cost 0.5-0.9 ms per step,
20-30% of a 4-bit step. :class:`NativeRun` records the calls once and then makes
each run of consecutive ones with one ``atb_run_steps`` call (csrc/program.c)
over a table of (entry point, argument block) pairs.

Which calls: a bound call marked ``call.native = True`` by its binder promises that
a run of it is, besides writes of ``env`` slots, only C calls through the entry
points (:func:`~atbcore.backends.cpu_kernels.bindings.entry`), whose arguments
depend on nothing but the objects in the slots it is given (``reads``: its inputs'
and outputs' slots) and the pool's thread count; any other path of it calls
``not_native()`` first. Recording runs the call with the entry points appending
their (address, block) instead of calling; its ``env`` writes are noted by
comparing the slots before and after. Everything else (unmarked calls, a marked
call that said ``not_native`` when recorded) runs through Python between the
native runs.

Each run, before a native run: the noted ``env`` writes are made and every
recorded call with slots is checked, by identity, against the objects it was
recorded with (a decode step's token ids and fresh logits buffer change per run:
those calls are recorded again, alone). A call whose recording changes shape, or
that says ``not_native`` now, drops the recording: the rest of the run goes call
by call and the next run records again. A C call returning a status other than 0
stops the native run; that call then runs through its Python path (which reports
the error or takes its fallback: the kernels check before they write) and the
run goes on call by call. Frees are not made inside native runs (each slot has
one writer, and the run's env is dropped at its end). A program counted by a
LaunchCounter runs call by call (the counters see each call).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Callable, Iterable, Sequence

__all__ = ["NativeRun", "slots_of", "native_call", "not_native", "NATIVE"]

# whether programs make their recorded C calls as native runs; ATB_NATIVE_RUN=0 (or
# NATIVE[0] = False) runs every bound call through Python (the per-call path)
NATIVE = [os.environ.get("ATB_NATIVE_RUN", "1").strip().lower() not in ("0", "off", "no")]

_ident = threading.get_ident


def slots_of(given: Iterable[Any]) -> tuple[int, ...]:
    """The slot indices among what a binder was given (tensors, Slots, lists of them;
    or slot indices)."""
    got: list[int] = []
    for v in given:
        for t in (v if type(v) is list else (v,)):
            if type(t) is int:
                got.append(t)
            elif type(t).__name__ == "Slot":
                got.append(t.index)
    return tuple(dict.fromkeys(got))


class _Segment:
    """Consecutive recorded calls: their table, and what a run does before it."""

    __slots__ = ("first", "steps", "pairs", "items", "pre", "table", "failed", "keep")

    def __init__(self, first: int) -> None:
        self.first = first
        self.steps: list[int] = []       # the step of each pair
        self.pairs: list[tuple[int, bytes]] = []
        # per recorded call: [step, reads, objects read, first pair, pairs, env writes]
        self.items: list[list] = []
        self.pre: list[tuple] = []
        self.table: Any = None
        self.failed = ctypes.c_int64(0)
        self.keep: list[bytes] = []

    def add(self, k: int, reads: tuple[int, ...], before: list, rec: list, writes: list,
            needed: set[int]) -> None:
        writes = [w for w in writes if w[0] in needed]
        # a slot empty when the call ran is one a call before it fills: not checked
        reads = tuple(i for i in reads if before[i] is not None)
        self.items.append([k, reads, [before[i] for i in reads], len(self.pairs), len(rec),
                           writes])
        self.pairs.extend(rec)
        self.steps.extend([k] * len(rec))

    def seal(self) -> None:
        n = len(self.pairs)
        self.table = (ctypes.c_int64 * (2 + 2 * n))()
        self.table[0] = n
        self.table[1] = ctypes.addressof(self.failed)
        self.keep = [b for _, b in self.pairs]
        for p, (addr, args) in enumerate(self.pairs):
            self._put(p, addr, args)
        self._pre()

    def _put(self, p: int, addr: int, args: bytes) -> None:
        self.table[2 + 2 * p] = addr
        self.table[3 + 2 * p] = ctypes.cast(ctypes.c_char_p(args), ctypes.c_void_p).value or 0
        self.keep[p] = args

    def _pre(self) -> None:
        """In step order: the env writes, and the calls to check (those with slots)."""
        pre: list[tuple] = []
        for item in self.items:
            if item[1]:
                pre.append((None, item))
            pre.extend(item[5])
        self.pre = pre


class NativeRun:
    """The recorded native runs of one :class:`~.binding.BoundProgram` (for one pool
    thread count); ``run(env)`` runs the program's steps on a filled ``env``."""

    def __init__(self, steps: Sequence[tuple[Callable[[list], None], tuple[int, ...]]],
                 given: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
                 outputs: Sequence[int]) -> None:
        from ..backends.cpu_kernels.bindings import SINKS, run_steps

        self.steps = steps
        self.reads = [(*i, *o) for i, o in given]  # what a recorded call is checked on
        # the slots read as slots (by a call's inputs, or as outputs): env writes of
        # other slots (views of fixed buffers the binders took as they are) are not
        # made in native runs
        self.needed = set(outputs).union(*(i for i, _ in given))
        self.native = [bool(getattr(c, "native", False)) for c, _ in steps]
        self.ops: list[Any] | None = None   # _Segment or a step index (run in Python)
        self.threads = -1
        self._sinks, self._run_steps = SINKS, run_steps

    def run(self, env: list, threads: int) -> None:
        if self._sinks:  # counted: call by call
            self._from(env, 0)
            return
        if self.ops is None or threads != self.threads:
            self.threads = threads
            self._record(env)
            return
        steps = self.steps
        for op in self.ops:
            if type(op) is int:
                call, frees = steps[op]
                call(env)
                for i in frees:
                    env[i] = None
                continue
            for w in op.pre:
                if w[0] is not None:
                    env[w[0]] = w[1]
                    continue
                item = w[1]
                objs = item[2]
                for j, i in enumerate(item[1]):
                    if env[i] is not objs[j]:
                        if not self._again(op, item, env):
                            self.ops = None
                            self._from(env, op.first)
                            return
                        break
            if op.pairs and self._run_steps(op.table):
                self._failed(env, op.steps[op.failed.value])
                return

    # ------------------------------------------------------------------ helpers
    def _from(self, env: list, k: int) -> None:
        for call, frees in self.steps[k:]:
            call(env)
            for i in frees:
                env[i] = None

    def _failed(self, env: list, k: int) -> None:
        """Call ``k`` returned a status: its Python path, then call by call."""
        self.steps[k][0](env)
        self._from(env, k + 1)

    def _rec(self, k: int, env: list) -> tuple[list, list, list] | None:
        """Record call ``k``: its C calls, env writes and the env it was given (None:
        it said not_native)."""
        from ..backends.cpu_kernels.bindings import RECORDING, NotNative

        before = list(env)
        rec: list[tuple[int, bytes]] = []
        tid = _ident()
        RECORDING[tid] = rec
        try:
            self.steps[k][0](env)
        except NotNative:
            return None
        finally:
            del RECORDING[tid]
        return rec, [(i, v) for i, v in enumerate(env) if v is not before[i]], before

    def _again(self, seg: _Segment, item: list, env: list) -> bool:
        """Record one call again for this run's objects; False when it cannot be."""
        got = self._rec(item[0], env)
        if got is None or len(got[0]) != item[4]:
            return False
        rec, writes, before = got
        writes = [w for w in writes if w[0] in self.needed]
        item[2] = [before[i] for i in item[1]]
        for j, (addr, args) in enumerate(rec):
            seg._put(item[3] + j, addr, args)
        if [(i, id(v)) for i, v in writes] != [(i, id(v)) for i, v in item[5]]:
            item[5] = writes
            seg._pre()
        return True

    def _record(self, env: list) -> None:
        """Run the steps, recording the marked calls and making each native run as
        soon as a Python call (or the end) follows it."""
        ops: list[Any] = []
        seg = _Segment(0)
        steps = self.steps
        for k, (call, frees) in enumerate(steps):
            if self.native[k]:
                got = self._rec(k, env)
                if got is not None:
                    seg.add(k, self.reads[k], got[2], got[0], got[1], self.needed)
                    continue
            if not self._flush(seg, ops, env):
                return
            seg = _Segment(k + 1)
            ops.append(k)
            call(env)
            for i in frees:
                env[i] = None
        if self._flush(seg, ops, env):
            self.ops = ops

    def _flush(self, seg: _Segment, ops: list, env: list) -> bool:
        """Make ``seg``'s recorded calls now; False when one failed (the run was then
        finished call by call, and nothing is kept)."""
        if not seg.items:
            return True
        seg.seal()
        ops.append(seg)
        if seg.pairs and self._run_steps(seg.table):
            self.ops = None
            self._failed(env, seg.steps[seg.failed.value])
            return False
        return True


def native_call(call: Callable[[list], None], ok: bool = True) -> Callable[[list], None]:
    """Mark bound call ``call`` as recordable (see the module doc) when ``ok``."""
    if ok:
        call.native = True  # type: ignore[attr-defined]
    return call


def not_native() -> None:
    """In a recordable bound call, before a path that is more than its C calls: raises
    while the call is recorded (it then runs through Python this run)."""
    from ..backends.cpu_kernels.bindings import not_native as say

    say()
