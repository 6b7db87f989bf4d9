"""Read-only questions about a graph, shared by the verifier, the builder and the
passes: canonical op names, how a node's input ids bind to its op's input names,
a stable topological order, and shape inference (possibly partial).

Errors are :class:`GraphError` (or the op's own :class:`AtbError` subclass)
naming the graph and node as ``"graph/node (Op)"``.
"""

from __future__ import annotations

import heapq
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

from ..errors import AtbError, GraphError, ParamsError
from ..ops.base import OpDef
from ..ops.registry import get_op
from ..tensor import TensorDesc, describe
from .ir import Graph, Node

__all__ = ["canonical_op", "opdef_of", "node_error", "bind_ids", "topo_order", "toposort_nodes",
           "infer_descs", "weight_desc"]


@lru_cache(maxsize=None)
def _canonical(name: str) -> str:
    return get_op(name).name


def canonical_op(name: str) -> str | None:
    """The registered name of op ``name`` (aliases resolve), or None if unknown."""
    try:
        return _canonical(str(name))
    except ParamsError:
        return None


def opdef_of(graph: Graph, node: Node) -> OpDef:
    """The node's op definition; GraphError naming the node for an unknown op."""
    if canonical_op(node.op) is None:
        from ..ops.registry import list_operations

        raise GraphError(f"{graph.name}/{node.name}", f"unknown op {node.op!r}",
                         f"one of {list_operations()}", repr(node.op))
    return get_op(node.op)


def node_error(graph: Graph, node: Node, e: AtbError) -> AtbError:
    """The same error class, re-labelled ``graph/node (Op)`` so the node is named."""
    err = type(e)(f"{graph.name}/{node.name} ({e.op})", e.what, e.expected, e.given)
    err.__cause__ = e
    return err


def weight_desc(arr: Any) -> TensorDesc:
    """Descriptor of a weight array (NumPy, torch, ...)."""
    return describe(arr)


def bind_ids(opdef: OpDef, node: Node, descs: Mapping[str, TensorDesc]) -> dict[str, Any]:
    """Input name -> tensor id (a tuple of ids for a variadic input, None if absent).

    With an explicit absent input (``""``) ids are read positionally in the op's
    input order; otherwise the op's own ``bind`` decides, looking at descriptors
    (it tells ambiguous optional inputs apart by dtype and rank)."""
    if "" in node.inputs:
        names = opdef.input_names
        if len(node.inputs) > len(names):
            raise GraphError(node.name, f"{node.op} takes at most {len(names)} inputs",
                             len(names), len(node.inputs))
        out: dict[str, Any] = {n: (t or None) for n, t in zip(names, node.inputs)}
        out.update({n: None for n in names[len(node.inputs):]})
        return out
    # fresh descriptor objects per position, so bind's result maps back by identity
    items = [descs[t].replace() for t in node.inputs]
    back = {id(d): t for d, t in zip(items, node.inputs)}
    bound = opdef.bind(node.params, items)
    res: dict[str, Any] = {}
    for name, v in bound.items():
        if v is None:
            res[name] = None
        elif isinstance(v, (list, tuple)):
            res[name] = tuple(back[id(x)] for x in v)
        else:
            res[name] = back[id(v)]
    return res


def toposort_nodes(nodes: Sequence[Node], available: Iterable[str]) -> list[Node] | None:
    """``nodes`` in a topological order that keeps the given order wherever the
    dependencies allow (stable), or None when some node can never run (a cycle or
    an input nobody produces)."""
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for t in n.outputs:
            producer.setdefault(t, i)
    have = set(available)
    deps: list[set[int]] = []
    for n in nodes:
        deps.append({producer[t] for t in n.inputs if t and t not in have and t in producer})
    users: list[list[int]] = [[] for _ in nodes]
    indeg = []
    for i, d in enumerate(deps):
        indeg.append(len(d))
        for j in d:
            users[j].append(i)
    ready = [i for i, k in enumerate(indeg) if k == 0]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, u)
    return order if len(order) == len(nodes) else None


