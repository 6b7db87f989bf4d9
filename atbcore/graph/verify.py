"""The graph verifier: is this a well-formed graph whose shapes and dtypes fit?

    descs = verify(graph)            # every tensor id -> TensorDesc
    verify(graph, {"x": TensorDesc([2, 8, 64])})

Checks, each failure a :class:`GraphError` (or the op's own ShapeError/DtypeError/
ParamsError) whose ``op`` names ``graph/node``:

* node names are unique, every op name is registered, params have the op's type;
* every tensor is produced once (not by two nodes, not by a node and also a graph
  input or weight), graph inputs and weights are distinct;
* every input a node reads is a graph input, a weight or a node output (no
  dangling ids); ``""`` marks an absent optional input;
* the graph is acyclic and every graph output is produced (or is an input/weight);
* types and shapes, by running every op's ``infer_shape`` in topological order —
  when the graph inputs have descriptors (``input_descs`` or ``graph.descs``).
  Without them the structural checks still run and the shapes of what can be
  inferred (weights and what depends only on them) are returned.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import GraphError
from ..tensor import TensorDesc
from .analysis import infer_descs, opdef_of, topo_order
from .ir import Graph

__all__ = ["verify", "check_structure"]


def check_structure(graph: Graph) -> None:
    """The structural checks of :func:`verify` (no shapes)."""
    g = graph.name
    names: set[str] = set()
    for n in graph.nodes:
        if not n.name:
            raise GraphError(f"{g}/<unnamed {n.op}>", "node name", "a non-empty name", repr(n.name))
        if n.name in names:
            raise GraphError(f"{g}/{n.name}", "node name used twice", "unique node names", n.name)
        names.add(n.name)
    weights = [w for w, _ in graph.weights]
    source: dict[str, str] = {}
    for i in graph.inputs:
        if not i:
            raise GraphError(g, "graph input id", "a non-empty id", repr(i))
        if i in source:
            raise GraphError(g, f"graph input {i!r} listed twice", "distinct inputs", i)
        source[i] = "graph input"
    for w in weights:
        if w in source:
            raise GraphError(g, f"weight {w!r} is also a {source[w]}", "distinct ids", w)
        source[w] = "weight"
    for n in graph.nodes:
        opdef_of(graph, n)  # unknown op names
        for t in n.outputs:
            if not t:
                raise GraphError(f"{g}/{n.name}", "output id", "a non-empty id", repr(t))
            if t in source:
                raise GraphError(f"{g}/{n.name}", f"tensor {t!r} produced twice",
                                 "one producer", f"{source[t]} and node {n.name}")
            source[t] = f"node {n.name}"
    for n in graph.nodes:
        opdef = opdef_of(graph, n)
        if not isinstance(n.params, opdef.Params):
            raise GraphError(f"{g}/{n.name}", f"params of {n.op}", opdef.Params.__name__,
                             type(n.params).__name__)
        for t in n.inputs:
            if t and t not in source:
                raise GraphError(f"{g}/{n.name}", f"input {t!r} has no source",
                                 "a graph input, a weight or a node output", repr(t))
    topo_order(graph)  # cycles
    for o in graph.outputs:
        if o not in source:
            raise GraphError(g, f"graph output {o!r} is never produced",
                             "a node output, graph input or weight", repr(o))


def verify(graph: Graph, input_descs: Mapping[str, TensorDesc] | None = None) -> dict[str, TensorDesc]:
    """Check ``graph`` (see the module docstring) and return the descriptor of
    every tensor id. Raises a GraphError (or the op's AtbError) naming the node."""
    check_structure(graph)
    known = dict(graph.desc_map)
    known.update(input_descs or {})
    full = all(i in known for i in graph.inputs)
    return infer_descs(graph, {i: known[i] for i in graph.inputs if i in known},
                       partial=not full)
