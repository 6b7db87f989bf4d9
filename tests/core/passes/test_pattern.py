"""The pattern matcher: variables unify, commutative operands, alternatives,
partial inputs, output indices and node names binding one node."""

from __future__ import annotations

from atbcore.passes.pattern import Alt, Op, elewise, match_node, root_ops
from graphs import G, N

X = {"x": (2, 3), "y": (2, 3)}


def matches(pattern, g, root):
    prod = {t: (n, i) for n in g.nodes for i, t in enumerate(n.outputs)}
    return list(match_node(pattern, g.node(root), prod))


def test_variables_unify_and_commutative_operands_swap():
    g = G([N("sq", "Elewise", ["x", "x"], elewise_type="mul"),
           N("xy", "Elewise", ["x", "y"], elewise_type="mul"),
           N("a", "Elewise", ["y", "sq"], elewise_type="add")], X, "a")
    square = Op("Elewise", ("v", "v"), where=elewise("mul"), name="sq")
    assert len(matches(square, g, "sq")) == 1 and matches(square, g, "xy") == []
    pat = Op("Elewise", (square, "other"), where=elewise("add"), name="root")
    assert matches(pat, g, "a") == []
    m, = matches(Op("Elewise", (square, "other"), where=elewise("add"), commutative=True), g, "a")
    assert m["v"] == "x" and m["other"] == "y" and m["sq"].name == "sq"
    assert [n.name for n in m.matched] == ["a", "sq"]


def test_alternatives_partial_inputs_absent_inputs_and_outputs():
    g = G([N("s", "Split", "x", ["p", "q"], num=2),
           N("l", "Linear", ["q", "w"]),
           N("f", "FlashAttention", ["p", "q", "x"], num_heads=1)],
          {"x": (1, 2, 4)}, "f")
    any_split = Alt(Op("Split", ("t",), output=1, name="sp"), Op("Linear", ("t",), partial=True))
    m, = matches(Op("Linear", (any_split, "_")), g, "l")
    assert m["t"] == "x" and m["sp"].name == "s"
    # the split's output 0 is not output 1
    assert matches(Op("Linear", (Op("Split", output=0), "_")), g, "l") == []
    # partial: a prefix of the inputs; None: an absent input
    two = Op("FlashAttention", (Op("Split", name="s", output=0), Op("Split", name="s", output=1)),
             partial=True)
    assert len(matches(two, g, "f")) == 1
    assert matches(Op("FlashAttention", ("a", "b", "c", None)), g, "f") != []
    assert matches(Op("FlashAttention", ("a", "b", None)), g, "f") == []
    assert root_ops(Alt(Op(("A", "B")), Op("C"))) == {"A", "B", "C"}


def test_one_name_binds_one_node():
    g = G([N("s1", "Split", "x", ["a", "b"], num=2), N("s2", "Split", "x", ["c", "d"], num=2),
           N("j", "Concat", ["a", "d"]), N("k", "Concat", ["a", "b"])], {"x": (2, 4)}, ["j", "k"])
    same = Op("Concat", (Op("Split", name="s", output=0), Op("Split", name="s", output=1)))
    assert matches(same, g, "j") == [] and len(matches(same, g, "k")) == 1
