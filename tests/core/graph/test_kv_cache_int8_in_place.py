"""The int8 KV cache on the core: ``KVCache(dtype="int8")`` (int8 rows, one fp16 scale
per token and KV head) in a GraphOp's in-place cache form, where the plan writes
with ``ReshapeAndCacheInt8`` and reads with ``PagedAttentionInt8``. Oracles: the
NumPy quantization rule (float64) for what lands in the cache, and the same block
over an fp32 cache for the outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.errors import DtypeError
from atbcore.graph import layers as L
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.layers_attention import FlashAttention, RoPE
from atbcore.memory import KVCache
from atbcore.ops.paged_int8 import dequantize_int8_np, quantize_int8_np
from oracle import rand

B, S, H, NH, HKV = 2, 9, 64, 4, 2
D = H // NH


def rope_gqa_block():
    """RmsNorm -> packed QKV -> RoPE -> GQA attention -> o-proj -> residual (seeded)."""
    return GraphOp([L.RmsNorm(eps=1e-6, seed=1),
                    L.Linear(out_features=(NH + 2 * HKV) * D, bias=False, seed=2),
                    RoPE(), FlashAttention(num_heads=NH, num_kv_heads=HKV, causal=True,
                                           kv_cache=True, seed=3),
                    L.Linear(out_features=H, bias=False, seed=4), L.ResidualAdd()],
                   name="rope_gqa")


def _cache(dtype):
    return KVCache(num_layers=1, max_batch=B, max_seq_len=16, num_kv_heads=HKV, head_dim=D,
                   dtype=dtype)


def _steps(op, x, kv, split=5):
    outs = []
    y, kv = op(x[:, :split], kv_cache=kv)
    outs.append(y)
    for t in range(split, x.shape[1]):
        y, kv = op(x[:, t:t + 1], kv_cache=kv)
        outs.append(y)
    return torch.cat(outs, dim=1)


def test_quantization_rule_round_trips_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((7, 3, 33)) * 5
    x[1, 2] = 0.0                                  # an all-zero head: scale 0, codes 0
    q, s = quantize_int8_np(x)
    assert q.dtype == np.int8 and s.dtype == np.float16 and s.shape == (7, 3)
    assert np.abs(q).max() <= 127 and not q[1, 2].any() and s[1, 2] == 0
    step = s.astype(np.float64)[..., None]
    assert (np.abs(dequantize_int8_np(q, s) - x) <= 0.5 * step + 1e-12).all()


def test_int8_cache_holds_d_plus_2_bytes_per_token_and_head():
    c8, c16 = _cache("int8"), _cache("bf16")
    assert c8.nbytes == c8.shape[0] * 2 * B * 16 * HKV * (D + 2)
    assert c8.nbytes / c16.nbytes == pytest.approx((D + 2) / (2 * D))
    assert tuple(c8.key_scales(0).shape) == (B, 16, HKV)
    with pytest.raises(DtypeError, match="KVCache"):
        c16.key_scales(0)
    c8.free(), c16.free()


def test_append_quantizes_and_get_dequantizes():
    c = _cache("int8")
    k = rand([B, 3, HKV, D], seed=3)
    v = rand([B, 3, HKV, D], seed=4)
    c.append(0, k, v, lengths=[3, 2])
    kq, ks = quantize_int8_np(k)
    got = np.asarray(c.keys(0))
    assert np.array_equal(got[0, :3], kq[0]) and np.array_equal(got[1, :2], kq[1, :2])
    assert np.array_equal(np.asarray(c.key_scales(0))[0, :3], ks[0])
    k_all, v_all, lens = c.get(0)
    assert list(np.asarray(lens)) == [3, 2]
    np.testing.assert_allclose(np.asarray(v_all)[0], dequantize_int8_np(*quantize_int8_np(v))[0],
                               rtol=0, atol=1e-6)
    assert c.bytes_used() == 5 * 2 * HKV * (D + 2)
    with pytest.raises(DtypeError, match="float"):
        c.append(0, kq, kq)
    c.free()


def test_in_place_form_over_an_int8_cache_matches_the_fp32_cache():
    x = torch.from_numpy(rand([B, S, H], seed=1))
    op32, op8 = rope_gqa_block(), rope_gqa_block()
    c32, c8 = _cache("fp32"), _cache("int8")
    ref, got = _steps(op32, x, c32), _steps(op8, x, c8)
    nodes = [n.op for n in op8._in_place.graph.nodes]
    assert "ReshapeAndCacheInt8" in nodes and "PagedAttentionInt8" in nodes
    assert "ReshapeAndCache" not in nodes and "PagedAttention" not in nodes
    assert op8._in_place.cache_stats()["plans"] == 2   # one program for every decode step
    # what the plan wrote is the fp32 cache's rows quantized by the NumPy rule
    kq, ks = quantize_int8_np(np.asarray(c32.keys(0))[:, :S])
    assert (np.abs(np.asarray(c8.keys(0))[:, :S].astype(int) - kq) <= 1).mean() == 1.0
    np.testing.assert_allclose(np.asarray(c8.key_scales(0))[:, :S], ks, rtol=1e-3)
    assert c8.seq_lens(layer=0).tolist() == [S, S]
    cos = torch.nn.functional.cosine_similarity(got.reshape(-1, H), ref.reshape(-1, H), dim=-1)
    assert float(cos.min()) > 0.9999
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())
    # a block lowered for an int8 cache refuses a float one, by name
    with pytest.raises(DtypeError, match="int8"):
        op8(x[:, :1], kv_cache=_cache("fp32"))
    c8.free(), c32.free()
