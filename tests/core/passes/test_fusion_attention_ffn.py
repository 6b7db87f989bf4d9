"""Attention, RoPE, packed-QKV and FFN fusion rules, Before/Expected by hand."""

from __future__ import annotations

import numpy as np
import pytest

import atbcore as atb
from atbcore.passes.rules_attention import is_causal_mask
from graphs import G, N, assert_graph_eq, fuse, w
from interp import run_graph
from llama_graphs import causal_mask

B, NH, S, D = 2, 2, 5, 4
H = NH * D
BNSD = {"q": (B, NH, S, D), "k": (B, NH, S, D), "v": (B, NH, S, D)}


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def same_numbers(a, b, inputs):
    for u, v in zip(run_graph(a, inputs), run_graph(b, inputs)):
        atb.assert_close(v, u, what="fused vs unfused")


def explicit_attention(mask_node=True, scale=True):
    nodes = [N("s", "MatMul", ["q", "k"], transpose_b=True)]
    last = "s"
    if scale:
        nodes.append(N("sc", "Elewise", last, elewise_type="muls", scalar=0.5))
        last = "sc"
    if mask_node:
        nodes.append(N("sm", "Elewise", ["m", last], elewise_type="add"))
        last = "sm"
    nodes += [N("p", "Softmax", last, dim=-1), N("o", "MatMul", ["p", "v"])]
    return nodes


def test_attention_with_scale_and_mask_input():
    ins = {**BNSD, "m": (S, S)}
    before = G(explicit_attention(), ins, "o")
    want = G([N("o", "FlashAttention", ["q", "k", "v", "m"], num_heads=NH, num_kv_heads=NH,
                scale=0.5, layout="BNSD")], ins, "o")
    got = fuse(before, "attention")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(B, NH, S, D, seed=i) for i in range(3)] + [rand(S, S, seed=9)])


def test_attention_constant_causal_mask_becomes_causal():
    before = G(explicit_attention(), BNSD, "o", {"m": causal_mask(S)})
    want = G([N("o", "FlashAttention", ["q", "k", "v"], num_heads=NH, num_kv_heads=NH, scale=0.5,
                causal=True, layout="BNSD")], BNSD, "o")
    got = fuse(before, "attention")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(B, NH, S, D, seed=i) for i in range(3)])


def test_is_causal_mask_is_strict():
    m = causal_mask(4)
    assert is_causal_mask(m, 4, 4) and is_causal_mask(m[None, None], 4, 4)
    assert is_causal_mask(causal_mask(6)[2:], 4, 6)  # bottom-right aligned rows of a longer mask
    assert not is_causal_mask(m.T, 4, 4)
    alibi = m.copy()
    alibi[3, 0] = -1.0
    assert not is_causal_mask(alibi, 4, 4)


def test_attention_without_scale_and_with_scaled_masked_softmax():
    g = G(explicit_attention(mask_node=False, scale=False), BNSD, "o")
    want = G([N("o", "FlashAttention", ["q", "k", "v"], num_heads=NH, num_kv_heads=NH, scale=1.0,
                layout="BNSD")], BNSD, "o")
    assert_graph_eq(fuse(g, "attention"), want)
    ins = {**BNSD, "m": (S, S)}
    sms = G([N("s", "MatMul", ["q", "k"], transpose_b=True),
             N("sc", "Elewise", "s", elewise_type="muls", scalar=2.0),
             N("p", "ScaledMaskedSoftmax", ["sc", "m"], scale=0.25),
             N("o", "MatMul", ["p", "v"])], ins, "o")
    want = G([N("o", "FlashAttention", ["q", "k", "v", "m"], num_heads=NH, num_kv_heads=NH,
                scale=0.5, layout="BNSD")], ins, "o")
    got = fuse(sms, "attention")
    assert_graph_eq(got, want)
    same_numbers(sms, got, [rand(B, NH, S, D, seed=i) for i in range(3)] + [rand(S, S, seed=9)])


def test_attention_keeps_probabilities_someone_reads():
    g = G(explicit_attention(mask_node=False), BNSD, ["o", "p"])
    assert fuse(g, "attention") == g


