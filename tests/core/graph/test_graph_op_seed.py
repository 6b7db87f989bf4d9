"""The seed articles' GraphOps: the MLP block and the attention block (with and
without KV cache) run fused and match an unfused NumPy-reference execution of the
same graph (G1's interpreter, independent of the runtime) and torch.nn.functional."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from atbcore.graph import layers as L
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.layers_attention import FlashAttention
from atbcore.memory import KVCache
from interp import run_graph
from oracle import rand

B, S, H, NH, MLP = 2, 8, 64, 4, 128


def mlp_block() -> GraphOp:
    return GraphOp([L.LayerNorm(eps=1e-5), L.Linear(out_features=MLP), L.SiLU(),
                    L.Linear(out_features=H), L.ResidualAdd()], name="mlp")


def attention_block(kv_cache=True, name="attention") -> GraphOp:
    return GraphOp([L.LayerNorm(eps=1e-5),
                    FlashAttention(num_heads=NH, causal=True, kv_cache=kv_cache),
                    L.Linear(out_features=H), L.ResidualAdd()], name=name)


def unfused_reference(op: GraphOp, *xs) -> list[np.ndarray]:
    return run_graph(op.graph_unfused, [np.asarray(x) for x in xs])


def test_mlp_block_fuses_and_matches_reference_and_torch():
    op = mlp_block()
    x = rand([B, S, H], seed=1)
    y = op(x)
    assert [n.op for n in op.graph.nodes] == ["LayerNorm", "FusedFeedForward"]
    atb.assert_close(y, unfused_reference(op, x)[0], what="mlp vs unfused numpy")
    w = {k: torch.from_numpy(np.asarray(v)) for k, v in op.graph_unfused.weights}
    xt = torch.from_numpy(x)
    h = F.layer_norm(xt, [H], w["layer_norm.weight"], w["layer_norm.bias"], 1e-5)
    h = F.silu(F.linear(h, w["linear.weight"], w["linear.bias"]))
    want = F.linear(h, w["linear_1.weight"], w["linear_1.bias"]) + xt
    atb.assert_close(y, want.numpy(), what="mlp vs torch.nn.functional")
    from atbcore.backends.torch import TORCH_KERNELS
    assert op.last_launches == sum(TORCH_KERNELS[n.op].launches for n in op.graph.nodes)


def test_attention_block_prefill_matches_reference_and_torch():
    op = attention_block()
    x = rand([B, S, H], seed=2)
    (y, state) = op(x, kv_cache=None)
    assert "FlashAttention" in [n.op for n in op.graph.nodes]
    empty = np.zeros((B, 0, H), np.float32)
    ref = unfused_reference(op, x, empty, empty)
    atb.assert_close(y, ref[0], what="attention block vs unfused numpy")
    (pk, pv), = state[op._kv.key]
    atb.assert_close(pk, ref[1], what="present key")
    w = {k: torch.from_numpy(np.asarray(v)) for k, v in op.graph_unfused.weights}
    xt = torch.from_numpy(x)
    h = F.layer_norm(xt, [H], w["layer_norm.weight"], w["layer_norm.bias"], 1e-5)
    q, k, v = (F.linear(h, w[f"attention.{p}_proj.weight"]).view(B, S, NH, -1).transpose(1, 2)
               for p in "qkv")
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, H)
    want = F.linear(a, w["linear.weight"], w["linear.bias"]) + xt
    atb.assert_close(y, want.numpy(), what="attention block vs torch SDPA")


def _host(y):
    return y.cpu().numpy() if hasattr(y, "cpu") else np.asarray(y)


def _decode_steps(op, x, cache, split=5):
    """Prefill ``split`` tokens, then one token per call; returns the outputs, concatenated."""
    outs = []
    y, cache = op(x[:, :split], kv_cache=cache)
    outs.append(_host(y))
    for t in range(split, x.shape[1]):
        y, cache = op(x[:, t:t + 1], kv_cache=cache)
        outs.append(_host(y))
    return np.concatenate(outs, axis=1), cache


def test_kv_cache_decoding_equals_the_full_sequence():
    op = attention_block()
    x = rand([B, S, H], seed=3)
    full = op(x)  # no cache given: empty past, output only
    assert op.infer_shape([atb.TensorDesc((B, S, H))]) == [atb.TensorDesc((B, S, H))] * 3
    got, state = _decode_steps(op, x, None)
    atb.assert_close(got, full, what="dict-cache decode vs full sequence")
    (pk, _), = state[op._kv.key]
    assert pk.shape == (B, S, H)
    st = op.cache_stats()
    assert st["plans"] < st["signatures"]  # decode steps share bucketed plans


def test_kv_cache_object_is_filled_in_place():
    op = attention_block()
    x = rand([B, S, H], seed=4)
    full = op(x)
    cache = KVCache(num_layers=2, max_batch=B, max_seq_len=16, num_kv_heads=NH,
                    head_dim=H // NH, dtype="fp32")
    got, back = _decode_steps(op, x, cache)
    assert back is cache
    atb.assert_close(got, full, what="KVCache decode vs full sequence")
    assert cache.seq_lens(layer=0)[:B].tolist() == [S, S]
    assert cache.seq_lens(layer=1)[:B].tolist() == [0, 0]  # this GraphOp took layer 0
    cache.free()


class AcceleratedTransformerBlock:
    """The seed's block: ``x, kv_cache = self.attention_graph(x, kv_cache=kv_cache)``."""

    def __init__(self, name):
        self.attention_graph = attention_block(name=f"{name}.attn")
        self.mlp_graph = GraphOp([L.LayerNorm(eps=1e-5), L.Linear(out_features=MLP), L.SiLU(),
                                  L.Linear(out_features=H), L.ResidualAdd()], name=f"{name}.mlp")

    def forward(self, x, kv_cache=None):
        x, kv_cache = self.attention_graph(x, kv_cache=kv_cache)
        x = self.mlp_graph(x)
        return x, kv_cache


def test_seed_model_loop_shares_one_cache_across_layers():
    layers = [AcceleratedTransformerBlock(f"layer{i}") for i in range(2)]
    x = rand([1, 6, H], seed=5)

    def model(inp, kv):
        for layer in layers:
            inp, kv = layer.forward(inp, kv_cache=kv)
        return inp, kv

    full, _ = model(x, None)
    kv = None
    y1, kv = model(x[:, :4], kv)
    y2, kv = model(x[:, 4:5], kv)
    y3, kv = model(x[:, 5:], kv)
    assert len(kv) == 2  # one entry per attention GraphOp
    atb.assert_close(np.concatenate([y1, y2, y3], axis=1), full, what="2-layer cached decode")


def test_seed_article_block_with_named_layers_and_four_arguments():
    block = GraphOp([L.LayerNorm("query", eps=1e-5), L.Linear("qkv_proj", out_features=3 * H),
                     FlashAttention("attn", num_heads=NH, causal=True),
                     L.Linear("out_proj", out_features=H), L.ResidualAdd("output", "input")])
    q, k, v, r = (rand([B, S, H], seed=s) for s in range(6, 10))
    with pytest.warns(UserWarning, match="ignored"):
        out = block(q, k, v, r)
    atb.assert_close(out, unfused_reference(block, q, k, v, r)[0], what="seed attention_block")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block(q, k, v, r)  # lowered once: no second warning
    assert block.graph.node("attn").op == "FlashAttention"
