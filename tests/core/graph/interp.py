"""A tiny graph interpreter for the graph/pass tests: runs nodes in topological
order, one ``Operation`` each on the NumPy reference backend. Independent of the
runtime's executor on purpose (no plans, no memory planning)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

import atbcore as atb
from atbcore.graph.analysis import topo_order
from atbcore.graph.ir import Graph
from atbcore.tensor import to_numpy


def run_graph(graph: Graph, inputs: Mapping[str, Any] | list, backend: str = "numpy"
              ) -> list[np.ndarray]:
    """Outputs of ``graph`` for ``inputs`` (dict by id, or a list in graph input order)."""
    if not isinstance(inputs, Mapping):
        inputs = dict(zip(graph.inputs, inputs))
    env: dict[str, Any] = {w: to_numpy(a) for w, a in graph.weights}
    env.update({k: np.asarray(v) for k, v in inputs.items()})
    b = atb.Builder(backend=backend)
    for n in topo_order(graph):
        op = b.build_operation(n.op, n.params)
        ins = [env[t] if t else None for t in n.inputs]
        while ins and ins[-1] is None:
            ins.pop()
        outs = op.execute(ins)
        env.update(zip(n.outputs, (to_numpy(o) for o in outs)))
    return [env[o] for o in graph.outputs]
