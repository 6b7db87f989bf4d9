"""Binding a plan: every kernel bound once to its buffers, so a run is a loop of calls.

:meth:`ExecPlan.program` turns a plan and one exact input signature into a
:class:`BoundProgram` (cached on the plan per signature). Each tensor id gets a home:

* a weight: the plan's native weight tensor (fixed);
* an intermediate that the memory plan placed, produced by a kernel that binds: a view
  of the plan's arena at its offset (fixed; the arena comes from the memory pool);
* everything else — graph inputs, graph outputs, tensors of kernels that return fresh
  tensors — a :class:`Slot`: an index into the list ``env`` that one run fills.

A kernel with a binder is bound once here, ``call = kernel.bind(params, ins, outs,
ctx)`` (ins: name -> tensor | Slot | list | None), then ``call(env)`` each run, and must
write every output it is given (fixed views and slots alike; the program puts a fresh
tensor of the exact shape in an output slot before the run). A binder returns ``None``
for a call it cannot bind (the plan then wraps the kernel's ``fn``). So a run is ``for
step in steps: step(env)``: no per-node dispatch, dict building or shape logic, and the
arena views are made once. A program writes the plan's arena, so one plan runs one
program at a time: the plan's lock is held for the run (:meth:`ExecPlan.run`), and
concurrent calls of one GraphOp give exactly the serial results.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..dtypes import Dtype
from ..errors import AtbError
from ..tensor import TensorDesc, convert, copy_into
from .allocate import empty_allocator
from .native_run import NATIVE, NativeRun, slots_of

__all__ = ["Slot", "BindContext", "BoundProgram", "bind_program", "resolve", "getter",
           "same_objects", "binder_of", "view_binder", "POOL_ROWS_MAX"]

# the C matmul splits up to this many rows over atb's pool (more go to torch's team)
POOL_ROWS_MAX = 64


@dataclass(frozen=True, slots=True)
class Slot:
    """A tensor that changes per run: ``env[index]``, described by ``desc``."""

    index: int
    desc: TensorDesc


@dataclass
class BindContext:
    """What a binder gets besides its tensors: the node's name, its ``workspace`` (a
    uint8 tensor in the plan's arena of the bytes the kernel's ``workspace`` asked
    for, or None), where it records the layout it reads each weight in, and
    ``trusted``: the node's graph inputs are values atb itself made and checked (a
    KV cache's index tensors), so the kernel may skip its own per-call value checks."""

    node: str
    workspace: Any = None
    layouts: dict[str, str] | None = None
    pool_rows: list[int] | None = None
    trusted: bool = False

    def note_layout(self, name: str, layout: str) -> None:
        """Say that weight input ``name`` is read as ``layout`` (shown by explain())."""
        if self.layouts is not None:
            self.layouts[name] = layout

    def note_pool_rows(self, rows: int) -> None:
        """Say that the bound call runs a C matmul of ``rows`` rows on atb's thread pool
        (a program whose matmuls are all few-row runs with torch's pool parked)."""
        if self.pool_rows is not None:
            self.pool_rows.append(int(rows))

    def note_torch_pool(self) -> None:
        """Say that the bound call runs a big job on torch's intra-op pool (oneDNN): its
        program runs unparked (parked, MiniLM's oneDNN ran on one thread: 0.5x HF)."""
        self.note_pool_rows(POOL_ROWS_MAX + 1)


def resolve(v: Any, env: Sequence[Any]) -> Any:
    """The tensor a binder was given: ``env[v.index]`` for a :class:`Slot`, else ``v``."""
    return env[v.index] if type(v) is Slot else v


def getter(v: Any) -> Callable[[Sequence[Any]], Any]:
    """``env -> tensor`` for what a binder was given (read per run for a :class:`Slot`,
    the fixed tensor itself otherwise): :func:`resolve` with the branch taken once."""
    return (lambda env, i=v.index: env[i]) if type(v) is Slot else (lambda env: v)


def same_objects(a: Sequence[Any], b: Sequence[Any] | None) -> bool:
    """Whether ``b`` holds the very objects of ``a`` (binders repack a C call when the
    tensors they were fed change, e.g. a cache that grew)."""
    return b is not None and all(x is y for x, y in zip(a, b))


