"""Renaming tensor ids across a graph's node inputs (shared by the clean-up passes)."""

from __future__ import annotations

from typing import Mapping

from ..graph.ir import Graph, Node

__all__ = ["substitute_inputs", "resolve"]


def resolve(mapping: Mapping[str, str], tid: str) -> str:
    """Follow ``mapping`` to its end (a -> b -> c gives c)."""
    seen = set()
    while tid in mapping and tid not in seen:
        seen.add(tid)
        tid = mapping[tid]
    return tid


def substitute_inputs(graph: Graph, mapping: Mapping[str, str], drop: set[str] = frozenset()
                      ) -> Graph:
    """``graph`` without the nodes named in ``drop`` and with every node input id
    renamed through ``mapping``. Graph outputs are not renamed: callers never
    map an id that is a graph output."""
    nodes: list[Node] = []
    for n in graph.nodes:
        if n.name in drop:
            continue
        ins = tuple(resolve(mapping, t) if t else t for t in n.inputs)
        nodes.append(n if ins == n.inputs else n.replace(inputs=ins))
    return graph.replace(nodes=tuple(nodes))
