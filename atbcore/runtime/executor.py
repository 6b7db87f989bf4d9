"""The executor: a graph compiled once into a plan of bound kernel calls, then run.

``build_plan(graph, input_descs)`` infers every tensor's descriptor along the schedule,
plans memory, and dispatches each node once (``select_backend``), recording the
kernel that runs, how many device launches it makes and why other backends were
passed over. ``ExecPlan.run(inputs)`` then runs the plan's :class:`BoundProgram` for
the call's exact signature (:mod:`atbcore.runtime.binding`): each kernel bound once to
its buffers, a run a loop of bound calls.

Buffers:

* the memory plan's arena is reserved from the memory pool when the plan is built
  (``arena="auto"``/``"always"``), so a pool too small for a plan raises
  :class:`~atbcore.errors.PoolExhaustedError` there; the block is pinned (views stay
  valid across defragmentation) and given back by :meth:`ExecPlan.release`;
* kernels that bind (or declare ``writes_out``) write intermediates into arena views
  at the planned offsets; a kernel that returns fresh tensors keeps them off the arena,
  and each such intermediate is dropped at its last use;
* graph outputs are never in the arena: each run allocates them, so callers own them.

Threads: a run holds the plan's lock. The plans of one GraphOp share one arena and
that arena's one lock (:mod:`atbcore.memory.plan_arena`), so one GraphOp called from
several threads, with any mix of shapes, gives the serial results; independent
GraphOps run in parallel.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..errors import AtbError, GraphError
from ..graph.analysis import bind_ids, node_error
from ..graph.ir import Graph, Node
from ..ops.base import OpDef
from ..ops.registry import get_op
from ..tensor import TensorDesc, convert, describe
from .binding import plain
from .binding import BoundProgram, bind_program
from .planner import MemoryPlan
from .profiler import NodeEvent, Profiler
from .scheduler import flatten

__all__ = ["BoundCall", "ExecPlan", "build_plan", "infer_descs", "PointHook", "native_weight"]

# (point name, node name, tensors) -> tensors; installed by GraphOp for plugins.
PointHook = Callable[[str, str, list], list]


def _descs_of(slot: Any, descs: Mapping[str, TensorDesc]) -> Any:
    if slot is None:
        return None
    if isinstance(slot, tuple):
        return [descs[s] for s in slot]
    return descs[slot]


def infer_descs(graph: Graph, levels: Sequence[Sequence[Node]],
                input_descs: Mapping[str, TensorDesc]) -> tuple[dict[str, TensorDesc],
                                                                dict[str, dict[str, Any]]]:
    """Descriptors of every tensor id, and each node's input binding, by running
    each op's ``infer_shape`` along the schedule. Errors name the node."""
    descs: dict[str, TensorDesc] = {}
    for w, arr in graph.weights:
        descs[w] = describe(arr)
    for i in graph.inputs:
        if i not in input_descs:
            raise GraphError(graph.name, f"graph input {i!r} not given", "a descriptor", "none")
        descs[i] = input_descs[i]
    bindings: dict[str, dict[str, Any]] = {}
    for n in flatten(levels):
        try:
            opdef = get_op(n.op)
            b = bind_ids(opdef, n, descs)
            for req in opdef.required_inputs:
                if b.get(req) is None:
                    raise GraphError(n.op, f"required input {req!r} missing", "a tensor id", "none")
            outs = opdef.infer_shape(n.params, {k: _descs_of(v, descs) for k, v in b.items()})
        except AtbError as e:
            raise node_error(graph, n, e) from None
        if len(outs) != len(n.outputs):
            raise GraphError(f"{graph.name}/{n.name}", f"{n.op} output count", len(outs),
                             len(n.outputs))
        descs.update(zip(n.outputs, outs))
        bindings[n.name] = b
    return descs, bindings


@dataclass
class BoundCall:
    """One node, dispatched: the kernel to call and where its tensors live."""

    node: str
    op: str
    opdef: OpDef
    params: Any
    fn: Callable
    backend: str
    native: str
    impl: str
    launches: int
    fallbacks: list[tuple[str, list[str]]]
    ins: tuple[tuple[str, Any, bool], ...]   # (input name, slot(s), needs convert)
    names: tuple[str, ...]
    outs: tuple[str, ...]
    frees: tuple[str, ...] = ()
    check: bool = False
    trusted: bool = False  # its graph inputs are all values atb made (build_plan's trusted)
    writes_out: bool = False
    out_offsets: tuple[int | None, ...] = ()
    stream: int = 0
    pre: str | None = None
    post: str | None = None
    bind: Callable | None = None  # the kernel's binder (see atbcore.runtime.binding)
    workspace: tuple[int | None, int] = (None, 0)  # (arena offset, bytes) of its scratch
    layouts: dict[str, str] = field(default_factory=dict)  # weight input -> layout bound


