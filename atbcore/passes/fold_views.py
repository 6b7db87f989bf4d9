"""View and transposition folding: data movement that cancels or can be absorbed.

* ``Transpose(Transpose(x, p1), p2)`` reads ``x`` once with the composed perm;
  a perm that is the identity disappears (readers read ``x``);
* ``Reshape(Reshape(x))`` reshapes ``x`` once; a reshape to ``x``'s own shape
  disappears;
* ``MatMul(a, Transpose(b))`` where the transpose swaps the last two dims becomes
  ``MatMul(a, b, transpose_b=...)`` (likewise for ``a``), and ``Linear(x,
  Transpose(w, (1, 0)))`` flips ``transpose_weight`` — the matmul reads the
  operand transposed, no copy is made.

Only node inputs are rewired; a node whose output is a graph output is never
removed (its id is part of the interface). Readers that no longer need a view
leave it dead for :mod:`~atbcore.passes.dce`. Exact: no value changes.
"""

from __future__ import annotations

from ..graph.analysis import canonical_op, infer_descs
from ..graph.ir import Graph, Node
from ..errors import AtbError
from .ids import substitute_inputs

__all__ = ["fold_views"]


def _perm(n: Node) -> tuple[int, ...]:
    return tuple(n.params.perm)


def _swaps_last_two(perm: tuple[int, ...]) -> bool:
    r = len(perm)
    return r >= 2 and perm == tuple(range(r - 2)) + (r - 1, r - 2)


def fold_views(graph: Graph) -> Graph:
    """``graph`` with views and transposes folded (pure), to a fixpoint: one sweep
    folds each view into its producer as that producer was, so chains of views need
    several sweeps (and the result must be stable under another run)."""
    for _ in range(64):
        folded = _fold_once(graph)
        if folded is graph:
            return graph
        graph = folded
    return graph


def _fold_once(graph: Graph) -> Graph:
    try:
        descs = infer_descs(graph, partial=True)
    except AtbError:
        descs = {}
    prod = {t: n for n in graph.nodes for t in n.outputs}
    outputs = set(graph.outputs)
    mapping: dict[str, str] = {}
    nodes: list[Node] = []
    changed = False

    def src(t: str) -> Node | None:
        return prod.get(t)

    for n in graph.nodes:
        op = canonical_op(n.op)
        new = n
        if op == "Transpose":
            inner = src(n.inputs[0])
            perm = _perm(n)
            x = n.inputs[0]
            if inner is not None and canonical_op(inner.op) == "Transpose":
                p1 = _perm(inner)
                perm = tuple(p1[i] for i in perm)   # y[i] = x[p1[p2[i]]]
                x = inner.inputs[0]
            if perm == tuple(range(len(perm))) and n.outputs[0] not in outputs:
                mapping[n.outputs[0]] = x
                changed = True
                continue
            if x != n.inputs[0]:
                new = n.replace(inputs=(x,), params=n.params.replace(perm=perm))
        elif op == "Reshape":
            inner = src(n.inputs[0])
            x = n.inputs[0]
            if inner is not None and canonical_op(inner.op) == "Reshape":
                x = inner.inputs[0]
            dx, dy = descs.get(x), descs.get(n.outputs[0])
            if dx is not None and dy is not None and dx.shape == dy.shape and -1 not in dx.shape \
                    and n.outputs[0] not in outputs:
                mapping[n.outputs[0]] = x
                changed = True
                continue
            if x != n.inputs[0]:  # the outer shape as written (a -1 stays symbolic: the
                new = n.replace(inputs=(x,))  # graph may run at other sizes than its descs)
        elif op == "MatMul":
            ins, p = list(n.inputs), n.params
            for i, flag in ((0, "transpose_a"), (1, "transpose_b")):
                t = src(ins[i]) if ins[i] else None
                if t is not None and canonical_op(t.op) == "Transpose" and _swaps_last_two(_perm(t)):
                    ins[i] = t.inputs[0]
                    p = p.replace(**{flag: not getattr(p, flag)})
            if tuple(ins) != n.inputs:
                new = n.replace(inputs=tuple(ins), params=p)
        elif op == "Linear" and len(n.inputs) >= 2 and n.params.quant is None:
            t = src(n.inputs[1])
            if t is not None and canonical_op(t.op) == "Transpose" and _perm(t) == (1, 0):
                new = n.replace(inputs=(n.inputs[0], t.inputs[0]) + n.inputs[2:],
                                params=n.params.replace(
                                    transpose_weight=not n.params.transpose_weight))
        if new is not n:
            changed = True
        nodes.append(new)
    if not changed:
        return graph
    return substitute_inputs(graph.replace(nodes=tuple(nodes)), mapping)
