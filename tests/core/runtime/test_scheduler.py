"""Scheduler: topological levels, determinism, malformed graphs, stream assignment."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from atbcore.errors import GraphError
from atbcore.graph.ir import Graph, Node
from atbcore.runtime.scheduler import assign_streams, flatten, schedule
from dags import PLAIN, random_dag


def _n(name, ins, outs):
    return Node(name, "RmsNorm", PLAIN, tuple(ins), tuple(outs))


def _diamond(order=("A", "B", "C", "D")) -> Graph:
    nodes = {"A": _n("A", ["x"], ["a"]), "B": _n("B", ["a"], ["b"]),
             "C": _n("C", ["a"], ["c"]), "D": _n("D", ["b", "c"], ["d"])}
    return Graph("diamond", ("x",), ("d",), tuple(nodes[k] for k in order))


def _names(levels):
    return [[n.name for n in lv] for lv in levels]


def test_diamond_levels():
    assert _names(schedule(_diamond())) == [["A"], ["B", "C"], ["D"]]


def test_order_within_a_level_follows_the_graph_and_does_not_need_topological_input():
    # Graph order C before B (and D listed first): the level keeps C, B.
    assert _names(schedule(_diamond(("D", "C", "A", "B")))) == [["A"], ["C", "B"], ["D"]]
    assert schedule(_diamond()) == schedule(_diamond())


def test_independent_chains_share_levels():
    g = Graph("two", ("x", "y"), ("p", "q"), (
        _n("p1", ["x"], ["a"]), _n("q1", ["y"], ["b"]), _n("p2", ["a"], ["p"]),
        _n("q2", ["b"], ["q"])))
    assert _names(schedule(g)) == [["p1", "q1"], ["p2", "q2"]]


def test_cycle_names_nodes_on_the_cycle():
    g = Graph("cyc", ("x",), ("d",), (
        _n("A", ["x", "c"], ["a"]), _n("B", ["a"], ["b"]), _n("C", ["b"], ["c"]),
        _n("D", ["c"], ["d"])))
    with pytest.raises(GraphError) as ei:
        schedule(g)
    msg = str(ei.value)
    assert "cycle" in msg and "A, B, C" in msg and "D" not in msg.split("given")[1]


def test_dangling_input_and_double_producer():
    g = Graph("dang", ("x",), ("a",), (_n("A", ["x", "nowhere"], ["a"]),))
    with pytest.raises(GraphError, match="dang/A.*'nowhere'"):
        schedule(g)
    g2 = Graph("twice", ("x",), ("a",), (_n("A", ["x"], ["a"]), _n("B", ["x"], ["a"])))
    with pytest.raises(GraphError, match="produced twice"):
        schedule(g2)


def test_absent_optional_inputs_and_weights_are_not_dependencies():
    g = Graph("w", ("x",), ("a",), (Node("A", "LayerNorm", PLAIN, ("x", "w", ""), ("a",)),),
              weights=(("w", None),))
    assert _names(schedule(g)) == [["A"]]


@settings(max_examples=60, deadline=None)
@given(random_dag())
def test_schedule_respects_every_dependency(g):
    levels = schedule(g)
    level_of = {n.name: i for i, lv in enumerate(levels) for n in lv}
    assert sorted(level_of) == sorted(n.name for n in g.nodes)  # each node exactly once
    assert len(flatten(levels)) == len(g.nodes)
    prod = g.producers()
    for n in g.nodes:
        deps = [level_of[prod[t].name] for t in n.inputs if t in prod]
        for d in deps:
            assert d < level_of[n.name], f"{n.name} scheduled with or before its producer"
        # as soon as possible: level = 1 + deepest producer
        assert level_of[n.name] == (max(deps) + 1 if deps else 0)


def test_streams_keep_chains_together_and_split_branches():
    s = assign_streams(schedule(_diamond()), 2)
    assert s["A"] == s["B"] == s["D"] and s["C"] != s["A"]
    assert set(assign_streams(schedule(_diamond()), 1).values()) == {0}