@dataclass
class BoundProgram:
    """One plan bound to one exact signature; ``run(inputs) -> outputs``.

    ``steps``: per node ``(call, frees)``; ``allocs``: output slots the program fills
    with fresh tensors before a run; ``bound``: node name -> True when its kernel's
    binder took it (else its ``fn`` is wrapped); ``kept``: graph output slot -> the
    buffer of ``keep_outputs`` runs."""

    input_slots: tuple[int, ...]
    output_slots: tuple[int, ...]
    size: int
    steps: list[tuple[Callable[[list], None], tuple[int, ...]]]
    allocs: list[tuple[int, Callable[[], Any]]]
    bound: dict[str, bool]
    park: bool = False
    native: Any = None  # the NativeRun of its C calls (native_run.py), made on first run
    kept: dict[int, Any] = field(default_factory=dict)

    def run(self, inputs: Sequence[Any], keep_outputs: bool = False) -> list:
        """Outputs for graph inputs ``inputs``: fresh tensors, or (``keep_outputs``) the
        program's own buffers, which its next such run overwrites (a decode loop's
        logits: its native run then needs no recording again)."""
        if self.park:
            # torch's OpenMP workers spin after each parallel op and would hold the cores
            # the C matmuls' pool needs (see cpu_kernels.threads)
            with (_THREADS or _threads()).parked_torch_threads():
                return self._run(inputs, keep_outputs)
        return self._run(inputs, keep_outputs)

    def _run(self, inputs: Sequence[Any], keep_outputs: bool = False) -> list:
        env: list[Any] = [None] * self.size
        for i, x in zip(self.input_slots, inputs):
            env[i] = x
        kept = self.kept if keep_outputs else None
        for i, alloc in self.allocs:
            env[i] = alloc() if kept is None or i not in self.output_slots else \
                kept[i] if i in kept else kept.setdefault(i, alloc())
        if self.native is not None and NATIVE[0]:
            self.native.run(env, (_THREADS or _threads()).pool_threads())
            return [env[i] for i in self.output_slots]
        for call, frees in self.steps:
            call(env)
            for i in frees:
                env[i] = None
        return [env[i] for i in self.output_slots]


_THREADS: Any = None  # atbcore.backends.cpu_kernels.threads, imported at the first run


def _threads() -> Any:
    """The C kernels' thread module (it imports torch: not at this module's import; an
    import statement per run costs more than the lookup)."""
    global _THREADS
    from ..backends.cpu_kernels import threads

    _THREADS = threads
    return threads


def view_binder(view: Callable[[Any, Any], list]) -> Callable[..., Any]:
    """The binder of a zero-copy view kernel ``view(params, ins) -> [out]`` (a front-end's
    Reshape): the view of a planned (fixed) buffer is made once, so the ops reading it
    bind to the view itself and a run makes none; an input in a slot gets its view per
    run. Kernels of whole tensors only (``x`` in, one output)."""
    def bind(p: Any, ins: Any, outs: list, ctx: Any) -> Any:
        x, o = ins["x"], outs[0]
        if type(o) is not Slot:
            return None
        j = o.index
        if type(x) is Slot:
            i = x.index

            def call(env: list) -> None:
                env[j] = view(p, {"x": env[i]})[0]
            return call
        v = view(p, {"x": x})[0]

        def fixed(env: list) -> None:
            env[j] = v
        fixed.fixed_out = [v]  # type: ignore[attr-defined]  # readers bind to the view itself
        return fixed

    bind.fills_slots = True  # type: ignore[attr-defined]
    return bind


def binder_of(kernel: Any) -> Callable[..., Any]:
    """The kernel's binder: its own ``bind``, else a generic one around ``fn``. A
    ``writes_out`` kernel gets its bound buffers as ``out``; a kernel returning fresh
    tensors has them copied into its arena buffers (so intermediates live in the pool's
    memory either way) and left as they are for outputs in slots (nothing to copy)."""
    own = getattr(kernel, "bind", None)
    if own is not None:
        return own
    fn, writes_out = kernel.fn, bool(getattr(kernel, "writes_out", False))

    def bind(params: Any, ins: Mapping[str, Any], outs: list, ctx: BindContext
             ) -> Callable[[list], None]:
        items = tuple(ins.items())
        fixed = all(type(v) is not Slot and type(v) is not list for _, v in items)
        if writes_out and fixed and not any(type(o) is Slot for o in outs):
            fixed_ins, fixed_outs = dict(items), list(outs)

            def call_fixed(env: list) -> None:
                for o, r in zip(fixed_outs, fn(params, fixed_ins, out=fixed_outs)):
                    if r is not o:
                        copy_into(o, r)
            return call_fixed

        def call(env: list) -> None:
            got = {n: ([resolve(t, env) for t in v] if type(v) is list else resolve(v, env))
                   for n, v in items}
            if writes_out:
                bufs = [resolve(o, env) for o in outs]
                results = fn(params, got, out=bufs)
            else:
                results = fn(params, got)
            if len(results) != len(outs):
                raise AtbError(ctx.node, f"kernel returned {len(results)} outputs", len(outs),
                               len(results))
            for o, r in zip(outs, results):
                if type(o) is Slot:
                    if writes_out and r is not env[o.index]:
                        copy_into(env[o.index], r)
                    elif not writes_out:
                        env[o.index] = r
                elif r is not o:
                    copy_into(o, r)
        return call

    # a binder that sets its output slots itself needs no buffers made for them
    bind.fills_slots = not writes_out  # type: ignore[attr-defined]
    return bind


