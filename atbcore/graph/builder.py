"""``GraphBuilder``: build a graph node by node, with shapes checked as you go.

    b = GraphBuilder("mlp")
    x = b.add_input("x", TensorDesc([2, 8, 64]))
    w1 = b.add_weight("w1", np.zeros((256, 64), np.float32))
    h, = b.add_node("Linear", [x, w1], name="fc1")
    a, = b.add_node("SiLU", [h])
    v = b.reshape(a, [2, 8, 4, 64])          # a view, no copy
    b.mark_output(v)
    g = b.build()                            # verified Graph

``add_node`` takes an op name (aliases accepted, stored under the canonical name),
an :class:`~atbcore.operation.Operation` (its params are used), or a built
:class:`Graph`, which is inlined: its nodes, intermediates and weights get ids
prefixed with the node name (``"block/..."``) and its inputs are wired to the ids
given. Every node's shapes are inferred when it is added, so a bad node is
rejected right there, with an error naming it.

Output ids: a node with one output produces the id ``name``; several outputs are
``name.<output name>`` when the op declares that many names (``add_norm.y``,
``add_norm.sum``), else ``name.0``, ``name.1``, ...
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import AtbError, GraphError
from ..ops.base import Params
from ..ops.registry import get_op
from ..tensor import TensorDesc, describe, is_tensor
from .analysis import bind_ids, canonical_op, infer_descs, node_error
from .ir import Graph, Node
from .verify import verify

__all__ = ["GraphBuilder"]


class GraphBuilder:
    """Builds an immutable :class:`Graph`; see the module docstring."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self._inputs: list[str] = []
        self._weights: list[tuple[str, Any]] = []
        self._nodes: list[Node] = []
        self._outputs: list[str] = []
        self._descs: dict[str, TensorDesc] = {}
        self._counts: dict[str, int] = {}

    # ------------------------------------------------------------------ sources
    def _claim(self, tid: str, what: str) -> None:
        if not isinstance(tid, str) or not tid:
            raise GraphError(f"{self.name}/{tid!r}", f"{what} id", "a non-empty string", repr(tid))
        if tid in self._descs or any(n.name == tid for n in self._nodes):
            raise GraphError(f"{self.name}/{tid}", f"{what} id {tid!r} already used",
                             "a fresh id", tid)

    def add_input(self, name: str, desc: Any) -> str:
        """Declare graph input ``name`` with a descriptor (a TensorDesc, a tensor
        to describe, or ``(shape, dtype)``); returns its id."""
        self._claim(name, "input")
        if isinstance(desc, TensorDesc):
            d = desc
        elif is_tensor(desc):
            d = describe(desc)
        elif isinstance(desc, (tuple, list)) and len(desc) == 2 and not isinstance(desc[0], int):
            d = TensorDesc(desc[0], desc[1])
        else:
            raise GraphError(f"{self.name}/{name}", "input descriptor",
                             "a TensorDesc, a tensor or (shape, dtype)", repr(desc)[:60])
        self._inputs.append(name)
        self._descs[name] = d
        return name

    def add_weight(self, name: str, array: Any) -> str:
        """Add a constant tensor (NumPy array or any framework's tensor); returns its id."""
        self._claim(name, "weight")
        if not is_tensor(array):
            raise GraphError(f"{self.name}/{name}", "weight value", "a tensor or array",
                             type(array).__name__)
        self._weights.append((name, array))
        self._descs[name] = describe(array)
        return name

    def desc(self, tid: str) -> TensorDesc:
        """The descriptor of a tensor id known to the builder."""
        if tid not in self._descs:
            raise GraphError(self.name, f"unknown tensor id {tid!r}", "an id of this builder", tid)
        return self._descs[tid]

    def _fresh(self, base: str) -> str:
        taken = self._taken()
        if base not in taken:
            return base
        k = self._counts.get(base, 1)
        while f"{base}_{k}" in taken:
            k += 1
        self._counts[base] = k + 1
        return f"{base}_{k}"

    def _taken(self) -> set[str]:
        return set(self._descs) | {n.name for n in self._nodes}

    # ------------------------------------------------------------------ nodes
    def add_node(self, op: Any, inputs: Sequence[str | None], params: Mapping[str, Any] | Params |
                 None = None, name: str | None = None, num_outputs: int | None = None) -> list[str]:
        """Add a node and return its output ids; see the module docstring.

        ``inputs`` are tensor ids (``None`` or ``""`` = an absent optional input);
        ``num_outputs`` is checked against what the op produces when given."""
        if isinstance(op, Graph):
            return self._inline(op, inputs, name)
        from ..operation import Operation

        if isinstance(op, Operation):
            if params is not None:
                raise GraphError(f"{self.name}/{name or op.name}", "params with an Operation",
                                 "no params (the Operation has its own)", "both")
            op_name, p = op.opdef.name, op.params
        else:
            op_name = canonical_op(op)
            label = f"{self.name}/{name or op}"
            if op_name is None:
                from ..ops.registry import list_operations

                raise GraphError(label, f"unknown op {op!r}", f"one of {list_operations()}",
                                 repr(op))
            try:
                p = get_op(op_name).make_params(params)
            except AtbError as e:
                err = type(e)(f"{label} ({e.op})", e.what, e.expected, e.given)
                raise err from e
        node_name = name if name is not None else self._fresh(op_name.lower())
        if name is not None:
            self._claim(name, "node")
        ids = tuple("" if t is None else t for t in inputs)
        for t in ids:
            if t and t not in self._descs:
                raise GraphError(f"{self.name}/{node_name}", f"input {t!r} has no source",
                                 "a graph input, a weight or a node output", repr(t))
        opdef = get_op(op_name)
        probe = Node(node_name, op_name, p, ids, ())
        sub = Graph(self.name, (), (), (probe,), ())
        try:
            bound = bind_ids(opdef, probe, self._descs)
            ins = {k: (None if v is None else [self._descs[s] for s in v] if isinstance(v, tuple)
                       else self._descs[v]) for k, v in bound.items()}
            for req in opdef.required_inputs:
                if ins.get(req) is None:
                    raise GraphError(op_name, f"required input {req!r} missing", "a tensor id",
                                     "none")
            outs = opdef.infer_shape(p, ins)
        except AtbError as e:
            raise node_error(sub, probe, e) from None
        if num_outputs is not None and num_outputs != len(outs):
            raise GraphError(f"{self.name}/{node_name} ({op_name})", "number of outputs",
                             len(outs), num_outputs)
        out_ids = self._output_ids(node_name, opdef.outputs, len(outs))
        for t in out_ids:
            self._claim(t, "output")
        self._nodes.append(probe.replace(outputs=out_ids))
        self._descs.update(zip(out_ids, outs))
        return list(out_ids)

    @staticmethod
    def _output_ids(name: str, declared: Sequence[str], n: int) -> tuple[str, ...]:
        if n == 1:
            return (name,)
        if len(declared) >= n and len(set(declared[:n])) == n:
            return tuple(f"{name}.{o}" for o in declared[:n])
        return tuple(f"{name}.{i}" for i in range(n))

    def reshape(self, x: str, shape: Sequence[int], name: str | None = None) -> str:
        """A ``Reshape`` view of ``x`` (no copy; one ``-1`` allowed)."""
        return self.add_node("Reshape", [x], {"shape": tuple(shape)}, name=name)[0]

    def _inline(self, sub: Graph, inputs: Sequence[str | None], name: str | None) -> list[str]:
        prefix = name if name is not None else self._fresh(sub.name or "subgraph")
        label = f"{self.name}/{prefix}"
        if len(inputs) != len(sub.inputs):
            raise GraphError(label, f"inputs of nested graph {sub.name!r}",
                             f"{len(sub.inputs)} ({', '.join(sub.inputs)})", len(inputs))
        for t in inputs:
            if not t or t not in self._descs:
                raise GraphError(label, f"input {t!r} has no source",
                                 "a graph input, a weight or a node output", repr(t))
        # Shapes of the nested graph under the descriptors it is wired to.
        try:
            infer_descs(sub, {i: self._descs[t] for i, t in zip(sub.inputs, inputs)})
        except AtbError as e:
            raise GraphError(label, f"nested graph {sub.name!r} does not fit its inputs: {e}",
                             None, None) from e
        mapping = dict(zip(sub.inputs, inputs))

        def rename(t: str) -> str:
            return "" if not t else mapping.get(t, f"{prefix}/{t}")

        for w, arr in sub.weights:
            mapping[w] = self.add_weight(f"{prefix}/{w}", arr)
        for n in sub.nodes:
            self._claim(f"{prefix}/{n.name}", "node")
            node = n.replace(name=f"{prefix}/{n.name}", inputs=tuple(rename(t) for t in n.inputs),
                             outputs=tuple(rename(t) for t in n.outputs))
            for t in node.outputs:
                self._claim(t, "output")
            self._nodes.append(node)
        self._descs.update(infer_descs(self._snapshot(), partial=True))
        return [rename(o) for o in sub.outputs]

    # ------------------------------------------------------------------ outputs
    def mark_output(self, *ids: str) -> None:
        """Make tensor ids graph outputs (in call order)."""
        for t in ids:
            if t not in self._descs:
                raise GraphError(self.name, f"output {t!r} is not a tensor of this graph",
                                 "an input, weight or node output id", repr(t))
            if t in self._outputs:
                raise GraphError(self.name, f"output {t!r} marked twice", "distinct outputs", t)
            self._outputs.append(t)

    def _snapshot(self) -> Graph:
        return Graph(self.name, tuple(self._inputs), tuple(self._outputs), tuple(self._nodes),
                     tuple(self._weights),
                     descs=tuple((i, self._descs[i]) for i in self._inputs))

    def build(self) -> Graph:
        """The verified graph, with the descriptor of every tensor id attached."""
        if not self._outputs:
            raise GraphError(self.name, "graph has no outputs", "mark_output(...) first", "none")
        g = self._snapshot()
        return g.with_descs(verify(g))
