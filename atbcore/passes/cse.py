"""Common-subexpression elimination: one node per (op, params, inputs).

Two nodes applying the same op with equal params to the same input ids compute
the same tensors; the later one is dropped and its readers read the first one's
outputs. Kept apart: ops with effects beyond their outputs (``inplace`` writes, and
``effectful`` ops: the collectives, which talk to the other ranks) and nodes whose outputs are graph outputs (their ids are part of
the graph's interface). Identical weights (same id) are one tensor already.
"""

from __future__ import annotations

from ..graph.analysis import canonical_op, opdef_of
from ..graph.ir import Graph
from .ids import resolve, substitute_inputs

__all__ = ["common_subexpression_elimination"]


def common_subexpression_elimination(graph: Graph) -> Graph:
    """``graph`` with duplicate computations merged (pure)."""
    from ..graph.analysis import topo_order

    outputs = set(graph.outputs)
    seen: dict[tuple, tuple[str, ...]] = {}
    mapping: dict[str, str] = {}
    drop: set[str] = set()
    for n in topo_order(graph):
        op = canonical_op(n.op)
        opdef = opdef_of(graph, n)
        if opdef.inplace or getattr(opdef, "effectful", False):
            continue
        key = (op, n.params, tuple(resolve(mapping, t) if t else t for t in n.inputs),
               len(n.outputs))
        try:
            first = seen.get(key)
        except TypeError:  # params holding something unhashable: leave the node alone
            continue
        if first is None:
            seen[key] = n.outputs
            continue
        if outputs & set(n.outputs):
            continue
        drop.add(n.name)
        mapping.update(zip(n.outputs, first))
    if not drop:
        return graph
    return substitute_inputs(graph, mapping, drop)
