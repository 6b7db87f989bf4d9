"""The in-place cache form: a block called with an ``atb.KVCache`` writes its new
keys/values into the cache (ReshapeAndCache) and attends over it where it is
(PagedAttention), with one bound program for every decode step. Oracles: the same
block run on the whole sequence without a cache, the concatenating (dict-cache)
form, torch.nn.functional, and node-by-node execution of the same plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from atbcore.errors import DtypeError, InputError, ShapeError
from atbcore.graph import layers as L
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.layers_attention import FlashAttention, RoPE
from atbcore.memory import KVCache
from atbcore.runtime.profiler import Profiler
from oracle import rand

B, S, H, NH = 2, 9, 64, 4
D = H // NH


def seed_block(name="attn"):
    return GraphOp([L.LayerNorm(eps=1e-5), FlashAttention(num_heads=NH, causal=True, kv_cache=True),
                    L.Linear(out_features=H), L.ResidualAdd()], name=name)


def rope_gqa_block(kv_heads=2):
    """RmsNorm -> packed QKV Linear -> RoPE -> GQA attention -> o-proj -> residual."""
    return GraphOp([L.RmsNorm(eps=1e-6), L.Linear(out_features=(NH + 2 * kv_heads) * D, bias=False),
                    RoPE(), FlashAttention(num_heads=NH, num_kv_heads=kv_heads, causal=True,
                                           kv_cache=True),
                    L.Linear(out_features=H, bias=False), L.ResidualAdd()], name="rope_gqa")


def _steps(op, x, kv, split=5):
    outs = []
    y, kv = op(x[:, :split], kv_cache=kv)
    outs.append(y)
    for t in range(split, x.shape[1]):
        y, kv = op(x[:, t:t + 1], kv_cache=kv)
        outs.append(y)
    return torch.cat(outs, dim=1), kv


def _cache(dtype="fp32", kv_heads=NH, seq=16, batch=B):
    return KVCache(num_layers=2, max_batch=batch, max_seq_len=seq, num_kv_heads=kv_heads,
                   head_dim=D, dtype=dtype)


def test_in_place_form_matches_full_sequence_and_torch_and_reuses_one_program():
    op = seed_block()
    x = torch.from_numpy(rand([B, S, H], seed=1))
    full = op(x)
    cache = _cache()
    got, back = _steps(op, x, cache)
    assert back is cache
    atb.assert_close(got, full, "fp32", "in-place cache decode vs the whole sequence")
    form = op._in_place
    ops = [n.op for n in form.graph.nodes]
    assert "ReshapeAndCache" in ops and "PagedAttention" in ops and "Concat" not in ops
    assert form.cache_stats()["plans"] == 2  # the prefill and one for every decode step
    assert cache.seq_lens(layer=0)[:B].tolist() == [S, S]
    op.destroy()  # the in-place form goes with it
    assert form._destroyed
    # the cache holds k = LN(x) W_k^T, written in place
    w = {k: torch.from_numpy(np.asarray(v)) for k, v in op.graph_unfused.weights}
    h = F.layer_norm(x, [H], w["layer_norm.weight"], w["layer_norm.bias"], 1e-5)
    k = F.linear(h, w["attention.k_proj.weight"]).view(B, S, NH, D)
    atb.assert_close(cache.keys(0)[:B, :S], k, "fp32", "keys in the cache")
    assert not cache.keys(0)[:B, S:].any()  # nothing past the tokens written
    cache.free()


def test_in_place_form_with_rope_gqa_and_packed_qkv_equals_the_dict_cache_form():
    op = rope_gqa_block()
    x = torch.from_numpy(rand([B, S, H], seed=2))
    want, _ = _steps(op, x, None)  # the concatenating form, a dict cache
    cache = _cache(kv_heads=2)
    got, _ = _steps(op, x, cache)
    atb.assert_close(got, want, "fp32", "in-place vs concatenating cache form")
    atb.assert_close(got, op(x), "fp32", "in-place decode vs the whole sequence")
    # RoPE and the cache write are one kernel (the rope_cache fusion)
    ops = [n.op for n in op._in_place.graph.nodes]
    assert "RopeKVCache" in ops and "RoPE" not in ops and "ReshapeAndCache" not in ops


@pytest.mark.parametrize("block,kv_heads", [(seed_block, NH), (rope_gqa_block, 2)])
def test_in_place_program_is_bit_equal_to_node_by_node_execution(block, kv_heads):
    op = block()
    x = torch.from_numpy(rand([B, 6, H], seed=3))
    cache = _cache(kv_heads=kv_heads)
    op(x[:, :5], kv_cache=cache)
    form = op._in_place
    tok = x[:, 5:6]
    inputs, shape = form._feeder.prepare(tok, cache)
    plan, exact = form.plan_for(inputs)
    unbound = plan.run(dict(zip(plan.graph.inputs, inputs)), descs=exact,
                       profiler=Profiler("unbound"))[0].clone()
    bound = form.execute(inputs)[0]  # writes the same cache row again: same values
    assert all(plan.programs[form._hot[2]].bound.values())
    assert torch.equal(bound, unbound)
    # the cache's own value checks ran at the feeder: the plan trusts its index inputs
    trusted = {c.node: c.trusted for c in plan.calls}
    write = next(c.node for c in plan.calls if c.op in ("ReshapeAndCache", "RopeKVCache"))
    assert trusted[write] and trusted["attention"]
    assert not any(v for n, v in trusted.items() if "norm" in n)
    cache.free()


def test_numpy_blocks_take_the_in_place_form_too():
    op = seed_block()
    x = rand([B, S, H], seed=4)
    cache = _cache()
    outs = [op(x[:, :4], kv_cache=cache)[0]]
    for t in range(4, S):
        outs.append(op(x[:, t:t + 1], kv_cache=cache)[0])
    assert isinstance(outs[0], np.ndarray)
    atb.assert_close(np.concatenate(outs, axis=1), op(x), "fp32", "numpy in-place decode")
    cache.free()


def _state(cache):
    return cache.seq_lens().copy(), cache.keys(0).clone(), cache.values(0).clone()


def _unchanged(cache, before):
    lens, k, v = before
    assert (cache.seq_lens() == lens).all()
    assert torch.equal(cache.keys(0), k) and torch.equal(cache.values(0), v)


def test_bad_calls_raise_and_leave_the_cache_untouched():
    op = seed_block()
    x = torch.from_numpy(rand([B, 12, H], seed=5))
    cache = _cache(seq=8)
    op(x[:, :6], kv_cache=cache)
    before = _state(cache)
    with pytest.raises(ShapeError, match="max_seq_len 8"):
        op(x[:, 6:9], kv_cache=cache)  # 6 + 3 tokens > 8
    _unchanged(cache, before)
    with pytest.raises(InputError, match="max_batch"):
        op(torch.zeros(B + 1, 1, H), kv_cache=cache)
    _unchanged(cache, before)
    with pytest.raises(DtypeError, match="KVCache dtype"):
        op(x[:, 6:7], kv_cache=_cache(dtype="bf16"))
    cache.append(1, torch.zeros(1, 1, NH, D), torch.zeros(1, 1, NH, D), seq_ids=[0])
    other = seed_block("second")
    other(x[:, :1], kv_cache=_cache())  # a cache it owns layer 0 of: fine
    lens = cache.seq_lens(layer=1)[:B].tolist()
    other(x[:, :1], kv_cache=cache)  # takes layer 1, whose rows now differ: each its own past
    assert cache.seq_lens(layer=1)[:B].tolist() == [n + 1 for n in lens]
    cache.free()
    with pytest.raises(atb.AtbError, match="freed"):
        op(x[:, 6:7], kv_cache=cache)


def test_a_block_given_as_a_graph_concatenates_with_a_cache_object():
    src = seed_block()
    x = torch.from_numpy(rand([B, S, H], seed=6))
    full = src(x)
    op = GraphOp(src.graph_unfused, name="from_graph")
    cache = _cache()
    got, _ = _steps(op, x, cache)
    assert op._in_place is False  # no layers to lower again: the concatenating form ran
    atb.assert_close(got, full, "fp32", "graph-given block with a KVCache")
    op.destroy()  # with no in-place form to destroy
    with pytest.raises(atb.AtbError, match="destroyed"):
        op(x, kv_cache=cache)
    cache.free()


def test_kv_cache_advance_checks_before_counting():
    cache = _cache(seq=4)
    cache.advance(0, 3, range(2))
    assert cache.seq_lens(layer=0)[:2].tolist() == [3, 3]
    with pytest.raises(ShapeError, match="max_seq_len"):
        cache.advance(0, 2, [0])
    with pytest.raises(InputError, match="count"):
        cache.advance(0, -1)
    with pytest.raises(InputError, match="seq_ids"):
        cache.advance(0, 1, range(3))  # max_batch is 2
    assert cache.seq_lens(layer=0)[:2].tolist() == [3, 3]
    cache.advance(range(0, 2), 1, range(1))  # both layers, row 0: one call
    assert cache.seq_lens(range(2), range(0, 2)).tolist() == [[4, 3], [1, 0]]
    with pytest.raises(InputError, match="layer"):
        cache.advance(range(1, 3), 1)  # the cache has layers 0 and 1
    assert cache.seq_lens(range(2), range(0, 2)).tolist() == [[4, 3], [1, 0]]
    cache.free()
