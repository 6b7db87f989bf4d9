"""Contiguous KVCache: in-place appends with per-sequence lengths, views for attention
(FlashAttention over the cache equals SDPA over the concatenated tokens), memory from
the pool, and every error leaving the cache untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F

import atbcore as atb
from atbcore.errors import DeviceError, DtypeError, InputError, MemoryError_, ParamsError, ShapeError
from atbcore.memory import MemoryPool, MemoryPoolConfig
from atbcore.memory.kv_cache import KVCache
from atbcore.numerics import assert_close
from atbcore.tensor import to_numpy
from oracle import as_torch, rand

L, B, S, HKV, D = 2, 3, 16, 2, 8


def make(device="numpy", dtype="fp32", **kw) -> tuple[KVCache, MemoryPool]:
    pool = MemoryPool(MemoryPoolConfig(max_size=1 << 22, device=device))
    return KVCache(L, B, S, HKV, D, dtype=dtype, device=device, pool=pool, **kw), pool


@pytest.mark.parametrize("device", ["cpu", "numpy"])
def test_appends_write_in_place_with_ragged_lengths(device):
    cache, pool = make(device)
    allocs = pool.stats()["alloc_count"]
    ptr = to_numpy(cache.keys(0)).ctypes.data
    history = {(lay, s): [] for lay in range(L) for s in range(B)}
    # prefill with right padding: valid lengths 5, 3, 4
    lens = [5, 3, 4]
    for lay in range(L):
        k, v = rand((B, 5, HKV, D), seed=lay), rand((B, 5, HKV * D), seed=10 + lay)
        cache.append(lay, k, v, lengths=lens)
        for s in range(B):
            history[lay, s].append((k[s, :lens[s]], v[s, :lens[s]].reshape(-1, HKV, D)))
    # three decode steps, sequence 1 only in the last two
    for step in range(3):
        ids = [0, 1, 2] if step == 0 else [2, 0]
        for lay in range(L):
            k = rand((len(ids), 1, HKV, D), seed=100 + step * 7 + lay)
            v = rand((len(ids), 1, HKV, D), seed=200 + step * 7 + lay)
            cache.append(lay, k, v, seq_ids=ids)
            for row, s in enumerate(ids):
                history[lay, s].append((k[row], v[row]))
    assert cache.seq_lens().tolist() == [8, 4, 7]
    assert pool.stats()["alloc_count"] == allocs  # no allocation per step
    assert to_numpy(cache.keys(0)).ctypes.data == ptr
    for lay in range(L):
        k, v, got_lens = cache.get(lay)
        assert to_numpy(got_lens).tolist() == [8, 4, 7] and tuple(k.shape) == (B, 8, HKV, D)
        for s in range(B):
            want_k = np.concatenate([h[0] for h in history[lay, s]])
            want_v = np.concatenate([h[1] for h in history[lay, s]])
            n = len(want_k)
            np.testing.assert_array_equal(to_numpy(k)[s, :n], want_k)
            np.testing.assert_array_equal(to_numpy(v)[s, :n], want_v)
    # get() of a contiguous range is a view, of scattered ids a gathered copy
    k01, _, _ = cache.get(0, [0, 1])
    assert to_numpy(k01).ctypes.data == ptr
    k20, _, l20 = cache.get(0, [2, 0])
    np.testing.assert_array_equal(to_numpy(k20)[1], to_numpy(cache.get(0)[0])[0])
    np.testing.assert_array_equal(to_numpy(k20)[0, :7], to_numpy(cache.get(0)[0])[2, :7])
    assert to_numpy(l20).tolist() == [7, 8]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_decode_attention_over_the_cache_matches_sdpa(dtype):
    """GQA decode: FlashAttention on the cache views with seq_lens equals SDPA on each
    sequence's concatenated keys (an independent oracle), and the NumPy reference."""
    h = 4
    cache, _ = make("cpu", dtype)
    lens = [6, 2, 5]
    k0, v0 = rand((B, 6, HKV, D), dtype, 1), rand((B, 6, HKV, D), dtype, 2)
    cache.append(0, k0, v0, lengths=lens)
    k1, v1 = rand((B, 1, HKV, D), dtype, 3), rand((B, 1, HKV, D), dtype, 4)
    cache.append(0, k1, v1)
    q = rand((B, 1, h, D), dtype, 5)
    k, v, seq_lens = cache.get(0)
    op = atb.Builder().build_operation("FlashAttention", {"num_heads": h, "num_kv_heads": HKV,
                                                          "layout": "BSND", "causal": True})
    out = op.execute([as_torch(q), k, v, seq_lens])[0]
    ref = atb.Builder(backend="numpy").build_operation(
        "FlashAttention", {"num_heads": h, "num_kv_heads": HKV, "layout": "BSND",
                           "causal": True}).execute([q, to_numpy(k).copy(), to_numpy(v).copy(),
                                                     to_numpy(seq_lens).copy()])[0]
    assert_close(out, ref, dtype, what="cache attention vs reference")
    for s in range(B):
        ks = np.concatenate([k0[s, :lens[s]], k1[s]]).astype(np.float32)  # [n, Hkv, D]
        vs = np.concatenate([v0[s, :lens[s]], v1[s]]).astype(np.float32)
        kt = as_torch(ks).transpose(0, 1).repeat_interleave(h // HKV, 0)  # [H, n, D]
        vt = as_torch(vs).transpose(0, 1).repeat_interleave(h // HKV, 0)
        qt = as_torch(q[s].astype(np.float32)).transpose(0, 1)  # [H, 1, D]
        want = F.scaled_dot_product_attention(qt, kt, vt).transpose(0, 1)  # [1, H, D]
        assert_close(out[s], want, dtype, what=f"sequence {s} vs SDPA")


def test_memory_comes_from_the_pool_and_returns():
    cache, pool = make("cpu", "fp16")
    nbytes = L * 2 * B * S * HKV * D * 2
    assert cache.nbytes == nbytes and pool.stats()["allocated"] == -(-nbytes // 64) * 64
    assert pool.live_blocks()[0].pinned  # defragmentation never moves cache memory
    cache.free()
    assert pool.stats()["allocated"] == 0
    with pytest.raises(MemoryError_, match="freed cache"):
        cache.append(0, rand((1, 1, HKV, D), "fp16"), rand((1, 1, HKV, D), "fp16"))
    cache.free()  # idempotent
    with KVCache(1, 1, 4, 1, 8, "fp32", device="numpy") as private:
        # the process-wide pool is on torch/cpu: a numpy cache gets a private pool
        assert isinstance(private.keys(0), np.ndarray) and private.pool.stats()["reserved"] > 0
    assert private.pool.stats()["reserved"] == 0


def test_errors_leave_the_cache_untouched():
    cache, pool = make("numpy")
    k = rand((2, 3, HKV, D))
    cache.append(0, k, k, seq_ids=[0, 1])
    snap = to_numpy(cache.keys(0)).copy(), cache.seq_lens(layer=0).copy()

    def same():
        np.testing.assert_array_equal(to_numpy(cache.keys(0)), snap[0])
        np.testing.assert_array_equal(cache.seq_lens(layer=0), snap[1])

    cases = [
        (DtypeError, "dtype", lambda: cache.append(0, k.astype(np.float16), k.astype(np.float16),
                                                  seq_ids=[0, 1])),
        (ShapeError, "shape", lambda: cache.append(0, rand((2, 3, HKV + 1, D)),
                                                   rand((2, 3, HKV + 1, D)), seq_ids=[0, 1])),
        (ShapeError, "overflows max_seq_len", lambda: cache.append(0, rand((2, 14, HKV, D)),
                                                                   rand((2, 14, HKV, D)),
                                                                   seq_ids=[1, 0])),
        (InputError, "seq_ids", lambda: cache.append(0, k, k, seq_ids=[0, 3])),
        (InputError, "seq_ids", lambda: cache.append(0, k, k, seq_ids=[1, 1])),
        (InputError, "seq_ids", lambda: cache.append(0, k, k, seq_ids=[0])),
        (InputError, "layer", lambda: cache.append(2, k, k, seq_ids=[0, 1])),
        (InputError, "lengths", lambda: cache.append(0, k, k, seq_ids=[0, 1], lengths=[4, 1])),
    ]
    for exc, frag, call in cases:
        with pytest.raises(exc, match=frag) as e:
            call()
        assert str(e.value).startswith("KVCache")
        same()
    with pytest.raises(ParamsError, match="max_seq_len"):
        KVCache(1, 1, 0, 1, 8)
    with pytest.raises(ParamsError, match="dtype"):
        KVCache(1, 1, 4, 1, 8, dtype="float7")
    with pytest.raises(DeviceError, match="pool device"):
        KVCache(1, 1, 4, 1, 8, device="cpu", pool=pool)


def test_reset_and_truncate():
    cache, _ = make("numpy")
    k = rand((B, 4, HKV, D))
    for lay in range(L):
        cache.append(lay, k, k)
    cache.truncate(1, 2)
    cache.reset(0)
    assert cache.seq_lens().tolist() == [0, 2, 4]
    k2 = rand((1, 1, HKV, D), seed=9)
    cache.append(0, k2, k2, seq_ids=[1])
    got, _, lens = cache.get(0, [1])
    np.testing.assert_array_equal(to_numpy(got)[0, 2], k2[0, 0])
    np.testing.assert_array_equal(to_numpy(got)[0, :2], k[1, :2])
    assert cache.bytes_used() == (0 + 3 + 4 + 0 + 2 + 4) * 2 * HKV * D * 4


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_dropped_cache_gives_its_blocks_back_once_no_view_is_alive(dtype):
    """A cache dropped without free() (a generate() call's) returns its blocks to the
    pool -- but not while a view of them lives, so their bytes are not handed out
    again under it -- and a freed cache is not freed twice."""
    import gc

    cache, pool = make("cpu", dtype)
    held = pool.stats()["allocated"]
    assert held >= L * 2 * B * S * HKV * D * (1 if dtype == "int8" else 4)
    keys = cache._alive()  # the block's own view (slices of it hold no lease: block.py)
    keys[...] = 7
    kv_size = cache._block.size
    assert kv_size == held if dtype == "fp32" else kv_size < held
    del cache
    gc.collect()
    assert pool.stats()["allocated"] == kv_size       # the view keeps its block (only)
    other = pool.alloc(held // 2)
    lo, hi = keys.data_ptr(), keys.data_ptr() + keys.numel() * keys.element_size()
    start = other.raw().data_ptr()
    assert start >= hi or start + other.nbytes <= lo   # not under the live view
    assert int(keys.min()) == 7 and int(keys.max()) == 7
    other.free()
    del keys
    gc.collect()
    s = pool.stats()
    assert s["allocated"] == 0 and s["num_blocks"] == 0
    freed, pool2 = make("cpu", dtype)
    freed.free()
    del freed
    gc.collect()
    assert pool2.stats()["free_count"] == pool2.stats()["alloc_count"]


def test_a_dropped_cache_of_a_private_pool_releases_its_arena():
    import gc

    cache = KVCache(L, B, S, HKV, D, dtype="fp32", device="numpy")
    pool = cache.pool
    assert getattr(pool, "private", False) and pool.stats()["reserved"] > 0
    del cache
    gc.collect()
    s = pool.stats()
    assert s["allocated"] == 0 and s["reserved"] == 0 and s["release_count"] == 1


def test_free_when_unviewed_refuses_what_is_not_a_block():
    from atbcore.memory.block import free_when_unviewed

    with pytest.raises(ParamsError, match="free_when_unviewed.*block"):
        free_when_unviewed(object())
    pool = MemoryPool(MemoryPoolConfig(max_size=1 << 20))
    b = pool.alloc(256)
    with pytest.raises(ParamsError, match="free_when_unviewed.*then"):
        free_when_unviewed(b, then=3)
    assert not b.freed and pool.stats()["num_blocks"] == 1   # nothing touched
    free_when_unviewed(b)
    assert b.freed
