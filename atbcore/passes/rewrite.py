"""Fusion rules as data, and the one driver that applies them.

A :class:`FusionRule` is ``(name, switch, pattern, rewrite)``: ``pattern`` (see
:mod:`atbcore.passes.pattern`) is matched at every node whose op can be its root;
``rewrite(match)`` returns a :class:`Rewrite` (nodes to add, nodes to remove,
new weights) or ``None`` for "no match". ``switch`` names the
:class:`~atbcore.passes.pipeline.FusionConfig` flag that turns it on (None: on
whenever its ``level`` is reached).

The driver (:func:`apply_rule`) keeps rewrites safe whatever the rule does: a
rewrite is refused (as if it returned None) when a tensor that a removed node
produced is still read by a remaining node or is a graph output and no added
node produces it, when an added id collides with an existing one, or when the
result would be cyclic. Added nodes take the root's place; the node order stays
topological and otherwise stable.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import AtbError, GraphError
from ..graph.analysis import canonical_op, infer_descs, toposort_nodes
from ..graph.ir import Graph, Node
from ..ops.base import Params
from ..ops.registry import get_op
from ..tensor import TensorDesc, to_numpy
from .pattern import Match, Pat, match_node, root_ops

__all__ = ["FusionRule", "Rewrite", "RewriteContext", "apply_rule", "LEVELS", "concat_weights",
           "weight_memo", "packed_once", "identity", "same_dtype", "in_consumers_only"]

LEVELS = {"conservative": 0, "standard": 1, "aggressive": 2}


@dataclass(frozen=True)
class Rewrite:
    """What a rule does with a match: ``add`` these nodes (at the root's place),
    ``remove`` these node names (None: every node the pattern matched) and add
    ``weights`` ((id, array) pairs, e.g. weights concatenated at build time)."""

    add: tuple[Node, ...]
    remove: tuple[str, ...] | None = None
    weights: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class FusionRule:
    """A fusion: ``name``, the config ``switch`` enabling it, the ``pattern`` and
    the ``rewrite`` function; ``level`` is the lowest fusion level that runs it,
    ``requires`` the ops its rewrite emits (the rule is skipped while one is not
    registered), ``doc`` one line for reports."""

    name: str
    switch: str | None
    pattern: Pat
    rewrite: Callable[[Match], Rewrite | None]
    level: str = "standard"
    requires: tuple[str, ...] = ()
    doc: str = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise GraphError(f"FusionRule {self.name}", "level", list(LEVELS), repr(self.level))


class RewriteContext:
    """What a rewrite may ask about the graph being rewritten."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.producers: dict[str, tuple[Node, int]] = {
            t: (n, i) for n in graph.nodes for i, t in enumerate(n.outputs)}
        self._consumers = graph.consumers()
        self._weights = graph.weight_map
        self._names = {n.name for n in graph.nodes} | set(self.producers) | set(
            graph.inputs) | set(self._weights)
        try:
            self.descs: dict[str, TensorDesc] = infer_descs(graph, partial=True)
        except AtbError:
            self.descs = {}

    def desc(self, tid: str) -> TensorDesc | None:
        """The descriptor of ``tid`` when known."""
        return self.descs.get(tid)

    def weight(self, tid: str) -> np.ndarray | None:
        """The constant value of ``tid`` as a NumPy array, or None if not a weight."""
        if tid not in self._weights:
            return None
        return to_numpy(self._weights[tid])

    def is_weight(self, tid: str) -> bool:
        return tid in self._weights

    def scalar(self, tid: str) -> float | None:
        """The value of a one-element weight, else None."""
        w = self.weight(tid)
        if w is None or w.size != 1:
            return None
        return float(np.asarray(w, dtype=np.float64).reshape(()))

    def consumers(self, tid: str) -> list[Node]:
        return list(self._consumers.get(tid, ()))

    def producer(self, tid: str) -> Node | None:
        p = self.producers.get(tid)
        return p[0] if p else None

    def is_output(self, tid: str) -> bool:
        return tid in self.graph.outputs

    def fresh(self, base: str) -> str:
        """A node name / tensor id not used in the graph (``base`` when free)."""
        if base not in self._names:
            self._names.add(base)
            return base
        k = 1
        while f"{base}_{k}" in self._names:
            k += 1
        self._names.add(f"{base}_{k}")
        return f"{base}_{k}"

    @staticmethod
    def params(op: str, **values: Any) -> Params:
        """Params of ``op`` from field values."""
        return get_op(op).make_params(values)


def _apply(graph: Graph, m: Match, rw: Rewrite) -> Graph | None:
    remove = set(rw.remove if rw.remove is not None else (n.name for n in m.matched))
    kept = [n for n in graph.nodes if n.name not in remove]
    gone = {t for n in graph.nodes if n.name in remove for t in n.outputs}
    new_out = {t for n in rw.add for t in n.outputs}
    taken = ({t for n in kept for t in n.outputs} | set(graph.inputs)
             | {w for w, _ in graph.weights})
    names = {n.name for n in kept}
    if new_out & taken or any(n.name in names for n in rw.add):
        return None
    if any(w in taken or w in new_out for w, _ in rw.weights):
        return None
    for n in kept:
        if any(t in gone and t not in new_out for t in n.inputs):
            return None
    if any(o in gone and o not in new_out for o in graph.outputs):
        return None
    # the added nodes go where the root was (its position among the kept nodes)
    pos = sum(1 for n in graph.nodes[:graph.nodes.index(m.root)] if n.name not in remove)
    nodes = kept[:pos] + list(rw.add) + kept[pos:]
    weights = tuple(graph.weights) + tuple(rw.weights)
    order = toposort_nodes(nodes, set(graph.inputs) | {w for w, _ in weights})
    if order is None:
        return None
    return graph.replace(nodes=tuple(order), weights=weights)


