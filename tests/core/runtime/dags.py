"""Random DAGs for property tests of the scheduler and planner (hypothesis strategies).

Nodes are built from the norm ops (same shape in and out) plus ``Reshape`` views, so
the graphs are also runnable; the planner tests give arbitrary sizes per tensor.
"""

from __future__ import annotations

from hypothesis import strategies as st

from atbcore.graph.ir import Graph, Node
from atbcore.ops.base import Params

__all__ = ["random_dag", "PLAIN"]

PLAIN = Params()


@st.composite
def random_dag(draw, max_nodes: int = 14, reshape: bool = True, shuffle: bool = True) -> Graph:
    """A random DAG: 1-3 inputs, nodes reading 1-2 earlier tensors, 1-2 outputs each
    (``AddRmsNorm`` style), some ``Reshape`` views, 1-3 graph outputs. Node order in
    the graph is shuffled, so a scheduler cannot rely on it being topological."""
    n_in = draw(st.integers(1, 3))
    tensors = [f"in{i}" for i in range(n_in)]
    nodes = []
    for i in range(draw(st.integers(1, max_nodes))):
        kind = draw(st.sampled_from(["unary", "binary", "view"] if reshape
                                    else ["unary", "binary"]))
        a = draw(st.sampled_from(tensors))
        if kind == "unary":
            nodes.append(Node(f"n{i}", "RmsNorm", PLAIN, (a, "w"), (f"t{i}",)))
        elif kind == "binary":
            b = draw(st.sampled_from(tensors))
            nodes.append(Node(f"n{i}", "AddRmsNorm", PLAIN, (a, b, "w"), (f"t{i}", f"s{i}")))
        else:
            nodes.append(Node(f"n{i}", "Reshape", PLAIN, (a,), (f"t{i}",)))
        tensors.extend(nodes[-1].outputs)
    produced = [t for n in nodes for t in n.outputs]
    outs = draw(st.lists(st.sampled_from(produced), min_size=1, max_size=3, unique=True))
    if shuffle:
        nodes = draw(st.permutations(nodes))
    return Graph("rand", tuple(f"in{i}" for i in range(n_in)), tuple(outs), tuple(nodes),
                 weights=(("w", None),))