class ProgramKey:
    """A program's input descriptors with their hash computed once (a hot caller keeps
    the key and looks its program up on every run)."""

    __slots__ = ("descs", "_hash")

    def __init__(self, descs: tuple) -> None:
        self.descs, self._hash = descs, hash(descs)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is ProgramKey and self._hash == other._hash
                                 and self.descs == other.descs)


@dataclass
class ExecPlan:
    """A graph compiled for one input signature (or shape bucket); see the module doc."""

    graph: Graph
    levels: list[list[Node]]
    descs: dict[str, TensorDesc]
    memory: MemoryPlan
    calls: list[BoundCall]
    entry_native: str
    device: str
    weights_env: dict[str, Any]
    num_streams: int = 1
    arena_block: Any = None
    arena_note: str = ""
    exact: dict[Any, dict[str, TensorDesc]] = field(default_factory=dict)
    runs: int = 0
    skip_checks: bool = False  # set while capturing a CUDA graph (no host syncs)
    framework: str | None = None  # the caller's framework the plan was dispatched for
    programs: dict[tuple, BoundProgram] = field(default_factory=dict)
    arena_finalizer: Any = None
    weight_arena: Any = None  # hugepages.Arena for the weight layouts binding prepares
    released: bool = False
    lock: Any = field(default_factory=threading.Lock)

    @property
    def launches(self) -> int:
        """Device launches per run: the sum of the chosen kernels' ``launches``
        (fixed once the plan is built: asked on every run)."""
        got = self.__dict__.get("_launches")
        if got is None:
            got = self.__dict__["_launches"] = sum(c.launches for c in self.calls)
        return got

    @property
    def uses_torch(self) -> bool:
        got = self.__dict__.get("_uses_torch")
        if got is None:  # fixed once the plan is built: asked on every run
            got = self.__dict__["_uses_torch"] = any(c.native == "torch" for c in self.calls)
        return got

    def nodes_table(self) -> list[dict[str, Any]]:
        """Per call: node, op, backend, kernel impl, launches, fallback reasons."""
        bound: dict[str, bool] = {}
        for prog in list(self.programs.values())[-1:]:
            bound = prog.bound
        return [{"node": c.node, "op": c.op, "backend": c.backend, "kernel": c.impl,
                 "launches": c.launches, "stream": c.stream,
                 "bound": bound.get(c.node), "layouts": dict(c.layouts),
                 "workspace": c.workspace[1],
                 "fallbacks": ["%s: %s" % (b, "; ".join(r)) for b, r in c.fallbacks]}
                for c in self.calls]

    # ------------------------------------------------------------------ running
    def run(self, inputs: Mapping[str, Any], *, descs: Mapping[str, TensorDesc] | None = None,
            profiler: Profiler | None = None, hook: PointHook | None = None) -> list:
        """Run on backend-native inputs (id -> tensor); returns the graph outputs.
        ``descs`` (exact descriptors of this call) sizes arena views. Without a
        profiler, plugin hook or side streams this runs the bound program."""
        if profiler is None and hook is None and self.num_streams == 1:
            return self._run_program(inputs, descs or self.descs)
        with self.lock:  # node by node (profiled, plugin points, streams): same arena
            if self.uses_torch:
                import torch

                with torch.no_grad():
                    return self._run(inputs, descs, profiler, hook)
            return self._run(inputs, descs, profiler, hook)

    def program(self, descs: Mapping[str, TensorDesc]) -> BoundProgram:
        """The bound program for these exact descriptors (built once, then cached)."""
        key = self.program_key(descs)
        prog = self.programs.get(key)
        if prog is None:
            if len(self.programs) >= _MAX_PROGRAMS:
                self.programs.pop(next(iter(self.programs)))
            from ..memory.hugepages import arena_scope

            with arena_scope(self.weight_arena):  # weight layouts the binders prepare
                prog = self.programs[key] = bind_program(self, descs)
        return prog

    def _run_program(self, inputs: Mapping[str, Any], descs: Mapping[str, TensorDesc]) -> list:
        return self.run_program(self.program_key(descs), descs,
                                [inputs[i] for i in self.graph.inputs])

    def program_key(self, descs: Mapping[str, TensorDesc]) -> "ProgramKey":
        """The key of the bound program for these exact descriptors."""
        return ProgramKey(tuple(descs[i] for i in self.graph.inputs))

    def run_program(self, key: tuple, descs: Mapping[str, TensorDesc] | None,
                    xs: Sequence[Any], keep_outputs: bool = False) -> list | None:
        """Run the bound program ``key`` (built from ``descs`` when missing) on the
        graph inputs ``xs`` (backend-native, in graph order), holding the plan's lock.
        None, running nothing, when the program is gone (plan released, or program
        evicted) and no ``descs`` were given to build it again. ``keep_outputs``: the
        outputs are the program's own buffers (:meth:`.BoundProgram.run`)."""
        with self.lock:
            prog = None if self.released else self.programs.get(key)
            if prog is None:
                if descs is None:
                    return None
                prog = self.program(descs)
            self.runs += 1
            if self.uses_torch and _grad_enabled():
                with _no_grad():
                    return prog.run(xs, keep_outputs)
            return prog.run(xs, keep_outputs)

    def _run(self, inputs: Mapping[str, Any], descs: Mapping[str, TensorDesc] | None,
             profiler: Profiler | None, hook: PointHook | None) -> list:
        env = dict(self.weights_env)
        env.update(inputs)
        streams = self._streams() if self.num_streams > 1 else None
        sync = _synchronizer(self.device) if profiler is not None else None
        run_id = profiler.begin_run() if profiler is not None else 0
        self.runs += 1
        for c in self.calls:
            if profiler is not None:
                sync()
                t0 = profiler.now()
            if streams is not None:
                results = streams.run(c, env, lambda: self._call(c, env, descs, hook))
            else:
                results = self._call(c, env, descs, hook)
            for s, r in zip(c.outs, results):
                env[s] = r
            for s in c.frees:
                env.pop(s, None)
            if profiler is not None:
                sync()
                profiler.record(NodeEvent(c.node, c.op, t0, profiler.now() - t0, run_id,
                                          c.backend, c.impl, c.launches, c.stream))
        outs = [env[o] for o in self.graph.outputs]
        if streams is not None:
            streams.join()
            streams.adopt(outs)
        return outs

    def _call(self, c: BoundCall, env: dict, descs: Mapping[str, TensorDesc] | None,
              hook: PointHook | None) -> list:
        ins: dict[str, Any] = dict.fromkeys(c.names)
        for name, slot, conv in c.ins:
            x = env[slot] if isinstance(slot, str) else [env[s] for s in slot]
            if conv:
                x = convert(x, c.native) if isinstance(slot, str) else [convert(t, c.native)
                                                                         for t in x]
            elif isinstance(slot, str) and slot in self.weights_env and \
                    not getattr(c.fn, "takes_packed", False):
                x = plain(x, c.native)  # a packed weight its kernel does not read
            ins[name] = x
        if hook is not None and c.pre:
            self._apply_pre(c, ins, hook)
        if c.check and not self.skip_checks:
            c.opdef.check_values(c.params, ins)
        if c.writes_out and self.arena_block is not None:
            results = list(c.fn(c.params, ins, out=self._out_views(c, descs)))
        else:
            results = list(c.fn(c.params, ins))
        if len(results) != len(c.outs):
            raise AtbError(c.node, f"{c.backend} kernel {c.impl} returned {len(results)} outputs",
                           len(c.outs), len(results))
        if hook is not None and c.post:
            results = list(hook(c.post, c.node, results))
        return results

    def _apply_pre(self, c: BoundCall, ins: dict, hook: PointHook) -> None:
        # Plugins see the activations a node reads, not its weights.
        names = [n for n, slot, _ in c.ins
                 if isinstance(slot, str) and slot not in self.weights_env]
        new = hook(c.pre, c.node, [ins[n] for n in names])
        for n, t in zip(names, new):
            ins[n] = t

    def _out_views(self, c: BoundCall, descs: Mapping[str, TensorDesc] | None) -> list:
        d = descs or self.descs
        views = []
        for s, off in zip(c.outs, c.out_offsets):
            if off is None:
                views.append(None)
                continue
            v = self.arena_block.view(off, d[s].shape, d[s].dtype)
            views.append(convert(v, c.native))
        return views

    def _streams(self) -> Any:
        from .cuda import StreamRunner

        return StreamRunner(self)

    # ------------------------------------------------------------------ lifetime
    def release(self) -> None:
        """Give the arena block back to its pool (idempotent)."""
        self.released = True
        self.programs.clear()  # they hold views of the arena
        if self.arena_finalizer is not None:
            self.arena_finalizer()  # frees the block, once
        elif self.arena_block is not None and not self.arena_block.freed:
            self.arena_block.free()
        self.arena_block = None


_MAX_PROGRAMS = 8  # exact signatures bound per plan (a bucket's shapes)


def _no_grad() -> Any:
    import torch

    return torch.no_grad()


def _grad_enabled() -> bool:
    """torch's grad mode (a plan that uses torch has imported it)."""
    if not _IS_GRAD_ENABLED:
        import torch

        _IS_GRAD_ENABLED.append(torch.is_grad_enabled)
    return _IS_GRAD_ENABLED[0]()


_IS_GRAD_ENABLED: list[Callable[[], bool]] = []  # torch.is_grad_enabled, once imported


def _synchronizer(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None


# building a plan lives in its own module; callers import it from here
from .plan_build import build_plan, native_weight  # noqa: E402
