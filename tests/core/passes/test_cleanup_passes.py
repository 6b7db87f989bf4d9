"""Clean-up passes on hand-built Before/Expected graphs: DCE, CSE, view folding."""

from __future__ import annotations

import numpy as np

import atbcore as atb
from atbcore.passes.cse import common_subexpression_elimination as cse
from atbcore.passes.dce import dead_code_elimination as dce
from atbcore.passes.fold_views import fold_views
from graphs import G, N, w
from interp import run_graph

X = {"x": (2, 3, 4)}


def test_dce_drops_dead_nodes_and_their_weights_keeps_inputs():
    before = G([N("a", "Elewise", ["x", "x"], elewise_type="mul"),
                N("dead", "Linear", ["a", "wd"]),
                N("dead2", "SiLU", "dead"),
                N("b", "Elewise", "a", elewise_type="neg")],
               {"x": (2, 4), "unused": (1,)}, "b", {"wd": w(3, 4)})
    want = G([N("a", "Elewise", ["x", "x"], elewise_type="mul"),
              N("b", "Elewise", "a", elewise_type="neg")], {"x": (2, 4), "unused": (1,)}, "b")
    assert dce(before) == want
    assert dce(want) is want  # nothing to do: the same value back


def test_dce_keeps_in_place_writers_whose_outputs_nobody_reads():
    # ReshapeAndCache writes the caller's caches: an effect beyond its outputs
    g = G([N("cache", "ReshapeAndCache", ["k", "v", "kc", "vc", "slots"], ["kc2", "vc2"]),
           N("y", "Elewise", "k", elewise_type="neg")],
          {"k": (3, 2, 4), "v": (3, 2, 4), "kc": (2, 4, 2, 4), "vc": (2, 4, 2, 4),
           "slots": atb.TensorDesc((3,), "int32")}, "y")
    assert dce(g) == g


def test_cse_merges_duplicates_and_rewires_readers():
    before = G([N("a1", "Elewise", ["x", "x"], elewise_type="add"),
                N("a2", "Elewise", ["x", "x"], elewise_type="add"),
                N("b1", "Elewise", "a1", elewise_type="neg"),
                N("b2", "Elewise", "a2", elewise_type="neg"),       # equal once a2 -> a1
                N("c", "Elewise", ["b1", "b2"], elewise_type="mul"),
                N("d", "Elewise", ["x", "x"], elewise_type="mul")], X, ["c", "d"])
    want = G([N("a1", "Elewise", ["x", "x"], elewise_type="add"),
              N("b1", "Elewise", "a1", elewise_type="neg"),
              N("c", "Elewise", ["b1", "b1"], elewise_type="mul"),
              N("d", "Elewise", ["x", "x"], elewise_type="mul")], X, ["c", "d"])
    assert cse(before) == want
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    for a, b in zip(run_graph(before, [x]), run_graph(want, [x])):
        np.testing.assert_array_equal(a, b)


def test_cse_keeps_different_params_graph_outputs_and_collectives():
    g = G([N("m1", "Elewise", "x", elewise_type="muls", scalar=2.0),
           N("m2", "Elewise", "x", elewise_type="muls", scalar=3.0),
           N("o1", "Elewise", "x", elewise_type="neg"),
           N("o2", "Elewise", "x", elewise_type="neg"),          # a graph output: kept
           N("r1", "AllReduce", "m1"), N("r2", "AllReduce", "m1"),
           N("b1", "Broadcast", "m2"), N("b2", "Broadcast", "m2"),    # every collective
           N("s", "Elewise", ["r1", "r2"], elewise_type="add"),
           N("u", "Elewise", ["b1", "b2"], elewise_type="add"),
           N("t", "Elewise", ["s", "u"], elewise_type="add")], X, ["o1", "o2", "t"])
    assert cse(g) == g


def test_fold_views_cancels_transposes_and_reshapes():
    before = G([N("t1", "Transpose", "x", perm=(0, 2, 1)),
                N("t2", "Transpose", "t1", perm=(0, 2, 1)),          # identity with t1
                N("r1", "Reshape", "t2", shape=(6, 4)),
                N("r2", "Reshape", "r1", shape=(2, 12)),             # one reshape of x
                N("r3", "Reshape", "x", shape=(2, 3, 4)),            # to its own shape
                N("y", "Elewise", ["r3", "x"], elewise_type="add")], X, ["r2", "y"])
    want = G([N("r2", "Reshape", "x", shape=(2, 12)),
              N("y", "Elewise", ["x", "x"], elewise_type="add")], X, ["r2", "y"])
    assert dce(fold_views(before)) == want


def test_fold_views_composes_transposes():
    before = G([N("t1", "Transpose", "x", perm=(1, 0, 2)),
                N("t2", "Transpose", "t1", perm=(0, 2, 1))], X, "t2")
    want = G([N("t2", "Transpose", "x", perm=(1, 2, 0))], X, "t2")
    assert dce(fold_views(before)) == want
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(run_graph(want, [x])[0], x.transpose(1, 0, 2).transpose(0, 2, 1))


def test_fold_views_absorbs_transposes_into_matmul_and_linear():
    before = G([N("kt", "Transpose", "k", perm=(0, 2, 1)),
                N("s", "MatMul", ["q", "kt"]),
                N("wt", "Transpose", "w", perm=(1, 0)),
                N("y", "Linear", ["s", "wt"])],
               {"q": (2, 3, 4), "k": (2, 5, 4), "w": (5, 6)}, "y")
    want = G([N("s", "MatMul", ["q", "k"], transpose_b=True),
              N("y", "Linear", ["s", "w"], transpose_weight=False)],
             {"q": (2, 3, 4), "k": (2, 5, 4), "w": (5, 6)}, "y")
    assert dce(fold_views(before)) == want
    rng = np.random.default_rng(1)
    ins = [rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 4), (2, 5, 4), (5, 6))]
    atb.assert_close(run_graph(want, ins)[0], run_graph(before, ins)[0], what="folded")


def test_fold_views_never_removes_a_graph_output():
    g = G([N("t", "Transpose", "x", perm=(0, 1, 2))], X, "t")
    assert fold_views(g) == g
