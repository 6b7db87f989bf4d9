"""The decoder position layers, device-free (NumPy interpreter as the oracle):
RoPE from a frequency table (``inv_freq``, ``attention_factor``), per-head q/k
RmsNorm before it, and learned absolute positions (:mod:`atbcore.graph.layers_position`)."""

from __future__ import annotations

import numpy as np

import atbcore as atb
from atbcore.graph import layers as L
from atbcore.graph.layers_attention import FlashAttention, RoPE
from atbcore.graph.layers_position import PositionEmbedding
from atbcore.graph.sequential import lower_sequential
from interp import run_graph

D = atb.TensorDesc
H, HEADS, HD = 32, 4, 8


def _attn(rope, **kw):
    lin = L.Linear("qkv", out_features=3 * H, seed=1)
    return [lin, rope, FlashAttention("attn", num_heads=HEADS, causal=True, **kw)]


def _run(layers, x):
    g = lower_sequential(layers, [D(x.shape, "fp32")], "t")
    return run_graph(g, [x])[0], g


def test_rope_from_inv_freq_equals_rope_from_its_base_and_scales_by_the_factor():
    x = np.random.default_rng(0).standard_normal((2, 5, H)).astype(np.float32)
    inv = 500.0 ** (-np.arange(0, HD, 2) / HD)
    by_base, _ = _run(_attn(RoPE("rope", base=500.0)), x)
    by_table, g = _run(_attn(RoPE("rope", inv_freq=inv)), x)
    np.testing.assert_allclose(by_table, by_base, rtol=1e-5, atol=1e-6)
    assert any(t.startswith("rope_table") for t, _ in g.weights)
    # a factor scales cos and sin: q.k logits by factor**2, as a scale would
    scaled, _ = _run(_attn(RoPE("rope", inv_freq=inv, attention_factor=1.5)), x)
    want, _ = _run(_attn(RoPE("rope", base=500.0), scale=1.5 ** 2 / np.sqrt(HD)), x)
    np.testing.assert_allclose(scaled, want, rtol=1e-4, atol=1e-5)


def test_qk_norm_rms_normalises_each_head_of_q_and_k():
    x = np.random.default_rng(1).standard_normal((1, 4, H)).astype(np.float32)
    wq, wk = np.full(HD, 0.5, np.float32), np.full(HD, 2.0, np.float32)
    fa = FlashAttention("attn", num_heads=HEADS, causal=True, qk_norm_eps=1e-6)
    fa.load_weights({"q_norm.weight": wq, "k_norm.weight": wk})
    got, g = _run([L.Linear("qkv", out_features=3 * H, seed=1), fa], x)
    qkv = x @ g.weight_map["qkv.weight"].T + g.weight_map["qkv.bias"]
    q, k, v = (qkv[..., i * H:(i + 1) * H].reshape(4, HEADS, HD) for i in range(3))
    rms = lambda t, w: t / np.sqrt((t * t).mean(-1, keepdims=True) + 1e-6) * w  # noqa: E731
    q, k = rms(q, wq), rms(k, wk)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD)
    s = np.where(np.tril(np.ones((4, 4), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("hqk,khd->qhd", p, v).reshape(1, 4, H)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_position_embedding_adds_the_rows_of_positions_0_to_s():
    x = np.random.default_rng(2).standard_normal((2, 3, H)).astype(np.float32)
    table = np.random.default_rng(3).standard_normal((10, H)).astype(np.float32)
    got, _ = _run([PositionEmbedding("pos").load_weights({"weight": table})], x)
    np.testing.assert_allclose(got, x + table[:3], rtol=1e-6)
