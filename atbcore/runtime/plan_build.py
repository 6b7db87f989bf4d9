"""Building an :class:`~atbcore.runtime.executor.ExecPlan`: descriptors along the
schedule, one backend per node (with each kernel's workspace), the memory plan over
the tensors and workspaces, the bound calls, the weights in each kernel's native form,
and the arena reserved from the memory pool. Re-exported by :mod:`.executor`."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping

from ..backends import select_backend
from ..errors import AtbError
from ..graph.analysis import node_error
from ..graph.ir import Graph, Node
from ..ops.base import OpDef
from ..ops.registry import get_op
from ..tensor import TensorDesc, convert
from .binding import binder_of
from .executor import BoundCall, ExecPlan, _descs_of, infer_descs
from .planner import plan_memory, workspace_id
from .scheduler import assign_streams, flatten, schedule

__all__ = ["build_plan", "native_weight"]


def _trusted(n: Node, inputs: Mapping[str, Any], trusted: frozenset[str]) -> bool:
    """Whether node ``n`` reads graph inputs, all of them ``trusted``."""
    read = {i for i in n.inputs if i in inputs}
    return bool(read) and read <= trusted


def build_plan(graph: Graph, input_descs: Mapping[str, TensorDesc], *,
               backend: str | None = None, levels: list[list[Node]] | None = None,
               weights: Callable[[str, str, str], Any] | None = None,
               points: Mapping[str, tuple[str | None, str | None]] | None = None,
               num_streams: int = 1, arena: Any = "auto",
               framework: str | None = None, trusted: frozenset[str] = frozenset()
               ) -> ExecPlan:
    """Compile ``graph`` for ``input_descs`` (graph input id -> descriptor).

    ``backend`` forces one backend (else the dispatcher's priority order);
    ``weights(tensor_id, native, device)`` returns a weight as a native tensor
    (GraphOp caches them so plans share one copy); ``points`` maps node name to its
    plugin points ``(pre, post)``; ``num_streams > 1`` runs independent branches on
    separate CUDA streams (CUDA only; ignored elsewhere); ``arena`` is
    ``"auto" | "always" | "never"`` (see the module docstring) or a
    :class:`~atbcore.memory.plan_arena.PlanArena` the plan joins (one arena for the
    plans of a GraphOp, under one lock); ``framework`` is the
    caller's (framework backends of that framework are asked first). ``trusted``:
    graph inputs whose values atb itself made and checked (a KV cache's index
    tensors): a node reading graph inputs only from this set skips its per-call
    value checks.
    """
    levels = levels if levels is not None else schedule(graph)
    descs, bindings = infer_descs(graph, levels, input_descs)
    order = flatten(levels)
    chosen: dict[str, tuple[Any, list]] = {}
    workspaces: dict[str, int] = {}
    launches: dict[str, int] = {}  # node -> its kernel's launches_for, where it has one
    for n in order:
        opdef = get_op(n.op)
        bdescs = {k: _descs_of(v, descs) for k, v in bindings[n.name].items()}
        try:
            chosen[n.name] = select_backend(opdef, n.params, bdescs, backend, framework)
        except AtbError as e:
            raise node_error(graph, n, e) from None
        k = chosen[n.name][0].kernel(opdef.name)
        shapes = {name: tuple(d.shape) for name, d in bdescs.items()
                  if isinstance(d, TensorDesc)}
        if getattr(k, "workspace", None) is not None:
            workspaces[n.name] = int(k.workspace(n.params, shapes))
        if getattr(k, "launches_for", None) is not None:
            launches[n.name] = int(k.launches_for(n.params, shapes))
    memory = plan_memory(graph, levels, descs, workspaces)
    device = next((input_descs[i].device for i in graph.inputs), "cpu")
    cuda = device.startswith("cuda")
    streams = assign_streams(levels, num_streams) if cuda and num_streams > 1 else {}
    weight_ids = {w for w, _ in graph.weights}
    # Each id's own last reader; dropping a root while a view of it lives is safe
    # (the view holds the storage), so aliases and roots are freed independently.
    last_use: dict[str, int] = {}
    for step, n in enumerate(order):
        for t in n.inputs:
            if t:
                last_use[t] = step
    keep = set(graph.outputs) | weight_ids

    calls: list[BoundCall] = []
    native_of: dict[str, str] = {}
    for step, n in enumerate(order):
        opdef = get_op(n.op)
        b = bindings[n.name]
        be, skipped = chosen[n.name]
        k = be.kernel(opdef.name)
        assert k is not None
        for v in b.values():
            for s in (v if isinstance(v, tuple) else (v,)):
                if s is not None and s not in native_of:
                    native_of[s] = be.native  # weights and inputs: first reader's native
        ins = tuple((name, v, any(native_of[s] != be.native for s in
                                  (v if isinstance(v, tuple) else (v,))))
                    for name, v in b.items() if v is not None)
        for o in n.outputs:
            native_of[o] = be.native
        # Inputs read for the last time here, and outputs nobody reads.
        frees = tuple(sorted({s for s in n.inputs if s and s not in keep and last_use[s] == step}
                             | {o for o in n.outputs if o not in keep and o not in last_use}))
        p, post = (points or {}).get(n.name, (None, None))
        atb_made = _trusted(n, input_descs, trusted)
        calls.append(BoundCall(
            node=n.name, op=n.op, opdef=opdef, params=n.params, fn=k.fn, backend=be.name,
            native=be.native, impl=k.impl, launches=launches.get(n.name, k.launches),
            fallbacks=skipped, ins=ins,
            names=opdef.input_names, outs=n.outputs, frees=frees,
            check=type(opdef).check_values is not OpDef.check_values and not atb_made,
            trusted=atb_made,
            writes_out=bool(getattr(k, "writes_out", False)),
            out_offsets=tuple(memory.offsets.get(o) for o in n.outputs),
            stream=streams.get(n.name, 0), pre=p, post=post, bind=binder_of(k),
            workspace=(memory.offsets.get(workspace_id(n.name)), workspaces.get(n.name, 0))))

    # Inputs enter in torch when a torch kernel runs, in the one framework every
    # kernel shares (a MindSpore or Paddle plan: its tensors reach the kernels, and
    # their bound C calls, as they are), else in NumPy.
    natives = {c.native for c in calls}
    entry = "torch" if "torch" in natives else (natives.pop() if len(natives) == 1 else "numpy")
    for i in graph.inputs:
        native_of.setdefault(i, entry)
    # Inputs arrive in the entry native; re-flag readers that need another one.
    for c in calls:
        c.ins = tuple((nm, v, any((entry if s in input_descs else native_of[s]) != c.native
                                  for s in (v if isinstance(v, tuple) else (v,))))
                      for nm, v, _ in c.ins)
    fetch = weights or _default_weight(graph)
    wenv = {w: fetch(w, native_of.get(w, entry), device) for w in weight_ids if w in native_of}
    plan = ExecPlan(graph=graph, levels=levels, descs=descs, memory=memory, calls=calls,
                    entry_native=entry, device=device, weights_env=wenv,
                    num_streams=max(1, num_streams) if cuda else 1, framework=framework)
    _reserve_arena(plan, arena)
    return plan


def _default_weight(graph: Graph) -> Callable[[str, str, str], Any]:
    wm = graph.weight_map

    def fetch(tid: str, native: str, device: str) -> Any:
        return native_weight(wm[tid], native, device)

    return fetch


def native_weight(arr: Any, native: str, device: str) -> Any:
    """A weight as ``native``'s tensor on ``device`` (done once per plan/GraphOp). A
    torch weight is made outside inference mode even when the first call runs in it
    (``sentence_transformers.encode`` does): kernels that keep a prepared layout of
    a weight need its version counter, which inference tensors lack."""
    packed = type(arr).__name__ == "PackedWeight"  # the layout pass's: kept packed
    if native != "torch":
        return arr.native(native) if packed else convert(arr, native)
    import torch

    with torch.inference_mode(False):
        if packed:
            return arr.native(native)
        t = convert(arr, native)
        if str(t.device) != device and device != "cpu":
            t = t.to(device)
    return t


def _reserve_arena(plan: ExecPlan, arena: Any) -> None:
    if arena == "never" or plan.memory.arena_bytes == 0:
        plan.arena_note = "not reserved" if arena == "never" else "no planned buffers"
        return
    try:
        from ..memory import get_memory_pool

        pool = get_memory_pool()
    except ImportError as e:  # the memory package not present
        plan.arena_note = f"not reserved: no memory pool ({e})"
        return
    if str(pool.device).split(":")[0] != plan.device.split(":")[0]:
        plan.arena_note = f"not reserved: pool on {pool.device}, plan on {plan.device}"
        for c in plan.calls:
            c.writes_out = False
        return
    if not isinstance(arena, str):  # a PlanArena: shared with the GraphOp's other plans
        arena.attach(plan, pool)  # PoolExhaustedError when it cannot grow
        return
    block = pool.alloc(plan.memory.arena_bytes)  # PoolExhaustedError when it cannot
    plan.arena_block = block.pin() if hasattr(block, "pin") else block
    plan.arena_note = f"reserved {plan.memory.arena_bytes} B from the pool"
    # a plan dropped without release() still gives its arena back
    plan.arena_finalizer = weakref.finalize(plan, _free_block, block)


def _free_block(block: Any) -> None:
    if not block.freed:
        block.free()
