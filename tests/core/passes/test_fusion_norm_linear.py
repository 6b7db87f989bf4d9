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


@pytest.mark.parametrize("op,add", [("Linear", "ResidualAdd"), ("Linear", "Elewise"),
                                    ("RmsNormLinear", "ResidualAdd")])
def test_linear_residual_moves_the_add_into_the_gemm(op, add):
    ins = ["x", "nw", "w"] if op == "RmsNormLinear" else ["x", "w"]
    ws = {"w": w(H, H), "nw": 1 + w(H, seed=2)} if op == "RmsNormLinear" else {"w": w(H, H)}
    extra = {"elewise_type": "add"} if add == "Elewise" else {}
    before = G([N("l", op, ins), N("y", add, ["r", "l"], **extra)], {**X, "r": (2, 3, H)}, "y",
               ws)
    got = fuse(before, "linear_residual")
    want = G([N("l", op, [*ins, "", "", "r"], ["y"])], {**X, "r": (2, 3, H)}, "y", ws)
    assert_graph_eq(got, want)
    x, r = rand(2, 3, H), rand(2, 3, H, seed=1)
    same_numbers(before, got, [x, r])
    # and through the torch backend's bound plan (the C matmul's epilogue on the CPU)
    import torch
    gop = atb.GraphOp(before, backend="torch")
    for _ in range(2):  # built, then the bound program again
        atb.assert_close(gop(torch.from_numpy(x), torch.from_numpy(r)),
                         run_graph(before, [x, r])[0], "fp32", "bound Linear(residual) vs unfused")
    assert [(n.op, n.inputs[-1]) for n in gop.graph.nodes] == [(op, "r")]


def test_linear_residual_leaves_other_adds_alone():
    ws = {"w": w(H, H), "w5": w(5, H)}
    # y + y, a bias-shaped add, and a Linear read by someone else: no residual fusion
    twice = G([N("l", "Linear", ["x", "w"]), N("y", "Elewise", ["l", "l"], elewise_type="add")],
              X, "y", ws)
    bias = G([N("l", "Linear", ["x", "w5"]), N("y", "Elewise", ["l", "b"], elewise_type="add")],
             {**X, "b": (5,)}, "y", ws)
    read = G([N("l", "Linear", ["x", "w"]), N("y", "ResidualAdd", ["l", "x"]),
              N("z", "Elewise", ["l", "y"], elewise_type="mul")], X, "z", ws)
    for g in (twice, bias, read):
        assert fuse(g, "linear_residual") == g


def test_norm_ffn_puts_the_norm_into_the_first_matmul():
    i = 8
    ws = {"nw": 1 + w(H, seed=2), "gu": w(2 * i, H, seed=3), "wd": w(H, i, seed=4)}
    ffn = dict(hidden_size=H, intermediate_size=i, activation_type="swiglu",
               gate_up_merged=True, has_residual=True)
    before = G([N("n", "RmsNorm", ["x", "nw"], eps=1e-5),
                N("f", "FusedFeedForward", ["n", "gu", "wd", "x"], ["y"], **ffn)], X, "y", ws)
    got = fuse(before, "norm_ffn")
    want = G([N("f", "FusedFeedForward", ["x", "gu", "wd", "x", "nw"], ["y"], norm_eps=1e-5,
                **ffn)], X, "y", ws)
    assert_graph_eq(got, want)
    x = rand(2, 3, H)
    same_numbers(before, got, [x])
    import torch
    atb.assert_close(atb.GraphOp(before, backend="torch")(torch.from_numpy(x)),
                     run_graph(before, [x])[0], "fp32", "bound FFN(norm) vs unfused")
    # the normed tensor read elsewhere (here as the residual too): not fused
    shared = G([N("n", "RmsNorm", ["x", "nw"], eps=1e-5),
                N("f", "FusedFeedForward", ["n", "gu", "wd", "n"], ["y"], **ffn)], X, "y", ws)
    assert fuse(shared, "norm_ffn") == shared