def layout_graph(rope=False):
    """BSH q/k/v -> heads -> BNSD attention -> back to BSH."""
    x = {"q": (B, S, H), "k": (B, S, H), "v": (B, S, H)}
    nodes = []
    src = {"q": "q", "k": "k", "v": "v"}
    if rope:
        nodes.append(N("rope", "RoPE", ["q", "k"], ["qr", "kr"], num_heads=NH, num_kv_heads=NH))
        src = {"q": "qr", "k": "kr", "v": "v"}
    for t in "qkv":
        nodes += [N(f"{t}4", "Reshape", src[t], shape=(B, S, NH, D)),
                  N(f"{t}t", "Transpose", f"{t}4", perm=(0, 2, 1, 3))]
    nodes += [N("o", "FlashAttention", ["qt", "kt", "vt"], num_heads=NH, causal=True,
                layout="BNSD"),
              N("ot", "Transpose", "o", perm=(0, 2, 1, 3)),
              N("y", "Reshape", "ot", shape=(B, S, H))]
    return G(nodes, x, "y")


def test_layout_folding_bnsd_to_bsnd_to_bsh():
    before = layout_graph()
    mid = fuse(before, "attention_bsnd")
    want_mid = G([N("q4", "Reshape", "q", shape=(B, S, NH, D)),
                  N("k4", "Reshape", "k", shape=(B, S, NH, D)),
                  N("v4", "Reshape", "v", shape=(B, S, NH, D)),
                  N("o", "FlashAttention", ["q4", "k4", "v4"], ["ot"], num_heads=NH, causal=True,
                    layout="BSND"),
                  N("y", "Reshape", "ot", shape=(B, S, H))], dict(before.descs), "y")
    assert_graph_eq(mid, want_mid)
    got = fuse(mid, "attention_bsh")
    want = G([N("o", "FlashAttention", ["q", "k", "v"], ["y"], num_heads=NH, num_kv_heads=NH,
                causal=True, layout="BSH")], dict(before.descs), "y")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(B, S, H, seed=i) for i in range(3)])


def test_rope_then_attention_becomes_one_node():
    g = fuse(fuse(layout_graph(rope=True), "attention_bsnd"), "attention_bsh")
    got = fuse(g, "rope_attention")
    want = G([N("o", "RopeFlashAttention", ["q", "k", "v"], ["y"], num_heads=NH,
                num_kv_heads=NH, causal=True, layout="BSH")], dict(g.descs), "y")
    assert_graph_eq(got, want)
    same_numbers(layout_graph(rope=True), got, [rand(B, S, H, seed=i) for i in range(3)])


def test_rope_attention_needs_matching_layouts():
    # a BSND RoPE feeding a BNSD attention: different head/seq axes, not fusable
    ins = {"q": (B, NH, S, D), "k": (B, NH, S, D), "v": (B, NH, S, D)}
    g = G([N("rope", "RoPE", ["q", "k"], ["qr", "kr"], layout="BSND"),
           N("o", "FlashAttention", ["qr", "kr", "v"], num_heads=NH, layout="BNSD")], ins, "o")
    assert fuse(g, "rope_attention") == g


@pytest.mark.parametrize("op", ["FlashAttention", "RopeFlashAttention"])
def test_packed_qkv_drops_the_split(op):
    x = {"x": (B, S, 3 * H)}
    before = G([N("split", "Split", "x", ["q", "k", "v"], dim=-1, sizes=(H, H, H)),
                N("o", op, ["q", "k", "v"], num_heads=NH, causal=True)], x, "o")
    want = G([N("o", op, ["x"], num_heads=NH, num_kv_heads=NH, causal=True)], x, "o")
    got = fuse(before, "packed_qkv")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(B, S, 3 * H)])


def test_packed_qkv_keeps_the_split_when_a_part_is_read_elsewhere():
    x = {"x": (B, S, 3 * H)}
    g = G([N("split", "Split", "x", ["q", "k", "v"], dim=-1, sizes=(H, H, H)),
           N("o", "FlashAttention", ["q", "k", "v"], num_heads=NH),
           N("y", "Elewise", ["o", "v"], elewise_type="add")], x, "y")
    assert fuse(g, "packed_qkv") == g


I = 6