def apply_rule(graph: Graph, rule: FusionRule, max_rewrites: int | None = None,
               cleanup: Callable[[Graph], Graph] | None = None) -> tuple[Graph, list[str]]:
    """Apply ``rule`` wherever it matches until it matches nowhere; returns the
    graph and one line per rewrite (the nodes replaced and what replaced them).
    ``cleanup`` (dead-code elimination in the pipeline) runs after each rewrite,
    so views a rewrite left without readers do not block the next match."""
    ops = root_ops(rule.pattern)
    done: list[str] = []
    limit = max_rewrites if max_rewrites is not None else 4 * len(graph.nodes) + 16
    while len(done) < limit:
        ctx = RewriteContext(graph)
        new = None
        for node in graph.nodes:
            if canonical_op(node.op) not in ops:
                continue
            for m in match_node(rule.pattern, node, ctx.producers, ctx):
                rw = rule.rewrite(m)
                if rw is None:
                    continue
                new = _apply(graph, m, rw)
                if new is not None:
                    removed = rw.remove if rw.remove is not None else [n.name for n in m.matched]
                    done.append(f"{', '.join(removed)} -> "
                                f"{', '.join(f'{n.name} ({n.op})' for n in rw.add)}")
                    break
            if new is not None:
                break
        if new is None:
            break
        graph = cleanup(new) if cleanup is not None else new
    return graph, done


# the memo of weights concatenated by the pipeline runs of one GraphOp (see weight_memo)
_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("atb_weight_memo",
                                                                    default=None)


@contextlib.contextmanager
def weight_memo(memo: dict) -> Iterator[None]:
    """Pipeline runs inside share ``memo``: weights concatenated from the same source
    arrays (same memory, shape, strides and dtype) are made once and the result is
    shared. A GraphOp keeps one memo for all its lowerings (its plain graph and its
    in-place cache form are lowered from the same layers), so a merged gate|up or
    QKV weight exists once in memory, not once per lowering."""
    token = _MEMO.set(memo)
    try:
        yield
    finally:
        _MEMO.reset(token)


def identity(a: np.ndarray) -> tuple:
    """What the memo knows an array by: its memory, shape, strides and dtype."""
    return (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)


def concat_weights(arrays: Sequence[Any], axis: int = 0) -> np.ndarray:
    """Concatenate weights (any framework) once, at build time, as NumPy (once per
    set of source arrays inside :func:`weight_memo`, while the result lives: the memo
    holds it weakly, so a concatenation the layout pass packed is freed)."""
    parts = [to_numpy(a) for a in arrays]
    memo = _MEMO.get()
    key = (tuple(identity(a) for a in parts), axis)
    if memo is not None and key in memo:
        out = memo[key][1]()
        if out is not None:
            return out
    out = np.ascontiguousarray(np.concatenate(parts, axis=axis))
    if memo is not None:
        memo[key] = (parts, weakref.ref(out))  # the sources stay alive: their addresses stay theirs
        memo[("made", id(out))] = (weakref.ref(out), key)
    return out


def packed_once(arr: Any, layout: Any, pack: Callable[[Any, Any], Any]) -> Any:
    """``pack(arr, layout)``, made once per source and layout inside :func:`weight_memo`
    (a concatenation is known by its sources, so a later lowering that concatenates
    them again gets the same packed weight)."""
    memo = _MEMO.get()
    if memo is None:
        return pack(arr, layout)
    a = to_numpy(arr) if not hasattr(arr, "layout") else None
    if a is None:
        return pack(arr, layout)
    made = memo.get(("made", id(a)))
    if made is not None and made[0]() is a:
        src, alive = made[1], None  # a concatenation: its sources live in the memo
    else:
        try:
            alive = weakref.ref(arr)  # a weight known by its memory while it lives
        except TypeError:
            return pack(arr, layout)
        src = identity(a)
    key = ("layout", layout, src)
    hit = memo.get(key)
    if hit is None or (hit[1] is not None and hit[1]() is None):
        hit = memo[key] = (pack(arr, layout), alive)
    return hit[0]


def same_dtype(descs: Sequence[TensorDesc | None]) -> bool:
    return all(d is not None for d in descs) and len({d.dtype for d in descs}) == 1


def in_consumers_only(ctx: RewriteContext, tid: str, allowed: Mapping[str, Any] | set) -> bool:
    """True when ``tid`` is no graph output and read only by nodes named in ``allowed``."""
    return not ctx.is_output(tid) and all(n.name in allowed for n in ctx.consumers(tid))

