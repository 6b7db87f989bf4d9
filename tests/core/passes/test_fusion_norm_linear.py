"""Norm and Linear fusion rules, Before/Expected by hand, plus the numbers agree."""

from __future__ import annotations

import numpy as np
import pytest

import atbcore as atb
from graphs import G, N, assert_graph_eq, fuse, w
from interp import run_graph

H = 8
X = {"x": (2, 3, H)}
EPS = np.array([1e-6], np.float32)


def rms_prims(x="x", wt="w", name="y", order=0):
    sq = N("sq", "Elewise", [x, x], elewise_type="mul")
    mean = N("mean", "ReduceMean", "sq", dim=-1, keepdim=True)
    add = N("add_eps", "Elewise", ["eps", "mean"] if order else ["mean", "eps"], elewise_type="add")
    rs = N("rs", "Elewise", "add_eps", elewise_type="rsqrt")
    xn = N("xn", "Elewise", ["rs", x] if order else [x, "rs"], elewise_type="mul")
    out = N(name, "Elewise", [wt, "xn"] if order else ["xn", wt], elewise_type="mul")
    return [sq, mean, add, rs, xn, out]


def same_numbers(a, b, inputs, dtype=None):
    for u, v in zip(run_graph(a, inputs), run_graph(b, inputs)):
        atb.assert_close(v, u, dtype, what="fused vs unfused")


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("order", [0, 1])
def test_rmsnorm_from_primitives(order):
    before = G(rms_prims(order=order), X, "y", {"w": w(H, seed=1), "eps": EPS})
    want = G([N("y", "RmsNorm", ["x", "w"], eps=float(EPS[0]))], X, "y", {"w": w(H, seed=1)})
    got = fuse(before, "rmsnorm")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(2, 3, H)])


def test_rmsnorm_not_fused_when_it_would_change_the_math_or_lose_a_tensor():
    # mean over the wrong axis
    nodes = rms_prims()
    nodes[1] = N("mean", "ReduceMean", "sq", dim=1, keepdim=True)
    g = G(nodes, X, "y", {"w": w(H), "eps": EPS})
    assert fuse(g, "rmsnorm") == g
    # a broadcast weight that is not [H]
    g = G(rms_prims(), X, "y", {"w": w(1), "eps": EPS})
    assert fuse(g, "rmsnorm") == g
    # eps not a constant
    g = G(rms_prims(), {**X, "eps": (1,)}, "y", {"w": w(H)})
    assert fuse(g, "rmsnorm") == g
    # an interior tensor is also a graph output: RmsNorm would not produce it
    g = G(rms_prims(), X, ["y", "rs"], {"w": w(H), "eps": EPS})
    assert fuse(g, "rmsnorm") == g


@pytest.mark.parametrize("add_op", ["Elewise", "ResidualAdd"])
def test_add_rmsnorm_keeps_the_sum_for_other_readers(add_op):
    kw = {"elewise_type": "add"} if add_op == "Elewise" else {}
    before = G([N("s", add_op, ["a", "b"], **kw),
                N("n", "RmsNorm", ["s", "w"], eps=1e-5),
                N("y", "Elewise", ["n", "s"], elewise_type="mul")],
               {"a": (2, 3, H), "b": (2, 3, H)}, "y", {"w": w(H)})
    want = G([N("n", "AddRmsNorm", ["a", "b", "w"], ["n", "s"], eps=1e-5),
              N("y", "Elewise", ["n", "s"], elewise_type="mul")],
             {"a": (2, 3, H), "b": (2, 3, H)}, "y", {"w": w(H)})
    got = fuse(before, "add_rmsnorm")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(2, 3, H), rand(2, 3, H, seed=1)])


def test_add_layernorm_with_and_without_affine():
    for extra, ws in (((), {}), (("lw", "lb"), {"lw": w(H), "lb": w(H, seed=2)})):
        before = G([N("s", "ResidualAdd", ["a", "b"]), N("n", "LayerNorm", ["s", *extra])],
                   {"a": (2, 3, H), "b": (2, 3, H)}, "n", ws)
        want = G([N("n", "AddLayerNorm", ["a", "b", *extra], ["n", "s"])],
                 {"a": (2, 3, H), "b": (2, 3, H)}, "n", ws)
        got = fuse(before, "add_layernorm")
        assert_graph_eq(got, want)
        same_numbers(before, got, [rand(2, 3, H), rand(2, 3, H, seed=1)])


