"""The verifier: descriptors of every tensor, and bad graphs rejected with an error
naming the node — by hand and on random DAGs (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import atbcore as atb
from atbcore.errors import DtypeError, GraphError, ShapeError
from atbcore.graph.ir import Graph, Node
from atbcore.graph.verify import verify
from atbcore.ops.base import Params
from graphs import G, N, w
from random_dags import dags

X = {"x": (2, 4)}


def test_returns_a_descriptor_for_every_tensor():
    g = G([N("l", "Linear", ["x", "w"]), N("s", "Split", "l", ["a", "b"], num=2),
           N("y", "Concat", ["b", "a", "x"], dim=-1)], X, "y", {"w": w(6, 4)})
    d = verify(g)
    assert d == {"x": atb.TensorDesc((2, 4)), "w": atb.TensorDesc((6, 4)),
                 "l": atb.TensorDesc((2, 6)), "a": atb.TensorDesc((2, 3)),
                 "b": atb.TensorDesc((2, 3)), "y": atb.TensorDesc((2, 10))}
    assert verify(g, {"x": atb.TensorDesc((5, 4))})["y"] == atb.TensorDesc((5, 10))


def test_without_input_descriptors_structure_is_still_checked():
    g = G([N("y", "Linear", ["x", "w"])], {}, "y", {"w": w(6, 4)})
    g = Graph(g.name, ("x",), g.outputs, g.nodes, g.weights)
    assert verify(g) == {"w": atb.TensorDesc((6, 4))}
    bad = g.replace(nodes=(N("y", "Linear", ["x", "ghost"]),))
    with pytest.raises(GraphError, match="g/y: input 'ghost' has no source"):
        verify(bad)


def _raises(g, exc, *frags):
    with pytest.raises(exc) as ei:
        verify(g)
    for f in frags:
        assert f in str(ei.value), str(ei.value)
    return ei.value


def test_bad_graphs_are_rejected_naming_the_node():
    e = _raises(G([N("a", "Elewise", ["x", "c"], elewise_type="add"),
                   N("b", "Elewise", "a", elewise_type="neg"),
                   N("c", "Elewise", "b", elewise_type="neg")], X, "c"),
                GraphError, "cycle", "a -> b -> c -> a")
    assert e.op.startswith("g/")
    _raises(G([N("a", "Elewise", ["x", "nope"], elewise_type="add")], X, "a"),
            GraphError, "g/a", "input 'nope' has no source")
    _raises(G([N("a", "Elewise", ["x", "y"], elewise_type="add")], {"x": (2, 4), "y": (3, 4)},
              "a"), ShapeError, "g/a (Elewise)", "do not broadcast")
    _raises(G([N("a", "Elewise", ["x", "y"], elewise_type="add")],
              {"x": (2, 4), "y": atb.TensorDesc((2, 4), "fp16")}, "a"), DtypeError, "g/a")
    _raises(G([Node("a", "Frobnicate", Params(), ("x",), ("a",))], X, "a"),
            GraphError, "g/a", "unknown op 'Frobnicate'")
    _raises(G([N("a", "Elewise", "x", elewise_type="neg"),
               N("b", "Elewise", "x", "a", elewise_type="neg")], X, "a"),
            GraphError, "g/b", "tensor 'a' produced twice", "node a and node b")
    _raises(G([N("x", "Elewise", "x", elewise_type="neg")], X, "x"),
            GraphError, "g/x", "produced twice", "graph input and node x")
    _raises(G([N("a", "Elewise", "x", elewise_type="neg")], X, "zzz"),
            GraphError, "graph output 'zzz' is never produced")
    _raises(G([N("a", "Elewise", "x", elewise_type="neg"),
               N("a", "Elewise", "a", "b", elewise_type="neg")], X, "b"),
            GraphError, "g/a", "node name used twice")
    _raises(G([Node("a", "Linear", Params(), ("x", "w"), ("a",))], X, "a", {"w": w(3, 4)}),
            GraphError, "g/a", "params of Linear", "LinearParams")
    _raises(G([N("a", "Split", "x", ["p", "q", "r"], num=2)], X, "p"),
            GraphError, "g/a (Split)", "number of outputs")


# ----------------------------------------------------------------------------- properties
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(dags())
def test_random_dags_verify_with_every_descriptor(g):
    d = verify(g)
    ids = set(g.inputs) | {k for k, _ in g.weights} | {t for n in g.nodes for t in n.outputs}
    assert set(d) == ids


@SETTINGS
@given(dags(), st.data())
def test_random_cycles_are_rejected(g, data):
    # rewire one input of node i to the output of a node that depends on i (or i itself)
    i = data.draw(st.integers(0, len(g.nodes) - 1))
    src = g.nodes[i]
    deps = {src.name}
    for n in g.nodes[i + 1:]:
        if any(t in {o for m in g.nodes if m.name in deps for o in m.outputs} for t in n.inputs):
            deps.add(n.name)
    j = data.draw(st.sampled_from(sorted(deps)))
    loop_out = g.node(j).outputs[0]
    k = data.draw(st.integers(0, len(src.inputs) - 1))
    ins = src.inputs[:k] + (loop_out,) + src.inputs[k + 1:]
    bad = g.replace(nodes=tuple(n.replace(inputs=ins) if n.name == src.name else n for n in g.nodes))
    e = _raises(bad, GraphError, "cycle")
    assert e.op.split("/", 1)[1] in deps


@SETTINGS
@given(dags(), st.data())
def test_random_dangling_inputs_are_rejected(g, data):
    i = data.draw(st.integers(0, len(g.nodes) - 1))
    n = g.nodes[i]
    bad = g.replace(nodes=g.nodes[:i] + (n.replace(inputs=("ghost",) + n.inputs[1:]),)
                    + g.nodes[i + 1:])
    _raises(bad, GraphError, f"g/{n.name}", "'ghost' has no source")
