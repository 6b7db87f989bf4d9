"""Dead-code elimination: drop nodes nothing needs, and weights nothing reads.

A node is live when one of its outputs is a graph output or is read by a live
node. Nodes that write into an input in place (ops declaring ``inplace``, such as
``ReshapeAndCache`` writing the caller's KV cache) have an effect beyond their
outputs and are always live. Graph inputs are the graph's interface and stay,
read or not.
"""

from __future__ import annotations

from ..graph.analysis import opdef_of
from ..graph.ir import Graph

__all__ = ["dead_code_elimination"]


def dead_code_elimination(graph: Graph) -> Graph:
    """``graph`` without dead nodes and unused weights (pure)."""
    producer = {t: n for n in graph.nodes for t in n.outputs}
    live: set[str] = set()
    stack = [n for n in graph.nodes if opdef_of(graph, n).inplace]
    stack += [producer[o] for o in graph.outputs if o in producer]
    while stack:
        n = stack.pop()
        if n.name in live:
            continue
        live.add(n.name)
        stack.extend(producer[t] for t in n.inputs if t in producer)
    nodes = tuple(n for n in graph.nodes if n.name in live)
    used = {t for n in nodes for t in n.inputs} | set(graph.outputs)
    weights = tuple((w, a) for w, a in graph.weights if w in used)
    if len(nodes) == len(graph.nodes) and len(weights) == len(graph.weights):
        return graph
    return graph.replace(nodes=nodes, weights=weights)