def bind_program(plan: Any, exact: Mapping[str, TensorDesc]) -> BoundProgram:
    """Bind ``plan`` (an :class:`~atbcore.runtime.executor.ExecPlan`) for the exact
    descriptors ``exact`` (every tensor id of this call's shapes)."""
    slots: dict[str, int] = {}

    def slot(tid: str) -> int:
        if tid not in slots:
            slots[tid] = len(slots)
        return slots[tid]

    graph = plan.graph
    for i in graph.inputs:
        slot(i)
    outputs = set(graph.outputs)
    fixed: dict[str, Any] = dict(plan.weights_env)
    allocs: list[tuple[int, Callable[[], Any]]] = []
    steps: list[tuple[Callable[[list], None], tuple[int, ...]]] = []
    reads: list[tuple[int, ...]] = []
    bound: dict[str, bool] = {}
    pool_rows: list[int] = []
    unpacked: dict[int, Any] = {}  # packed weights a kernel reads as plain tensors
    for c in plan.calls:
        binder = c.bind if not any(conv for _, _, conv in c.ins) else None
        if binder is not None and not getattr(binder, "takes_packed", False):
            ins_fixed = _plain_weights(c, fixed, unpacked)
        else:
            ins_fixed = fixed
        call, given = None, ()
        if binder is not None:
            outs: list[Any] = []
            views: dict[str, Any] = {}
            for o, off in zip(c.outs, c.out_offsets):
                if off is not None and plan.arena_block is not None and o not in outputs:
                    views[o] = convert(plan.arena_block.view(off, exact[o].shape, exact[o].dtype),
                                       c.native)
                    outs.append(views[o])
                else:
                    outs.append(Slot(slot(o), exact[o]))
            ins = {n: _home(v, ins_fixed, slot, exact) for n, v, _ in c.ins}
            off, nbytes = c.workspace
            ws = None
            if off is not None and plan.arena_block is not None:
                ws = convert(plan.arena_block.view(off, (nbytes,), Dtype.UINT8), c.native)
            call = binder(c.params, {**dict.fromkeys(c.names), **ins}, outs,
                          BindContext(c.node, ws, c.layouts, pool_rows, c.trusted))
            given = (slots_of(ins.values()), slots_of(outs))
            if call is not None:
                fixed.update(views)
                # a view of a fixed buffer is fixed too: later binders get the tensor
                made = getattr(call, "fixed_out", None)
                if made is not None:
                    fixed.update((o, v) for o, v in zip(c.outs, made)
                                 if v is not None and o not in outputs)
                if not getattr(binder, "fills_slots", False):
                    allocs.extend((o.index, empty_allocator(c.native, o.desc)) for o in outs
                                  if type(o) is Slot)
                if c.check and not getattr(binder, "checks_values", False):
                    call = _checked(plan, c, ins, call)
        bound[c.node] = call is not None
        if call is None:
            call = _generic(plan, c, _plain_weights(c, fixed, unpacked), slot, exact)
            given = (slots_of(slots[t] for _, v, _ in c.ins for t in
                              (v if isinstance(v, tuple) else (v,)) if t in slots), ())
        steps.append((call, tuple(slots[s] for s in c.frees if s in slots and s not in outputs)))
        reads.append(given)
    # graph outputs that are graph inputs or weights pass straight through
    for o in graph.outputs:
        if o in fixed and o not in slots:
            v = fixed[o]
            steps.append((lambda env, i=slot(o), v=v: env.__setitem__(i, v), ()))
            reads.append(((), ()))
    prog = BoundProgram(input_slots=tuple(slots[i] for i in graph.inputs),
                        output_slots=tuple(slots[o] for o in graph.outputs), size=len(slots),
                        steps=steps, allocs=allocs, bound=bound,
                        park=bool(pool_rows) and max(pool_rows) <= POOL_ROWS_MAX)
    if any(getattr(call, "native", False) for call, _ in steps):
        fresh = [i for i, _ in allocs]
        prog.native = NativeRun(steps, reads, prog.output_slots, {*prog.input_slots, *fresh}, fresh)
    return prog


