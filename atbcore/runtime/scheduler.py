"""The scheduler: a graph's nodes in topological levels.

A node's level is one more than the deepest level among the producers of its
inputs (as soon as possible), so nodes of one level never depend on each other and
may run concurrently (separate CUDA streams). Within a level nodes keep the order
they have in the graph, so a schedule is deterministic.

    A -> B, A -> C, (B, C) -> D      gives      [[A], [B, C], [D]]
"""

from __future__ import annotations

from typing import Sequence

from ..errors import GraphError
from ..graph.ir import Graph, Node

__all__ = ["schedule", "flatten", "assign_streams"]


def schedule(graph: Graph) -> list[list[Node]]:
    """Topological levels of ``graph``'s nodes.

    Raises :class:`GraphError` naming the node for a cycle, for a tensor that is
    read but neither produced, a graph input nor a weight, and for a tensor
    produced twice.
    """
    producer: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for t in n.outputs:
            if t in producer:
                other = graph.nodes[producer[t]].name
                raise GraphError(f"{graph.name}/{n.name}", f"tensor {t!r} produced twice",
                                 "one producer", f"{other} and {n.name}")
            producer[t] = i
    external = set(graph.inputs) | {w for w, _ in graph.weights}
    deps: list[set[int]] = []
    for n in graph.nodes:
        d = set()
        for t in n.inputs:
            if not t:
                continue
            if t in producer:
                d.add(producer[t])
            elif t not in external:
                raise GraphError(f"{graph.name}/{n.name}", f"input {t!r} has no source",
                                 "a graph input, a weight or a node output", repr(t))
        deps.append(d)

    # Kahn's algorithm; a node's level is fixed once its last producer is placed.
    users: list[list[int]] = [[] for _ in graph.nodes]
    indeg = [len(d) for d in deps]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    level: dict[int, int] = {}
    ready = [i for i, k in enumerate(indeg) if k == 0]
    while ready:
        i = ready.pop()
        level[i] = 1 + max((level[j] for j in deps[i]), default=-1)
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if len(level) < len(graph.nodes):
        stuck = [i for i in range(len(graph.nodes)) if i not in level]
        # Name nodes on the cycle itself, not merely those downstream of it.
        on_cycle = _cycle_nodes(stuck, deps)
        names = ", ".join(graph.nodes[i].name for i in on_cycle)
        raise GraphError(f"{graph.name}/{graph.nodes[on_cycle[0]].name}", "cycle between nodes",
                         "an acyclic graph", names)

    levels: list[list[Node]] = [[] for _ in range(1 + max(level.values(), default=-1))]
    for i in range(len(graph.nodes)):  # graph order within a level
        levels[level[i]].append(graph.nodes[i])
    return levels


def flatten(levels: Sequence[Sequence[Node]]) -> list[Node]:
    """The linear order the executor runs (level by level)."""
    return [n for lv in levels for n in lv]


def assign_streams(levels: Sequence[Sequence[Node]], num_streams: int) -> dict[str, int]:
    """Node name -> stream index for running independent branches concurrently.

    A node continues the stream of its first producer that no earlier node of the
    same level has claimed (so a chain stays on one stream and needs no events);
    other nodes of a level spread over the remaining streams round-robin.
    """
    num_streams = max(1, int(num_streams))
    producer: dict[str, str] = {}
    stream: dict[str, int] = {}
    for lv in levels:
        taken: set[int] = set()
        rr = 0
        for n in lv:
            choice = None
            for t in n.inputs:
                p = producer.get(t)
                if p is not None and stream[p] not in taken:
                    choice = stream[p]
                    break
            if choice is None:
                free = [s for s in range(num_streams) if s not in taken] or list(range(num_streams))
                choice = free[rr % len(free)]
                rr += 1
            taken.add(choice)
            stream[n.name] = choice
            for t in n.outputs:
                producer[t] = n.name
    return stream


def _cycle_nodes(stuck: list[int], deps: list[set[int]]) -> list[int]:
    """Nodes on one cycle among ``stuck`` (nodes Kahn's algorithm could not place)."""
    stuck_set = set(stuck)
    i = stuck[0]
    seen: dict[int, int] = {}
    path: list[int] = []
    # Every stuck node has a stuck producer, so walking producers must revisit a node.
    while i not in seen:
        seen[i] = len(path)
        path.append(i)
        i = min(j for j in deps[i] if j in stuck_set)
    return sorted(path[seen[i]:])
