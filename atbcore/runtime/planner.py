"""The memory planner: a pass over the schedule that places intermediates in one arena.

1. Walk the linear schedule (levels flattened); each tensor gets a liveness interval
   ``[step of its producer, step of its last reader]`` (inclusive, so an op's inputs
   and outputs are live together and never share bytes).
2. Aliases join their root buffer instead of getting one: a ``Reshape`` output and
   every part of a ``Split`` are views of the input, and an output an op declares
   ``inplace`` (``OpDef.inplace``
   maps output index -> input index) is its input. The root's interval is widened
   to cover every alias's readers.
3. Graph inputs, weights and graph outputs (and anything aliasing them) are not
   placed: inputs and weights belong to the caller, outputs are allocated fresh per
   call so callers own them. Tensors whose size is only known at run time (a ``-1``
   dimension) are not placed either.
4. Buffers are placed greedily, largest first, each at the best-fitting gap (the
   smallest gap that holds it) among the buffers already placed whose intervals
   overlap its own; sizes and offsets are 64-byte aligned.

The plan reports ``arena_bytes`` (the arena one run needs) against
``total_intermediate_bytes`` (the sum of the aligned sizes of every placed buffer,
what an arena without reuse would need); ``reuse_ratio`` is their quotient
``total / arena`` (1.0 = no reuse, 2.0 = each arena byte holds two tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import AtbError
from ..graph.ir import Graph, Node
from ..tensor import TensorDesc
from .scheduler import flatten

__all__ = ["MemoryPlan", "plan_memory", "ALIGNMENT", "VIEW_OPS", "workspace_id"]

ALIGNMENT = 64
# Ops whose outputs are views of their first input (a kernel may still copy: the
# input's bytes then merely stay reserved while the parts are read).
VIEW_OPS = frozenset({"Reshape", "Split"})


def _align(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class MemoryPlan:
    """Where each intermediate lives in the arena.

    ``offsets``: buffer tensor id -> byte offset; ``sizes``: id -> aligned bytes;
    ``intervals``: id -> (first step, last step) over the linear schedule for every
    tensor produced by a node; ``aliases``: alias id -> the id whose memory it uses;
    ``external``: produced ids not placed (graph outputs and their aliases, run-time
    sized tensors); ``order``: node names in execution order.
    """

    offsets: dict[str, int]
    arena_bytes: int
    total_intermediate_bytes: int
    reuse_ratio: float
    sizes: dict[str, int] = field(default_factory=dict)
    intervals: dict[str, tuple[int, int]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    external: frozenset[str] = frozenset()
    order: tuple[str, ...] = ()
    alignment: int = ALIGNMENT

    def root(self, tid: str) -> str:
        """The tensor whose memory ``tid`` uses (itself unless it is an alias)."""
        while tid in self.aliases:
            tid = self.aliases[tid]
        return tid

    def offset_of(self, tid: str) -> int | None:
        """Arena offset of ``tid`` (following aliases), or None if not placed."""
        return self.offsets.get(self.root(tid))

    def summary(self) -> str:
        return (f"arena {self.arena_bytes} B for {len(self.offsets)} buffers "
                f"(no-reuse total {self.total_intermediate_bytes} B, reuse x{self.reuse_ratio:.2f})")


def workspace_id(node: str) -> str:
    """The buffer id of a node's workspace (its kernel's scratch) in a memory plan."""
    return f"{node}#workspace"


def _inplace_map(op: str) -> Mapping[int, int]:
    # Unknown op names (hand-built test graphs) simply declare nothing in place.
    try:
        from ..ops.registry import get_op

        return get_op(op).inplace
    except AtbError:
        return {}


def _alias_edges(node: Node) -> dict[str, str]:
    """Output id -> input id for outputs that reuse an input's memory."""
    out: dict[str, str] = {}
    if node.op in VIEW_OPS and node.inputs and node.inputs[0]:
        out.update((o, node.inputs[0]) for o in node.outputs if o)
    for o, i in _inplace_map(node.op).items():
        if o < len(node.outputs) and i < len(node.inputs) and node.inputs[i]:
            out[node.outputs[o]] = node.inputs[i]
    return out


def plan_memory(graph: Graph, levels: Sequence[Sequence[Node]],
                descs: Mapping[str, TensorDesc],
                workspaces: Mapping[str, int] | None = None) -> MemoryPlan:
    """Plan the arena for ``graph`` run in the order of ``levels``.

    ``descs`` gives every tensor's descriptor (sizes come from it); a produced id
    missing from ``descs`` or with a ``-1`` dim is treated as run-time sized.
    ``workspaces`` (node name -> bytes) places each node's kernel scratch, live
    during that node only, as buffer :func:`workspace_id`.
    """
    order = flatten(levels)
    external_src = set(graph.inputs) | {w for w, _ in graph.weights}
    aliases: dict[str, str] = {}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for step, n in enumerate(order):
        for t in n.inputs:
            if t:
                last[t] = max(last.get(t, step), step)
        for t in n.outputs:
            first[t] = step
            last.setdefault(t, step)
        aliases.update(_alias_edges(n))

    def root(t: str) -> str:
        while t in aliases:
            t = aliases[t]
        return t

    # Roots carry the union of their aliases' intervals.
    span: dict[str, tuple[int, int]] = {}
    for t in first:
        r = root(t)
        lo, hi = first.get(r, first[t]), max(last[t], last.get(r, last[t]))
        if r in span:
            lo, hi = min(lo, span[r][0]), max(hi, span[r][1])
        span[r] = (lo, hi)

    outputs = set(graph.outputs)
    pinned = {root(t) for t in outputs} | external_src
    external: set[str] = set()
    sizes: dict[str, int] = {}
    for t in first:
        r = root(t)
        if r in pinned or r != t:
            if r in pinned:
                external.add(t)
            continue
        d = descs.get(t)
        if d is None or any(s < 0 for s in d.shape):
            external.add(t)
            continue
        sizes[t] = _align(max(d.nbytes, 1))

    for step, n in enumerate(order):
        nbytes = (workspaces or {}).get(n.name, 0)
        if nbytes > 0:
            w = workspace_id(n.name)
            sizes[w], span[w] = _align(nbytes), (step, step)
    offsets = _best_fit(sizes, span)
    arena = max((offsets[t] + sizes[t] for t in offsets), default=0)
    total = sum(sizes.values())
    ratio = total / arena if arena else 1.0
    intervals = {t: (first[t], span[root(t)][1] if root(t) in span else last[t]) for t in first}
    return MemoryPlan(offsets=offsets, arena_bytes=arena, total_intermediate_bytes=total,
                      reuse_ratio=ratio, sizes=sizes, intervals=intervals, aliases=aliases,
                      external=frozenset(external), order=tuple(n.name for n in order))


def _best_fit(sizes: Mapping[str, int], span: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """Greedy by size: largest buffer first, into the smallest gap that holds it."""
    placed: list[tuple[int, int, str]] = []  # (offset, size, id)
    offsets: dict[str, int] = {}
    # Ties broken by first use then name, so a plan is deterministic.
    for t in sorted(sizes, key=lambda t: (-sizes[t], span[t][0], t)):
        lo, hi = span[t]
        live = sorted((o, s) for o, s, u in placed if span[u][0] <= hi and lo <= span[u][1])
        best, best_gap, cursor = None, None, 0
        for o, s in live:
            gap = o - cursor
            if gap >= sizes[t] and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, o + s)
        if best is None:
            best = cursor
        offsets[t] = best
        placed.append((best, sizes[t], t))
    return offsets