def plain(v: Any, native: str) -> Any:
    """``v`` as a plain tensor: a layout pass's packed weight unpacked (a copy), in
    ``native``; anything else as it is."""
    if type(v).__name__ != "PackedWeight":
        return v
    from ..graph.packed import unpack

    return convert(unpack(v), native)


def _plain_weights(c: Any, fixed: dict, unpacked: dict[int, Any]) -> dict:
    """``fixed`` with the packed weights node ``c`` reads unpacked (once per program:
    its kernel does not read the packed layout)."""
    out = None
    for _, v, _ in c.ins:
        for s in (v if isinstance(v, tuple) else (v,)):
            w = fixed.get(s)
            if type(w).__name__ == "PackedWeight":
                if id(w) not in unpacked:
                    unpacked[id(w)] = (w, plain(w, c.native))
                out = dict(fixed) if out is None else out
                out[s] = unpacked[id(w)][1]
    return fixed if out is None else out


def _checked(plan: Any, c: Any, ins: Mapping[str, Any], call: Callable[[list], None]
             ) -> Callable[[list], None]:
    """``call`` preceded by the op's per-call value checks (indices in range, ...)."""
    check, params, names = c.opdef.check_values, c.params, c.names
    plan = weakref.proxy(plan)  # a program must not keep its plan (and arena) alive

    def checked(env: list) -> None:
        if not plan.skip_checks:
            got = dict.fromkeys(names)
            for n, v in ins.items():
                got[n] = [resolve(t, env) for t in v] if type(v) is list else resolve(v, env)
            check(params, got)
        call(env)
    return checked


def _home(v: Any, fixed: Mapping[str, Any], slot: Callable[[str], int],
          exact: Mapping[str, TensorDesc]) -> Any:
    if isinstance(v, tuple):
        return [_home(s, fixed, slot, exact) for s in v]
    if v in fixed:
        return fixed[v]
    return Slot(slot(v), exact[v])


def _generic(plan: Any, c: Any, fixed: Mapping[str, Any], slot: Callable[[str], int],
             exact: Mapping[str, TensorDesc]) -> Callable[[list], None]:
    """A node whose kernel does not bind: its ``fn`` called with the inputs gathered
    from their homes; the returned tensors go to the outputs' slots."""
    gets: list[tuple[str, Any, bool]] = []
    for name, v, conv in c.ins:
        gets.append((name, _home(v, fixed, slot, exact), conv))
    outs = tuple(slot(o) for o in c.outs)
    names, fn, params, native, node = c.names, c.fn, c.params, c.native, c.node
    check = c.opdef.check_values if c.check else None
    plan = weakref.proxy(plan)  # a program must not keep its plan (and arena) alive
    views = None
    if c.writes_out and plan.arena_block is not None and any(
            off is not None for off in c.out_offsets):
        views = [None if off is None or o in plan.graph.outputs else convert(
            plan.arena_block.view(off, exact[o].shape, exact[o].dtype), native)
            for o, off in zip(c.outs, c.out_offsets)]

    def call(env: list) -> None:
        ins: dict[str, Any] = dict.fromkeys(names)
        for name, h, conv in gets:
            x = [resolve(t, env) for t in h] if type(h) is list else resolve(h, env)
            if conv:
                x = [convert(t, native) for t in x] if type(x) is list else convert(x, native)
            ins[name] = x
        if check is not None and not plan.skip_checks:
            check(params, ins)
        results = fn(params, ins, out=list(views)) if views is not None else fn(params, ins)
        if len(results) != len(outs):
            raise AtbError(node, f"{c.backend} kernel {c.impl} returned {len(results)} outputs",
                           len(outs), len(results))
        for i, r in zip(outs, results):
            env[i] = r

    return call
