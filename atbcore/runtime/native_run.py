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
slots, and output slots the program fills before a run) and the pool's thread
count; any other path of it calls ``not_native()`` first. Recording is the call run
as usual, its entry points noting (address, block) as they go, and its ``env``
writes noted by comparing the slots before and after. Everything else (unmarked
calls, a marked call that said ``not_native``) runs through Python between the
native runs. The first run (and the first after the thread count changed) records.

Each later run, before and during a native run: the noted ``env`` writes are made,
and every recorded call with slots is checked against the objects it was recorded
with. A slot the program fills with a fresh tensor before each run (a GraphOp's
output), or that the call reads by address alone, is relocated: its contents mean
nothing to the call's Python, so only its address can matter, and when the recorded
argument blocks held the old address only as whole 8-byte fields (no address inside
it) those fields are patched to the address the slot holds now -- every run, so the
record keeps no reference to such an object (a run's outputs and intermediates are
freed when their last user drops them, not held by the record until the next run).
Other slots are checked by identity against a weak reference (:mod:`.native_held`:
a freed object never matches). A differing object there (a caller's new
token ids) has its call recorded again where it stands (the calls before it made
first, so it sees what it would see call by call). A call whose recording changes shape, or
that says ``not_native`` now, drops the records: the run goes on call by call and
the next run records again. A C call returning a status other than 0 stops the
native run; that call then runs through its Python path (which reports the error
or takes its fallback: the kernels check before they write) and the run goes on
call by call. Frees are not made inside native runs (each slot has one writer,
and the run's env is dropped at its end). A program counted by a LaunchCounter
runs call by call (the counters see each call).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import weakref
from itertools import repeat
from operator import is_, is_not
from typing import Any, Callable, Iterable, Sequence

from .native_held import UNHELD, address_span, held_is, hold, relocated_address, relocations

__all__ = ["NativeRun", "slots_of", "native_call", "not_native", "NATIVE", "address_span"]

# whether programs make their recorded C calls as native runs; ATB_NATIVE_RUN=0 (or
# NATIVE[0] = False) runs every bound call through Python (the per-call path)
NATIVE = [os.environ.get("ATB_NATIVE_RUN", "1").strip().lower() not in ("0", "off", "no")]

_ident = threading.get_ident
_deref = weakref.ref.__call__  # a weak reference's object (None once it died)
_NONES = repeat(None)


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

    __slots__ = ("first", "steps", "pairs", "items", "pre", "flat", "table", "failed", "keep")

    def __init__(self, first: int) -> None:
        self.first = first
        self.steps: list[int] = []       # the step of each pair
        self.pairs: list[tuple[int, bytes]] = []
        # per recorded call: [step, reads, what it keeps of the objects read (see
        # native_held.hold), first pair, pairs, env writes, relocations (slot ->
        # (bytes, [(pair, offset)]), see native_held.relocations)]
        self.items: list[list] = []
        self.pre: list[tuple] = []
        self.flat: tuple | None = None  # see flatten()
        self.table: Any = None
        self.failed = ctypes.c_int64(0)
        self.keep: list[Any] = []  # the argument blocks (ctypes buffers) the table holds

    def add(self, k: int, reads: tuple[int, ...], before: list, rec: list, writes: list,
            needed: set[int], fresh: set[int]) -> None:
        writes = [w for w in writes if w[0] in needed]
        rel = relocations(tuple(i for i in reads if i in fresh), before, rec)
        self.items.append([k, reads, [hold(before[i], i in rel) for i in reads],
                           len(self.pairs), len(rec), writes, rel])
        self.pairs.extend(rec)
        self.steps.extend([k] * len(rec))

    def seal(self) -> None:
        n = len(self.pairs)
        self.table = (ctypes.c_int64 * (3 + 2 * n))()
        self.table[2] = ctypes.addressof(self.failed)
        self.keep = [b for _, b in self.pairs]
        for p, (addr, args) in enumerate(self.pairs):
            self.put(p, addr, args)
        self.order()

    def put(self, p: int, addr: int, args: bytes) -> None:
        block = ctypes.create_string_buffer(args, len(args))  # writable: relocations
        self.table[3 + 2 * p] = addr
        self.table[4 + 2 * p] = ctypes.addressof(block)
        self.keep[p] = block

    def relocate(self, item: list, env: list) -> bool:
        """Patch ``item``'s blocks for this run's objects in its fresh slots; False
        when a differing object is not relocatable (the call is then recorded again)."""
        objs, rel = item[2], item[6]
        for j, i in enumerate(item[1]):
            x = env[i]
            if held_is(x, objs[j]):
                continue
            at = rel.get(i)
            addr = relocated_address(x, at[0]) if at is not None else None
            if addr is None:
                return False
            for p, off in at[1]:
                struct.pack_into("q", self.keep[item[3] + p], off, addr)
        return True

    def order(self) -> None:
        """In step order: the calls to check (those with slots: ``(False, item)``) and
        their env writes (``(True, item)``: read from the item, which a call recorded
        again updates)."""
        pre: list[tuple] = []
        for item in self.items:
            if item[1]:
                pre.append((False, item))
            if item[5]:
                pre.append((True, item))
        self.pre, self.flat = pre, None

    def flatten(self) -> tuple:
        """``(env writes, slots, objects, weak, moves)`` of every item at once: a run
        whose kept slots all hold what was recorded (a decode loop's steps, a GraphOp
        call) checks them in one pass (``slots``/``objects`` held as they are,
        ``weak``: ``(slots, weakrefs)``, see :meth:`alive`), and relocates its relocatable
        slots (``moves``, see :meth:`moved`) without leaving that pass. (Writes first
        is safe: a slot's one writer comes before its readers.) Dropped when an item is
        recorded again."""
        writes = [w for item in self.items for w in item[5]]
        slots: list[int] = []
        objs: list[Any] = []
        weak: list[tuple[int, Any]] = []
        moves: list[tuple] = []
        # a slot many calls read (a step's index tensors, read by every layer) is
        # checked once per entry: weak references to one object are one object; a slot
        # of the writes is not checked at all (the write just made puts there the very
        # object its readers were recorded with)
        seen: set[tuple[int, int]] = set()
        written = {i for i, _ in writes}
        for item in self.items:
            rel = item[6]
            for j, i in enumerate(item[1]):
                h = item[2][j]
                if h is UNHELD:
                    nbytes, at = rel[i]
                    moves.append((i, nbytes, [(self.keep[item[3] + p], off) for p, off in at]))
                    continue
                if i in written or (i, id(h)) in seen:
                    continue
                seen.add((i, id(h)))
                if type(h) is weakref.ref:
                    weak.append((i, h))
                else:
                    slots.append(i)
                    objs.append(h)
        self.flat = (writes, slots, objs, (tuple(i for i, _ in weak),
                                           tuple(r for _, r in weak)) if weak else (), moves)
        return self.flat

    @staticmethod
    def alive(weak: tuple[tuple[int, ...], tuple[Any, ...]], env: list) -> bool:
        """Whether each slot of ``weak`` (slots, their weak references) holds its
        recorded object, still alive (a dead reference gives None, which no slot may
        hold then: checked apart)."""
        objs = list(map(_deref, weak[1]))
        return all(map(is_, map(env.__getitem__, weak[0]), objs)) and \
            all(map(is_not, objs, _NONES))

    @staticmethod
    def moved(moves: list[tuple], env: list) -> bool:
        """Patch the fields of the ``moves`` of :meth:`flatten` to the addresses their
        slots hold now (as :meth:`relocate` does); False when one is not relocatable
        (the run then takes the per-item path, which records that call again)."""
        for i, nbytes, fields in moves:
            addr = relocated_address(env[i], nbytes)
            if addr is None:
                return False
            for block, off in fields:
                struct.pack_into("q", block, off, addr)
        return True


class NativeRun:
    """The recorded native runs of one :class:`~.binding.BoundProgram` (for one pool
    thread count); ``run(env)`` runs the program's steps on a filled ``env``."""

    def __init__(self, steps: Sequence[tuple[Callable[[list], None], tuple[int, ...]]],
                 given: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
                 outputs: Sequence[int], filled: set[int], fresh: Iterable[int] = ()
                 ) -> None:
        from ..backends.cpu_kernels.bindings import SINKS, run_steps

        self.steps = steps
        # what a recorded call is checked on: its input slots, and its output slots the
        # program fills before a run (a fresh output tensor); not the slots it fills
        self.reads = [tuple(dict.fromkeys((*i, *(j for j in o if j in filled))))
                      for i, o in given]
        # the slots read as slots (by a call's inputs, or as outputs): env writes of
        # other slots (views of fixed buffers the binders took as they are) are not
        # made in native runs
        self.needed = set(outputs).union(*(i for i, _ in given))
        self.native = [bool(getattr(c, "native", False)) for c, _ in steps]
        # per step: the slots whose objects a native run may relocate (see the doc): those
        # the program fills with a fresh tensor per run, and those the call reads by address
        fresh = set(fresh)
        self.movable = [fresh.union(getattr(c, "addresses", ())) for c, _ in steps]
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
            writes, slots, objs, weak, moves = op.flat or op.flatten()
            for i, v in writes:
                env[i] = v
            if all(map(is_, map(env.__getitem__, slots), objs)) and \
                    (not weak or op.alive(weak, env)) and (not moves or op.moved(moves, env)):
                self._span(op, env, 0, len(op.pairs))
                continue
            op.flat = None  # relocated or recorded again below
            lo = 0
            for writes, item in op.pre:
                if writes:
                    for i, v in item[5]:
                        env[i] = v
                    continue
                objs = item[2]
                for j, i in enumerate(item[1]):
                    if not held_is(env[i], objs[j]):
                        if item[6] and op.relocate(item, env):
                            break
                        # the calls before it first: recording runs it, as Python would
                        if item[3] > lo and not self._span(op, env, lo, item[3]):
                            return
                        lo = item[3] + item[4]
                        resume = self._again(op, item, env)
                        if resume is not None:
                            self.ops = None
                            self._from(env, resume)
                            return
                        break
            if len(op.pairs) > lo:
                self._span(op, env, lo, len(op.pairs))

    # ------------------------------------------------------------------ helpers
    def _span(self, seg: _Segment, env: list, lo: int, hi: int) -> bool:
        """Make pairs [lo, hi) of ``seg``; False when one returned a status (its call
        then ran through Python, and the rest of the run call by call)."""
        t = seg.table
        t[0], t[1] = lo, hi
        if self._run_steps(t):
            k = seg.steps[seg.failed.value]
            self.steps[k][0](env)
            self._from(env, k + 1)
            return False
        return True

    def _from(self, env: list, k: int) -> None:
        for call, frees in self.steps[k:]:
            call(env)
            for i in frees:
                env[i] = None

    def _rec(self, k: int, env: list) -> tuple[list, list, list] | None:
        """Run call ``k`` noting its C calls and env writes, and the env it was given
        (None: it said not_native, and must run through Python)."""
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

    def _again(self, seg: _Segment, item: list, env: list) -> int | None:
        """Run and record one call again for this run's objects; None when its record
        fits, else the step from which the run goes on through Python."""
        k = item[0]
        # its own writes of the last record may already be in env (a run makes every
        # segment's writes first): cleared, so the record sees the call write them again
        # (a write of the object already there would otherwise go unnoted, and later
        # runs would leave that slot empty)
        for i, _ in item[5]:
            env[i] = None
        got = self._rec(k, env)
        if got is None:
            return k
        rec, writes, before = got
        if len(rec) != item[4]:
            return k + 1
        writes = [w for w in writes if w[0] in self.needed]
        item[6] = relocations(tuple(i for i in item[1] if i in self.movable[k]), before, rec)
        item[2] = [hold(before[i], i in item[6]) for i in item[1]]
        for j, (addr, args) in enumerate(rec):
            seg.put(item[3] + j, addr, args)
        if bool(writes) != bool(item[5]):
            item[5] = writes
            seg.order()
        item[5] = writes
        return None

    def _record(self, env: list) -> None:
        """Run the steps through Python, noting the C calls of the marked ones."""
        ops: list[Any] = []
        seg = _Segment(0)
        for k, (call, frees) in enumerate(self.steps):
            if self.native[k]:
                got = self._rec(k, env)
                if got is not None:
                    seg.add(k, self.reads[k], got[2], got[0], got[1], self.needed,
                            self.movable[k])
                    continue
            if seg.items:
                seg.seal()
                ops.append(seg)
            seg = _Segment(k + 1)
            ops.append(k)
            call(env)
            for i in frees:
                env[i] = None
        if seg.items:
            seg.seal()
            ops.append(seg)
        self.ops = ops


def native_call(call: Callable[[list], None], ok: bool = True,
                addresses: Iterable[int] = ()) -> Callable[[list], None]:
    """Mark bound call ``call`` as recordable (see the module doc) when ``ok``.
    ``addresses``: input slots whose tensors its C calls read through their address
    alone (its Python reads no value of them, and runs through ``not_native`` for one
    that is not contiguous): a native run relocates a new contiguous tensor there as
    it does a fresh output."""
    if ok:
        call.native = True  # type: ignore[attr-defined]
        call.addresses = tuple(addresses)  # type: ignore[attr-defined]
    return call


def not_native() -> None:
    """In a recordable bound call, before a path that is more than its C calls: raises
    while the call is recorded (it then runs through Python this run)."""
    from ..backends.cpu_kernels.bindings import not_native as say

    say()
