"""The graph IR: small immutable values.

A :class:`Node` is an op applied to tensor ids; a :class:`Graph` is a set of nodes
with named inputs, outputs and weights (constant tensors). Tensor ids are strings;
``""`` marks an absent optional input. Structurally equal nodes/graphs compare equal,
so pass tests compare a rewritten graph with a hand-built expected one with ``==``.

    g = Graph(name="mlp", inputs=("x",), outputs=("y",),
              nodes=(Node("fc1", "Linear", p1, ("x", "w1"), ("h",)),
                     Node("act", "SiLU", p2, ("h",), ("y",))),
              weights=(("w1", w1_array),))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ..ops.base import Params
from ..tensor import TensorDesc

__all__ = ["Node", "Graph"]


@dataclass(frozen=True, slots=True)
class Node:
    """One op application. ``params`` is the op's frozen Params (hashable)."""

    name: str
    op: str
    params: Params
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def replace(self, **kw: Any) -> "Node":
        return dataclasses.replace(self, **kw)


def _weights_key(weights: tuple[tuple[str, Any], ...]) -> tuple:
    # weights compare by id, shape, dtype and bytes so structural equality holds
    import numpy as np

    out = []
    for k, v in weights:
        if hasattr(v, "detach"):  # torch; to_numpy also handles bf16, which .numpy() refuses
            from ..tensor import to_numpy

            a = to_numpy(v.detach().cpu())
        else:
            a = np.asarray(v)
        out.append((k, a.shape, str(a.dtype), a.tobytes()))
    return tuple(out)


@dataclass(frozen=True)
class Graph:
    """An immutable graph. ``weights`` is a tuple of (tensor id, array) pairs;
    ``descs`` optionally records known descriptors of tensor ids (inputs, weights,
    intermediates after shape inference) as a tuple of (id, TensorDesc) pairs."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[Node, ...]
    weights: tuple[tuple[str, Any], ...] = ()
    descs: tuple[tuple[str, TensorDesc], ...] = field(default=(), compare=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return (self.name, self.inputs, self.outputs, self.nodes) == (
            other.name, other.inputs, other.outputs, other.nodes) and _weights_key(
            self.weights) == _weights_key(other.weights)

    def __hash__(self) -> int:
        return hash((self.name, self.inputs, self.outputs, self.nodes))

    def replace(self, **kw: Any) -> "Graph":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ views
    @property
    def weight_map(self) -> dict[str, Any]:
        return dict(self.weights)

    @property
    def desc_map(self) -> dict[str, TensorDesc]:
        return dict(self.descs)

    def producers(self) -> dict[str, Node]:
        """Tensor id -> the node producing it."""
        return {t: n for n in self.nodes for t in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        """Tensor id -> nodes reading it (in node order)."""
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for t in n.inputs:
                if t:
                    out.setdefault(t, []).append(n)
        return out

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def with_descs(self, descs: Mapping[str, TensorDesc]) -> "Graph":
        return dataclasses.replace(self, descs=tuple(sorted(descs.items())))
