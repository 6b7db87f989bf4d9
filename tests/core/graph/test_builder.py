"""GraphBuilder: inputs, weights, nodes by name / Operation / nested Graph, views,
outputs; errors at the node that causes them."""

from __future__ import annotations

import numpy as np
import pytest

import atbcore as atb
from atbcore.errors import DtypeError, GraphError, ParamsError, ShapeError
from atbcore.graph.builder import GraphBuilder
from atbcore.graph.ir import Graph, Node
from graphs import N, P
from interp import run_graph


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def mlp(name="mlp", hidden=8, inter=16) -> Graph:
    b = GraphBuilder(name)
    x = b.add_input("x", atb.TensorDesc([2, 3, hidden]))
    w1 = b.add_weight("w1", rand(inter, hidden, seed=1))
    w2 = b.add_weight("w2", rand(hidden, inter, seed=2))
    h, = b.add_node("Linear", [x, w1], name="fc1")
    a, = b.add_node("Swish", [h])                 # an alias: stored as SiLU
    y, = b.add_node("Linear", [a, w2], name="fc2")
    b.mark_output(y)
    return b.build()


def test_build_names_ids_and_descriptors():
    g = mlp()
    assert g.inputs == ("x",) and g.outputs == ("fc2",)
    assert [(n.name, n.op, n.inputs, n.outputs) for n in g.nodes] == [
        ("fc1", "Linear", ("x", "w1"), ("fc1",)), ("silu", "SiLU", ("fc1",), ("silu",)),
        ("fc2", "Linear", ("silu", "w2"), ("fc2",))]
    assert g.desc_map["silu"] == atb.TensorDesc([2, 3, 16])
    x = rand(2, 3, 8)
    w1, w2 = g.weight_map["w1"], g.weight_map["w2"]
    h = x @ w1.T
    atb.assert_close(run_graph(g, [x])[0], (h / (1 + np.exp(-h))) @ w2.T, "fp32", "mlp")


def test_multi_output_ids_auto_names_views_and_operations():
    b = GraphBuilder("g")
    x = b.add_input("x", ([2, 4, 6], "fp32"))
    r = b.add_input("r", rand(2, 4, 6))                  # described from a tensor
    w = b.add_weight("w", np.ones(6, np.float32))
    y, s = b.add_node("AddRmsNorm", [x, r, w])
    p0, p1, p2 = b.add_node("Split", [s], {"dim": -1, "num": 3})
    v = b.reshape(p0, [8, 2])
    neg = atb.Builder().build_operation("Elewise", {"elewise_type": "neg"})
    n1, = b.add_node(neg, [v])
    n2, = b.add_node(neg, [v])
    assert (y, s) == ("addrmsnorm.y", "addrmsnorm.sum")
    assert (p0, p1, p2) == ("split.0", "split.1", "split.2")
    assert (v, n1, n2) == ("reshape", "elewise", "elewise_1")
    b.mark_output(n1, y)
    g = b.build()
    assert g.node("reshape") == N("reshape", "Reshape", "split.0", shape=(8, 2))
    assert g.desc_map["elewise"] == atb.TensorDesc([8, 2])
    xs, rs = rand(2, 4, 6), rand(2, 4, 6, seed=1)
    out = run_graph(g, [xs, rs])
    np.testing.assert_allclose(out[0], -(xs + rs)[..., :2].reshape(8, 2), rtol=1e-6)


def test_nested_graph_is_inlined_with_prefixed_ids():
    inner = mlp("inner")
    b = GraphBuilder("outer")
    x = b.add_input("x", atb.TensorDesc([2, 3, 8]))
    y1, = b.add_node(inner, [x], name="block0")
    y2, = b.add_node(inner, [y1], name="block1")
    z, = b.add_node("ResidualAdd", [y2, x])
    b.mark_output(z)
    g = b.build()
    assert y1 == "block0/fc2" and y2 == "block1/fc2"
    assert [n.name for n in g.nodes][:3] == ["block0/fc1", "block0/silu", "block0/fc2"]
    assert g.node("block1/fc1").inputs == ("block0/fc2", "block1/w1")
    assert {k for k, _ in g.weights} == {"block0/w1", "block0/w2", "block1/w1", "block1/w2"}
    x0 = rand(2, 3, 8)
    once = run_graph(inner, [x0])[0]
    atb.assert_close(run_graph(g, [x0])[0], run_graph(inner, [once])[0] + x0, "fp32", "nested")


def test_nested_graph_must_fit_its_inputs():
    b = GraphBuilder("outer")
    x = b.add_input("x", atb.TensorDesc([2, 3, 5]))
    with pytest.raises(GraphError, match="outer/blk: nested graph 'mlp' does not fit"):
        b.add_node(mlp(), [x], name="blk")
    with pytest.raises(GraphError, match="inputs of nested graph"):
        b.add_node(mlp(), [x, x], name="blk")


def test_errors_name_the_node_at_add_time():
    b = GraphBuilder("g")
    x = b.add_input("x", atb.TensorDesc([2, 4]))
    w = b.add_weight("w", rand(3, 5))
    with pytest.raises(ShapeError, match=r"g/proj \(Linear\).*in_features"):
        b.add_node("Linear", [x, w], name="proj")
    with pytest.raises(GraphError, match="g/fancy: unknown op 'Fancy'"):
        b.add_node("Fancy", [x], name="fancy")
    with pytest.raises(GraphError, match="g/a: input 'ghost' has no source"):
        b.add_node("Elewise", [x, "ghost"], {"elewise_type": "add"}, name="a")
    with pytest.raises(ParamsError, match=r"g/s \(Split\).*num or sizes"):
        b.add_node("Split", [x], {}, name="s")
    with pytest.raises(DtypeError, match="g/c"):
        b.add_node("Elewise", [x, b.add_input("h", atb.TensorDesc([2, 4], "fp16"))],
                   {"elewise_type": "add"}, name="c")
    with pytest.raises(GraphError, match=r"g/s2 \(Split\): number of outputs"):
        b.add_node("Split", [x], {"num": 2}, name="s2", num_outputs=3)
    b.add_node("Elewise", [x], {"elewise_type": "neg"}, name="n")
    with pytest.raises(GraphError, match="id 'n' already used"):
        b.add_node("Elewise", [x], {"elewise_type": "neg"}, name="n")
    with pytest.raises(GraphError, match="already used"):
        b.add_input("x", atb.TensorDesc([1]))
    with pytest.raises(GraphError, match="'zz' is not a tensor of this graph"):
        b.mark_output("zz")
    with pytest.raises(GraphError, match="no outputs"):
        GraphBuilder("empty").build()
    # the failed calls left nothing behind
    b.mark_output("n")
    assert [n.name for n in b.build().nodes] == ["n"]