def ffn_graph(act="SiLU", gated=True, bias=False, mul_order=0):
    b = (lambda n: [f"b{n}"]) if bias else (lambda n: [])
    nodes = [N("gate", "Linear", ["x", "wg", *b("g")])] if gated else []
    nodes.append(N("up", "Linear", ["x", "wu", *b("u")]))
    if gated:
        nodes += [N("act", act, "gate"),
                  N("mul", "Elewise", ["up", "act"] if mul_order else ["act", "up"],
                    elewise_type="mul")]
        last = "mul"
    else:
        nodes.append(N("act", act, "up"))
        last = "act"
    nodes.append(N("down", "Linear", [last, "wd", *b("d")]))
    ws = {"wg": w(I, H, seed=1), "wu": w(I, H, seed=2), "wd": w(H, I, seed=3)}
    if bias:
        ws.update(bg=w(I, seed=4), bu=w(I, seed=5), bd=w(H, seed=6))
    if not gated:
        ws.pop("wg"), ws.pop("bg", None)
    return G(nodes, {"x": (B, S, H)}, "down", ws), ws


@pytest.mark.parametrize("act,name,order", [("SiLU", "swiglu", 0), ("SiLU", "swiglu", 1),
                                            ("Gelu", "geglu", 0)])
def test_gated_ffn_merges_gate_and_up(act, name, order):
    before, ws = ffn_graph(act, mul_order=order)
    want = G([N("gate+up+down", "FusedFeedForward", ["x", "gate+up+down.gate_up_weight", "wd"],
                ["down"], hidden_size=H, intermediate_size=I, activation_type=name,
                gate_up_merged=True)], {"x": (B, S, H)}, "down",
             {"wd": ws["wd"], "gate+up+down.gate_up_weight": np.concatenate([ws["wg"], ws["wu"]])})
    got = fuse(before, "ffn")
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(B, S, H)])


def test_plain_ffn_with_biases_and_residual():
    before, ws = ffn_graph("Gelu", gated=False, bias=True)
    before = G(list(before.nodes) + [N("y", "ResidualAdd", ["down", "x"])],
               {"x": (B, S, H)}, "y", dict(before.weights))
    got = fuse(fuse(before, "ffn"), "ffn_residual")
    want = G([N("up+down", "FusedFeedForward", ["x", "wu", "wd", "bu", "bd", "x"], ["y"],
                hidden_size=H, intermediate_size=I, activation_type="gelu", bias=True,
                has_residual=True)], {"x": (B, S, H)}, "y", ws)
    assert_graph_eq(got, want)
    same_numbers(before, got, [rand(B, S, H)])


def test_ffn_needs_every_linear_plain():
    g, _ = ffn_graph(bias=True)
    nodes = list(g.nodes)
    nodes[0] = N("gate", "Linear", ["x", "wg"])  # gate without the bias the others have
    g = g.replace(nodes=tuple(nodes))
    assert fuse(g, "ffn") == g


@pytest.mark.parametrize("bias", [False, True])
def test_ffn_gate_up_merges_separate_weights_of_a_fused_ffn(bias):
    """A gated FusedFeedForward given separate gate/up weights (the FusedFeedForward
    layer's form) -> one gate|up weight; same numbers as the unmerged op and the
    explicit Linear/SiLU/mul/Linear graph (the NumPy interpreter runs all three)."""
    explicit, ws = ffn_graph("SiLU", bias=bias)
    ins = ["x", "wg", "wu", "wd"] + (["bg", "bu", "bd"] if bias else [])
    before = G([N("mlp", "FusedFeedForward", ins, ["down"], hidden_size=H, intermediate_size=I,
                  activation_type="swiglu", bias=bias)], {"x": (B, S, H)}, "down", ws)
    got = fuse(before, "ffn_gate_up")
    merged = ["x", "mlp.gate_up.weight", "wd"] + (["mlp.gate_up.bias", "bd"] if bias else [])
    (node,) = got.nodes
    assert node.inputs == tuple(merged) and node.params.gate_up_merged
    wmap = dict(got.weights)
    np.testing.assert_array_equal(wmap["mlp.gate_up.weight"], np.concatenate([ws["wg"], ws["wu"]]))
    assert "wg" not in wmap and "wu" not in wmap  # the separate weights are gone
    x = rand(B, S, H)
    same_numbers(before, got, [x])
    same_numbers(explicit, got, [x])
    assert fuse(got, "ffn_gate_up") == got  # already merged: no match
