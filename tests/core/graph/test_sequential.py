"""Sequential lowering: the seed article's three blocks lower, run (GraphOp) and
match independent torch implementations; the extra-arguments rule; KV cache
(prefill + decode equals the full sequence); RoPE before attention; fusion keeps
results."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from atbcore.errors import GraphError
from atbcore.graph import layers as L
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.sequential import kv_cache_slots, lower_sequential
from atbcore.passes.pipeline import FusionConfig, run_pipeline
from interp import run_graph

B, S, H, NH, MLP = 2, 6, 32, 4, 64
HD = H // NH
D = atb.TensorDesc


def x_in(s=S, seed=1):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((B, s, H)).astype(np.float32))


def t(layer, key):
    return torch.from_numpy(layer.weights()[key])


def heads(x):  # [B, S, H] -> [B, N, S, D]
    return x.view(x.shape[0], x.shape[1], -1, HD).transpose(1, 2)


def merge(o):  # [B, N, S, D] -> [B, S, H]
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def seed_attention_block():
    return [L.LayerNorm("query", eps=1e-5), L.Linear("qkv_proj", out_features=3 * H),
            L.FlashAttention("attn", num_heads=NH, causal=True),
            L.Linear("out_proj", out_features=H), L.ResidualAdd("output", "input")]


def test_seed_attention_block_runs_as_written_and_matches_torch():
    layers = seed_attention_block()
    block = GraphOp(layers)
    q, k, v, r = x_in(), x_in(seed=2), x_in(seed=3), x_in(seed=4)
    with pytest.warns(UserWarning, match="inputs 2..4 of this sequential block are ignored"):
        out = block(q, k, v, r)
    g = block.graph_unfused
    assert g.inputs == ("input", "unused_1", "unused_2", "unused_3") and g.outputs == ("output",)
    assert [(n.name, n.op) for n in g.nodes] == [
        ("query", "LayerNorm"), ("qkv_proj", "Linear"), ("attn", "FlashAttention"),
        ("out_proj", "Linear"), ("output", "ResidualAdd")]
    assert g.node("attn").inputs == ("qkv_proj",)  # packed QKV after the projection
    ln, qkv, o = layers[0], layers[1], layers[3]
    h = F.layer_norm(q, (H,), t(ln, "weight"), t(ln, "bias"), 1e-5)
    qq, kk, vv = F.linear(h, t(qkv, "weight"), t(qkv, "bias")).split(H, dim=-1)
    att = merge(F.scaled_dot_product_attention(heads(qq), heads(kk), heads(vv), is_causal=True))
    gold = F.linear(att, t(o, "weight"), t(o, "bias")) + q
    atb.assert_close(out, gold, "fp32", "seed attention block vs torch")
    # the extra arguments really are ignored
    atb.assert_close(block(q, q * 0, q * 0, q * 0), gold, "fp32", "other extras")


def test_seed_mlp_block_fuses_and_matches_torch():
    layers = [L.LayerNorm(eps=1e-5), L.Linear(out_features=MLP), L.SiLU(),
              L.Linear(out_features=H), L.ResidualAdd()]
    block = GraphOp(layers)
    x = x_in()
    out = block(x)
    assert [n.op for n in block.graph.nodes] == ["LayerNorm", "FusedFeedForward"]
    assert block.graph.nodes[1].params.has_residual and block.graph.nodes[1].params.bias
    ln, up, down = layers[0], layers[1], layers[3]
    h = F.layer_norm(x, (H,), t(ln, "weight"), t(ln, "bias"), 1e-5)
    gold = F.linear(F.silu(F.linear(h, t(up, "weight"), t(up, "bias"))), t(down, "weight"),
                    t(down, "bias")) + x
    atb.assert_close(out, gold, "fp32", "seed MLP block vs torch")
    unfused = GraphOp(layers, fusion_config={"fusion_level": "conservative"})
    atb.assert_close(unfused(x), gold, "fp32", "unfused seed MLP vs torch")


def kv_block():
    return [L.LayerNorm(eps=1e-5), L.FlashAttention(num_heads=NH, causal=True, kv_cache=True),
            L.Linear(out_features=H), L.ResidualAdd()]


def torch_kv_block(layers, x):
    ln, att, o = layers[0], layers[1], layers[2]
    h = F.layer_norm(x, (H,), t(ln, "weight"), t(ln, "bias"), 1e-5)
    q, k, v = (F.linear(h, t(att, f"{p}_proj.weight")) for p in "qkv")
    a = merge(F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True))
    return F.linear(a, t(o, "weight"), t(o, "bias")) + x, k, v


@pytest.mark.parametrize("level", ["conservative", "standard"])
def test_kv_cache_prefill_then_decode_equals_the_full_sequence(level):
    layers = kv_block()
    g = lower_sequential(layers, [D((B, 4, H))], "attn_block")
    slot, = kv_cache_slots(g)
    assert g.inputs == ("input", "attention.past_key", "attention.past_value")
    assert g.outputs == ("residual_add", "attention.present_key", "attention.present_value")
    assert (slot.past_key, slot.present_value) == ("attention.past_key", "attention.present_value")
    assert g.desc_map["attention.past_key"] == D((B, 0, H))
    g, _ = run_pipeline(g, FusionConfig(fusion_level=level, verify=True))
    x = x_in()
    gold, k_full, v_full = torch_kv_block(layers, x)
    empty = np.zeros((B, 0, H), np.float32)
    y0, pk, pv = run_graph(g, [x[:, :4].numpy(), empty, empty])
    outs = [y0]
    for i in (4, 5):  # decode one token at a time
        y, pk, pv = run_graph(g, [x[:, i:i + 1].numpy(), pk, pv])
        outs.append(y)
    atb.assert_close(np.concatenate(outs, axis=1), gold, "fp32", "prefill + decode vs full")
    atb.assert_close(pk, k_full, "fp32", "present key")
    atb.assert_close(pv, v_full, "fp32", "present value")


def rope_torch(x, pos, base=10000.0):  # HF rotate_half RoPE on [B, N, S, D]
    inv = 1.0 / base ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    f = pos.double()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos().float(), emb.sin().float()
    rot = torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], -1)
    return x * cos + rot * sin


@pytest.mark.parametrize("packed", [True, False])
def test_rope_before_attention_rotates_q_and_k(packed):
    pre = [L.Linear(out_features=3 * H, bias=False)] if packed else [L.RmsNorm()]
    layers = pre + [L.RoPE(), L.FlashAttention("att", num_heads=NH, causal=True)]
    g = lower_sequential(layers, [D((B, S, H))], "rope")
    rope = next(n for n in g.nodes if n.op == "RoPE")
    assert rope.outputs == ("rope.q_out", "rope.k_out")
    x = x_in()
    if packed:
        q, k, v = F.linear(x, t(layers[0], "weight")).split(H, -1)
    else:
        h = F.rms_norm(x, (H,), eps=1e-6)
        q, k, v = (F.linear(h, t(layers[2], f"{p}_proj.weight")) for p in "qkv")
    pos = torch.arange(S)
    gold = merge(F.scaled_dot_product_attention(rope_torch(heads(q), pos),
                                                rope_torch(heads(k), pos), heads(v),
                                                is_causal=True))
    atb.assert_close(run_graph(g, [x.numpy()])[0], gold, "fp32", "RoPE + attention vs torch")
    fused, _ = run_pipeline(g, FusionConfig(verify=True))
    assert "RopeFlashAttention" in [n.op for n in fused.nodes]
    atb.assert_close(run_graph(fused, [x.numpy()])[0], gold, "fp32", "fused RoPE attention")


def test_kv_cache_with_rope_takes_positions():
    layers = [L.RoPE(), L.FlashAttention("att", num_heads=NH, causal=True, kv_cache=True)]
    g = lower_sequential(layers, [D((B, 4, H))], "rk")
    assert g.inputs == ("input", "att.past_key", "att.past_value", "att.position_ids")
    assert kv_cache_slots(g)[0].position_ids == "att.position_ids"
    x = x_in()
    full = lower_sequential(layers, [D((B, S, H))], "rk")
    empty = np.zeros((B, 0, H), np.float32)
    gold = run_graph(full, [x.numpy(), empty, empty, np.arange(S)])[0]
    y0, pk, pv = run_graph(g, [x[:, :4].numpy(), empty, empty, np.arange(4)])
    y1, _, _ = run_graph(g, [x[:, 4:].numpy(), pk, pv, np.arange(4, S)])
    atb.assert_close(np.concatenate([y0, y1], 1), gold, "fp32", "rope with cache")


def test_fused_feed_forward_layer_and_named_residuals():
    ffn = L.FusedFeedForward("ffn", intermediate_size=MLP)
    layers = [L.RmsNorm("norm"), ffn, L.ResidualAdd("res", "norm")]
    g = lower_sequential(layers, [D((B, S, H))], "f")
    assert g.node("res").inputs == ("ffn", "norm")
    x = x_in()
    h = F.rms_norm(x, (H,), eps=1e-6)
    gold = F.linear(F.silu(F.linear(h, t(ffn, "gate_proj.weight"))) *
                    F.linear(h, t(ffn, "up_proj.weight")), t(ffn, "down_proj.weight")) + h
    atb.assert_close(run_graph(g, [x.numpy()])[0], gold, "fp32", "ffn layer vs torch")
    with pytest.raises(GraphError, match="f/res: residual 'nowhere'"):
        lower_sequential([L.SiLU(), L.ResidualAdd("res", "nowhere")], [D((B, S, H))], "f")
    with pytest.raises(GraphError, match="already used"):
        lower_sequential([L.SiLU("a"), L.SiLU("a")], [D((B, S, H))], "f")
    # unnamed layers never take a name a later layer asked for
    g = lower_sequential([L.SiLU(), L.SiLU("silu")], [D((B, S, H))], "f")
    assert [n.name for n in g.nodes] == ["silu_1", "silu"]


@pytest.mark.parametrize("make", [seed_attention_block, kv_block])
def test_standard_fusion_keeps_seed_block_results(make):
    g = lower_sequential(make(), [D((B, S, H))], "b")
    fused, _ = run_pipeline(g, FusionConfig(verify=True))
    xs = [x_in().numpy()] + [np.zeros(g.desc_map[i].shape, np.float32) for i in g.inputs[1:]]
    for a, b in zip(run_graph(g, xs), run_graph(fused, xs)):
        atb.assert_close(b, a, "fp32", "fused vs unfused")
