"""PagedKVCache with the real ops: paged attention over the block cache equals
contiguous attention (KVCache + FlashAttention) and SDPA over the same tokens, for
prefill and decode, GQA, batches of different lengths; copy-on-write forks at the
tensor level; running out of blocks loses nothing already cached."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from atbcore.errors import InputError, MemoryError_, ParamsError, PoolExhaustedError, ShapeError
from atbcore.memory import MemoryPool, MemoryPoolConfig
from atbcore.memory.kv_cache import KVCache
from atbcore.memory.paged import NoFreeBlocksError, PagedKVCache
from atbcore.numerics import assert_close
from oracle import as_torch, rand

H, HKV, D, BS = 4, 2, 16, 4


def op(name, **params):
    return atb.Builder().build_operation(name, params)


def sdpa(q, k, v, causal):
    """Independent oracle: q [n, H, D], k/v [m, Hkv, D] -> [n, H, D] (bottom-right causal)."""
    qt = torch.as_tensor(np.asarray(q, np.float32)).transpose(0, 1)  # [H, n, D]
    kt = torch.as_tensor(np.asarray(k, np.float32)).transpose(0, 1).repeat_interleave(H // HKV, 0)
    vt = torch.as_tensor(np.asarray(v, np.float32)).transpose(0, 1).repeat_interleave(H // HKV, 0)
    n, m = qt.shape[1], kt.shape[1]
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n) if causal else None
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(0, 1)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_paged_equals_contiguous_attention_prefill_and_decode(dtype):
    lens = [7, 3, 10]
    b, layers = len(lens), 2
    paged = PagedKVCache(layers, 16, BS, HKV, D, dtype)
    contig = KVCache(layers, b, 16, HKV, D, dtype)
    ids = ["s0", "s1", "s2"]
    pa = op("PagedAttention", num_heads=H, num_kv_heads=HKV, causal=True)
    fa = op("FlashAttention", num_heads=H, num_kv_heads=HKV, layout="BSND", causal=True)
    history = {i: ([], []) for i in range(b)}  # layer 0 keys/values, for the SDPA oracle

    batch = paged.prepare_prefill(ids, num_tokens=lens)
    t = sum(lens)
    assert batch.num_tokens == t and batch.q_seq_lens.tolist() == lens
    assert tuple(batch.block_tables.shape) == (b, 3)  # ceil(10 / 4)
    for layer in range(layers):
        k, v = rand((t, HKV, D), dtype, 10 * layer), rand((t, HKV, D), dtype, 10 * layer + 1)
        q = rand((t, H, D), dtype, 10 * layer + 2)
        paged.write(layer, k, v, batch.slot_mapping)
        out = pa.execute([as_torch(q), paged.key_cache(layer), paged.value_cache(layer),
                          batch.block_tables, batch.context_lens, batch.q_seq_lens])[0]
        start = 0
        for i, n in enumerate(lens):
            ks, vs, qs = k[start:start + n], v[start:start + n], q[start:start + n]
            contig.append(layer, ks[None], vs[None], seq_ids=[i])
            kc, vc, cl = contig.get(layer, [i])
            want = fa.execute([as_torch(qs[None]), kc, vc, cl])[0][0]
            assert_close(out[start:start + n], want, dtype, what=f"prefill seq {i} layer {layer}")
            assert_close(out[start:start + n], sdpa(qs, ks, vs, True), dtype, what="vs SDPA")
            if layer == 0:
                history[i][0].append(ks)
                history[i][1].append(vs)
            start += n
    paged.mark_computed(ids)

    for step in range(3):  # decode: one token per sequence, lengths stay different
        batch = paged.prepare_decode(ids)
        assert batch.context_lens.tolist() == [n + step + 1 for n in lens]
        for layer in range(layers):
            k, v = rand((b, HKV, D), dtype, 100 + step * 9 + layer), \
                rand((b, HKV, D), dtype, 200 + step * 9 + layer)
            q = rand((b, H, D), dtype, 300 + step * 9 + layer)
            paged.write(layer, k, v, batch.slot_mapping)
            out = pa.execute([as_torch(q), paged.key_cache(layer),
                              paged.value_cache(layer), batch.block_tables, batch.context_lens])[0]
            contig.append(layer, k[:, None], v[:, None])
            kc, vc, cl = contig.get(layer)
            want = fa.execute([as_torch(q[:, None]), kc, vc, cl])[0][:, 0]
            assert_close(out, want, dtype, what=f"decode step {step} layer {layer}")
            if layer == 0:
                for i in range(b):
                    history[i][0].append(k[i:i + 1])
                    history[i][1].append(v[i:i + 1])
                    ks, vs = np.concatenate(history[i][0]), np.concatenate(history[i][1])
                    assert_close(out[i:i + 1], sdpa(q[i:i + 1], ks, vs, True), dtype,
                                 what=f"decode seq {i} vs SDPA")
    for i, sid in enumerate(ids):  # the block cache holds exactly the tokens written
        kg, vg = paged.gather(0, sid)
        np.testing.assert_array_equal(kg.float().numpy(),
                                      np.concatenate(history[i][0]).astype(np.float32))


def test_fork_copies_on_write_at_tensor_level():
    cache = PagedKVCache(1, 8, BS, HKV, D, "fp32")
    p = rand((6, HKV, D), seed=1)
    batch = cache.prepare_prefill(["p"], num_tokens=[6])
    cache.write(0, p, p, batch.slot_mapping)
    cache.fork("p", "c")
    assert cache.manager.block_table("c") == cache.manager.block_table("p")
    kp, kc = rand((1, HKV, D), seed=2), rand((1, HKV, D), seed=3)
    cache.write(0, kc, kc, torch.tensor(cache.append_tokens("c"), dtype=torch.int32))
    cache.write(0, kp, kp, torch.tensor(cache.append_tokens("p"), dtype=torch.int32))
    np.testing.assert_array_equal(cache.gather(0, "p")[0].numpy(), np.concatenate([p, kp]))
    np.testing.assert_array_equal(cache.gather(0, "c")[0].numpy(), np.concatenate([p, kc]))
    tp, tc = cache.manager.block_table("p"), cache.manager.block_table("c")
    assert tp[0] == tc[0] and tp[1] != tc[1]  # full block shared, partial one copied


def test_out_of_blocks_keeps_everything_cached():
    cache = PagedKVCache(1, 4, BS, HKV, D, "fp32")
    k = rand((12, HKV, D), seed=5)
    batch = cache.prepare_prefill(["a", "b"], num_tokens=[8, 4])
    cache.write(0, k, k, batch.slot_mapping)
    before = {s: cache.gather(0, s)[0].clone() for s in ("a", "b")}
    tables = {s: cache.manager.block_table(s) for s in ("a", "b")}
    with pytest.raises(NoFreeBlocksError) as e:
        cache.prepare_prefill(["c"], num_tokens=[5])
    assert isinstance(e.value, PoolExhaustedError) and "free=1" in str(e.value)
    cache.append_tokens("b", 4)  # the last free block
    with pytest.raises(NoFreeBlocksError):
        cache.prepare_decode(["a", "b"])
    assert cache.manager.num_tokens("a") == 8 and cache.manager.num_tokens("b") == 8
    for s in ("a", "b"):
        assert cache.manager.block_table(s)[:len(tables[s])] == tables[s]
        torch.testing.assert_close(cache.gather(0, s)[0][:len(before[s])], before[s],
                                   rtol=0, atol=0)
    cache.free_sequence("b")  # preempt b; a can continue and c can start
    cache.prepare_decode(["a"])
    assert cache.prepare_prefill(["c"], num_tokens=[3]).num_tokens == 3


def test_memory_errors_and_params():
    pool = MemoryPool(MemoryPoolConfig(max_size=1 << 20, device="cpu"))
    cache = PagedKVCache(2, 8, BS, HKV, D, "fp16", pool=pool)
    assert cache.key_cache(1).shape == (8, BS, HKV, D) and cache.nbytes == 2 * 2 * 8 * BS * HKV * D * 2
    assert pool.stats()["allocated"] == cache.nbytes and pool.live_blocks()[0].pinned
    assert cache.key_cache(0).data_ptr() != cache.value_cache(0).data_ptr()
    with pytest.raises(InputError, match="layer"):
        cache.key_cache(2)
    batch = cache.prepare_prefill(["x"], num_tokens=[3])
    with pytest.raises(ShapeError, match="ReshapeAndCache"):
        cache.write(0, rand((3, HKV, D + 1), "fp16"), rand((3, HKV, D + 1), "fp16"),
                    batch.slot_mapping)
    cache.destroy()
    assert pool.stats()["allocated"] == 0
    with pytest.raises(MemoryError_, match="destroyed"):
        cache.prepare_decode(["x"])
    with pytest.raises(ParamsError, match="block_size"):
        PagedKVCache(1, 8, 0, HKV, D)
