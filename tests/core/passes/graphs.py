"""Helpers to write Before/Expected graphs by hand in the pass tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from atbcore.graph.ir import Graph, Node
from atbcore.ops.registry import get_op
from atbcore.tensor import TensorDesc


def P(op: str, **kw: Any):
    """Params of ``op`` from keyword values."""
    return get_op(op).make_params(kw)


def N(name: str, op: str, ins, outs=None, **kw: Any) -> Node:
    """A node; ``outs`` defaults to ``(name,)``; keywords are params."""
    ins = (ins,) if isinstance(ins, str) else tuple(ins)
    outs = (name,) if outs is None else ((outs,) if isinstance(outs, str) else tuple(outs))
    return Node(name, get_op(op).name, P(op, **kw), ins, outs)


def G(nodes, inputs: dict[str, Any], outputs, weights: dict[str, np.ndarray] | None = None,
      name: str = "g") -> Graph:
    """A graph with input descriptors (``{id: TensorDesc or shape}``)."""
    descs = tuple((k, v if isinstance(v, TensorDesc) else TensorDesc(v)) for k, v in inputs.items())
    outputs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    return Graph(name, tuple(inputs), outputs, tuple(nodes), tuple((weights or {}).items()),
                 descs=descs)


def w(*shape: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    """A seeded weight."""
    return (np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[-1])).astype(dtype)


def assert_graph_eq(got: Graph, want: Graph) -> None:
    """``got == want``, with a readable per-node diff when not."""
    if got == want:
        return
    lines = [f"inputs {got.inputs} vs {want.inputs}", f"outputs {got.outputs} vs {want.outputs}"]
    for i in range(max(len(got.nodes), len(want.nodes))):
        a = got.nodes[i] if i < len(got.nodes) else None
        b = want.nodes[i] if i < len(want.nodes) else None
        mark = "  " if a == b else "!!"
        lines.append(f"{mark} got  {a}\n{mark} want {b}")
    lines.append(f"weights {[k for k, _ in got.weights]} vs {[k for k, _ in want.weights]}")
    raise AssertionError("graphs differ:\n" + "\n".join(lines))


def fuse(graph: Graph, rule: str) -> Graph:
    """``graph`` after one fusion rule (by name) and dead-code elimination."""
    from atbcore.passes.dce import dead_code_elimination
    from atbcore.passes.rewrite import apply_rule
    from atbcore.passes.rules import FUSION_RULES

    r = next(r for r in FUSION_RULES if r.name == rule)
    return apply_rule(graph, r, cleanup=dead_code_elimination)[0]