def topo_order(graph: Graph) -> list[Node]:
    """The graph's nodes in a stable topological order; GraphError naming a node
    on a cycle if there is one."""
    ext = set(graph.inputs) | {w for w, _ in graph.weights}
    order = toposort_nodes(graph.nodes, ext)
    if order is not None:
        return order
    placed = {n.name for n in toposort_nodes_partial(graph.nodes, ext)}
    stuck = [n for n in graph.nodes if n.name not in placed]
    cycle = _find_cycle(stuck)
    if cycle:  # start the report at the cycle's first node in graph order
        pos = {n.name: i for i, n in enumerate(graph.nodes)}
        k = min(range(len(cycle)), key=lambda i: pos[cycle[i]])
        cycle = cycle[k:] + cycle[:k]
    first = cycle[0] if cycle else stuck[0].name
    raise GraphError(f"{graph.name}/{first}", "cycle in the graph",
                     "an acyclic graph", " -> ".join(cycle + cycle[:1]) if cycle else first)


def toposort_nodes_partial(nodes: Sequence[Node], available: Iterable[str]) -> list[Node]:
    """The nodes that can run, in order (those not on or behind a cycle)."""
    have = set(available)
    produced_by_any = {t for n in nodes for t in n.outputs}
    done: list[Node] = []
    pending = list(nodes)
    progress = True
    while progress:
        progress = False
        rest = []
        for n in pending:
            if all(not t or t in have or t not in produced_by_any for t in n.inputs):
                done.append(n)
                have.update(n.outputs)
                progress = True
            else:
                rest.append(n)
        pending = rest
    return done


def _find_cycle(nodes: Sequence[Node]) -> list[str]:
    producer = {t: n for n in nodes for t in n.outputs}
    for start in nodes:
        path: list[str] = []
        seen: dict[str, int] = {}
        n: Node | None = start
        while n is not None and n.name not in seen:
            seen[n.name] = len(path)
            path.append(n.name)
            n = next((producer[t] for t in n.inputs if t in producer), None)
        if n is not None:
            cyc = path[seen[n.name]:]
            return list(reversed(cyc))
    return []


def infer_descs(graph: Graph, input_descs: Mapping[str, TensorDesc] | None = None, *,
                partial: bool = False) -> dict[str, TensorDesc]:
    """Descriptors of every tensor id by running each op's ``infer_shape`` in
    topological order.

    Input descriptors come from ``input_descs`` or else ``graph.descs``; weights
    are described from their arrays. With ``partial=True`` a node whose inputs are
    not all known is skipped (its outputs stay unknown) and op errors propagate;
    otherwise a missing input descriptor is a GraphError."""
    known = graph.desc_map
    descs: dict[str, TensorDesc] = {}
    for w, arr in graph.weights:
        descs[w] = weight_desc(arr)
    given = dict(input_descs or {})
    for i in graph.inputs:
        d = given.get(i, known.get(i))
        if d is None:
            if partial:
                continue
            raise GraphError(graph.name, f"graph input {i!r} has no descriptor",
                             "a TensorDesc (add_input(name, desc) or input_descs)", "none")
        descs[i] = d
    for n in topo_order(graph):
        if partial and any(t and t not in descs for t in n.inputs):
            continue
        opdef = opdef_of(graph, n)
        try:
            if not isinstance(n.params, opdef.Params):
                raise GraphError(n.op, "params type", opdef.Params.__name__,
                                 type(n.params).__name__)
            b = bind_ids(opdef, n, descs)
            for req in opdef.required_inputs:
                if b.get(req) is None:
                    raise GraphError(n.op, f"required input {req!r} missing", "a tensor id",
                                     "none")
            ins = {k: (None if v is None else
                       [descs[s] for s in v] if isinstance(v, tuple) else descs[v])
                   for k, v in b.items()}
            outs = opdef.infer_shape(n.params, ins)
        except AtbError as e:
            raise node_error(graph, n, e) from None
        if len(outs) != len(n.outputs):
            raise GraphError(f"{graph.name}/{n.name} ({n.op})", "number of outputs",
                             len(outs), len(n.outputs))
        descs.update(zip(n.outputs, outs))
    return descs
