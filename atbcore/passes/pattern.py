"""Tree patterns over the graph IR, matched backwards from a root node.

A pattern describes the producers of a node's inputs::

    x_sq = Op("Elewise", ("x", "x"), where=elewise("mul"))     # x * x
    mean = Op("ReduceMean", (x_sq,), name="mean")

* ``Op(ops, inputs, name=..., where=..., commutative=..., output=..., partial=...)``
  matches a node whose op (canonical name) is one of ``ops`` and whose inputs
  match ``inputs`` in order (``partial=True``: a prefix; ``commutative=True``: the
  first two may be swapped); ``where(node)`` filters on params; ``output`` is the
  index of the node's output the parent reads. ``name`` binds the node; binding
  one name twice must give the same node (so two inputs can come from one RoPE).
* a string is a variable binding the tensor id (``"_"`` matches anything); the
  same variable twice must bind the same id (``x * x``);
* ``None`` matches an absent optional input (``""``);
* ``Alt(p1, p2, ...)`` tries alternatives in order.

:func:`match_node` yields every :class:`Match` of a pattern rooted at a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from ..graph.analysis import canonical_op
from ..graph.ir import Node

__all__ = ["Pat", "Op", "Alt", "Match", "match_node", "root_ops", "elewise", "params_are"]


class Pat:
    """Base of the pattern types."""


@dataclass(frozen=True)
class Op(Pat):
    """A node pattern; see the module docstring."""

    ops: tuple[str, ...] | str
    inputs: tuple[Any, ...] | None = None
    name: str | None = None
    where: Callable[[Node], bool] | None = None
    commutative: bool = False
    output: int = 0
    partial: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.ops, str):
            object.__setattr__(self, "ops", (self.ops,))


@dataclass(frozen=True)
class Alt(Pat):
    """The first alternative that matches (each is tried, in order)."""

    options: tuple[Pat, ...]

    def __init__(self, *options: Pat) -> None:
        object.__setattr__(self, "options", tuple(options))


@dataclass(frozen=True)
class Match:
    """One match: ``nodes`` binds pattern names to nodes, ``vars`` variables to
    tensor ids, ``matched`` lists every node the pattern covered (root first)."""

    root: Node
    nodes: Mapping[str, Node] = field(default_factory=dict)
    vars: Mapping[str, str] = field(default_factory=dict)
    matched: tuple[Node, ...] = ()
    ctx: Any = None

    def __getitem__(self, key: str) -> Any:
        if key in self.nodes:
            return self.nodes[key]
        return self.vars[key]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return key in self.nodes or key in self.vars


@dataclass(frozen=True)
class _Env:
    nodes: tuple[tuple[str, Node], ...] = ()
    vars: tuple[tuple[str, str], ...] = ()
    matched: tuple[Node, ...] = ()

    def bind_var(self, k: str, t: str) -> "_Env | None":
        for name, v in self.vars:
            if name == k:
                return self if v == t else None
        return _Env(self.nodes, self.vars + ((k, t),), self.matched)

    def bind_node(self, k: str | None, n: Node) -> "_Env | None":
        env = self
        if k is not None:
            for name, v in self.nodes:
                if name == k:
                    if v.name != n.name:
                        return None
                    break
            else:
                env = _Env(self.nodes + ((k, n),), self.vars, self.matched)
        if all(m.name != n.name for m in env.matched):
            env = _Env(env.nodes, env.vars, env.matched + (n,))
        return env


Producers = Mapping[str, tuple[Node, int]]


def _match_tensor(pat: Any, tid: str, prod: Producers, env: _Env) -> Iterator[_Env]:
    if pat is None:
        if not tid:
            yield env
        return
    if isinstance(pat, str):
        if not tid:
            return
        if pat == "_":
            yield env
            return
        e = env.bind_var(pat, tid)
        if e is not None:
            yield e
        return
    if isinstance(pat, Alt):
        for opt in pat.options:
            yield from _match_tensor(opt, tid, prod, env)
        return
    if not tid or tid not in prod:
        return
    node, idx = prod[tid]
    if idx != pat.output:
        return
    yield from _match_op(pat, node, prod, env)


def _match_inputs(pats: tuple[Any, ...], ids: tuple[str, ...], prod: Producers,
                  env: _Env) -> Iterator[_Env]:
    if not pats:
        yield env
        return
    for e in _match_tensor(pats[0], ids[0], prod, env):
        yield from _match_inputs(pats[1:], ids[1:], prod, e)


def _match_op(pat: Op, node: Node, prod: Producers, env: _Env) -> Iterator[_Env]:
    if canonical_op(node.op) not in pat.ops:
        return
    if pat.where is not None and not pat.where(node):
        return
    e0 = env.bind_node(pat.name, node)
    if e0 is None:
        return
    if pat.inputs is None:
        yield e0
        return
    ids = node.inputs
    while ids and not ids[-1]:
        ids = ids[:-1]  # trailing absent inputs are the same as leaving them out
    n = len(pat.inputs)
    if len(ids) > n and not pat.partial:
        return
    ids = ids + ("",) * max(0, n - len(ids))
    orders = [ids[:n]]
    if pat.commutative and n >= 2 and ids[0] != ids[1]:
        orders.append((ids[1], ids[0]) + ids[2:n])
    for order in orders:
        yield from _match_inputs(pat.inputs, order, prod, e0)


def match_node(pat: Pat, node: Node, prod: Producers, ctx: Any = None) -> Iterator[Match]:
    """Every match of ``pat`` rooted at ``node``; ``prod`` maps tensor id ->
    (producing node, output index)."""
    opts = pat.options if isinstance(pat, Alt) else (pat,)
    for opt in opts:
        if not isinstance(opt, Op):
            continue
        for e in _match_op(opt, node, prod, _Env()):
            yield Match(node, dict(e.nodes), dict(e.vars), e.matched, ctx)


def root_ops(pat: Pat) -> frozenset[str]:
    """The op names a pattern's root may have (the driver's cheap pre-filter)."""
    if isinstance(pat, Alt):
        return frozenset().union(*(root_ops(p) for p in pat.options))
    if isinstance(pat, Op):
        return frozenset(pat.ops)
    return frozenset()


# ----------------------------------------------------------------------------- predicates


def elewise(*types: str) -> Callable[[Node], bool]:
    """``where=`` for an Elewise node of one of ``types`` (``"mul"``, ``"add"`` ...)."""
    return lambda n: getattr(n.params, "elewise_type", None) in types


def params_are(**want: Any) -> Callable[[Node], bool]:
    """``where=`` requiring params fields to equal the given values."""
    return lambda n: all(getattr(n.params, k, object()) == v for k, v in want.items())