def test_add_norm_needs_equal_shapes():
    g = G([N("s", "Elewise", ["a", "b"], elewise_type="add"), N("n", "RmsNorm", ["s", "w"])],
          {"a": (2, 3, H), "b": (H,)}, "n", {"w": w(H)})
    assert fuse(g, "add_rmsnorm") == g


def test_qkv_merges_three_projections_weights_concatenated_once():
    wq, wk, wv = w(H, H, seed=1), w(4, H, seed=2), w(4, H, seed=3)
    bq, bk, bv = w(H, seed=4), w(4, seed=5), w(4, seed=6)
    before = G([N("q", "Linear", ["x", "wq", "bq"]), N("k", "Linear", ["x", "wk", "bk"]),
                N("v", "Linear", ["x", "wv", "bv"]),
                N("y", "Concat", ["v", "k", "q"], dim=-1)], X, "y",
               {"wq": wq, "wk": wk, "wv": wv, "bq": bq, "bk": bk, "bv": bv})
    want = G([N("q+k+v", "Linear", ["x", "q+k+v.weight", "q+k+v.bias"], bias=True),
              N("q+k+v.split", "Split", "q+k+v", ["q", "k", "v"], dim=-1, sizes=(H, 4, 4)),
              N("y", "Concat", ["v", "k", "q"], dim=-1)], X, "y",
             {"q+k+v.weight": np.concatenate([wq, wk, wv]),
              "q+k+v.bias": np.concatenate([bq, bk, bv])})
    got = fuse(before, "qkv")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(2, 3, H)])


def test_qkv_leaves_other_groups_alone():
    two = G([N("q", "Linear", ["x", "wq"]), N("k", "Linear", ["x", "wk"]),
             N("y", "Elewise", ["q", "k"], elewise_type="add")], X, "y",
            {"wq": w(H, H), "wk": w(H, H, seed=1)})
    assert fuse(two, "qkv") == two
    # one weight is a graph input, not a constant: cannot be concatenated at build time
    dyn = G([N("q", "Linear", ["x", "wq"]), N("k", "Linear", ["x", "wk"]),
             N("v", "Linear", ["x", "wv"]), N("y", "Concat", ["q", "k", "v"])],
            {**X, "wv": (H, H)}, "y", {"wq": w(H, H), "wk": w(H, H, seed=1)})
    assert fuse(dyn, "qkv") == dyn


def test_linear_bias_folds_a_bias_add():
    before = G([N("l", "Linear", ["x", "w"]), N("y", "Elewise", ["b", "l"], elewise_type="add")],
               X, "y", {"w": w(5, H), "b": w(5, seed=1)})
    want = G([N("l", "Linear", ["x", "w", "b"], ["y"], bias=True)], X, "y",
             {"w": w(5, H), "b": w(5, seed=1)})
    got = fuse(before, "linear_bias")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(2, 3, H)])
    # a full-shape add is a residual, not a bias
    res = G([N("l", "Linear", ["x", "w"]), N("y", "Elewise", ["l", "x"], elewise_type="add")],
            X, "y", {"w": w(H, H)})
    assert fuse(res, "linear_bias") == res


@pytest.mark.parametrize("act,params,name", [("SiLU", {}, "silu"),
                                             ("Gelu", {"approximate": "tanh"}, "gelu_tanh"),
                                             ("Activation", {"activation_type": "relu"}, "relu")])
def test_linear_activation(act, params, name):
    before = G([N("l", "Linear", ["x", "w", "b"]), N("y", act, "l", **params)], X, "y",
               {"w": w(5, H), "b": w(5, seed=1)})
    want = G([N("y", "LinearActivation", ["x", "w", "b"], activation_type=name)], X, "y",
             {"w": w(5, H), "b": w(5, seed=1)})
    got = fuse(before, "linear_activation")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(2, 3, H)])
