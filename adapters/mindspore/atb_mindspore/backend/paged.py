"""MindSpore kernels of the paged KV cache ops.

ReshapeAndCache is one indexed write per cache, in place (``cache[block, offset] =
values``; MindSpore 2.10 has no CPU kernel for that with bf16 or int8 caches, which
fall back to the next backend). PagedAttention gathers each sequence's blocks into
one contiguous run and reuses the FlashAttention core; decode batches (one query
per sequence) are gathered together, padded to the longest context, and masked by
their context lengths.
"""

from __future__ import annotations

from typing import Any

from atbcore.dtypes import Dtype

from . import kernel
from .attention import attention_bnsd
from .common import cast, f32, host_ints, mint, ms, ops

__all__: list[str] = []


def _cache_check(p: Any, ins: Any) -> list[str]:
    kc = ins["key_cache"]
    if kc.dtype not in (Dtype.FP32, Dtype.FP16) and kc.device == "cpu":
        return [f"mindspore has no {kc.dtype.name} index-put CPU kernel for cache writes"]
    return []


@kernel("ReshapeAndCache", check=_cache_check,
        impl="mindspore indexed write into the block caches (in place)", launches=2)
def reshape_and_cache(p, ins):
    m = ms()
    kc, vc = ins["key_cache"], ins["value_cache"]
    slots = host_ints(ins["slot_mapping"])
    keep = [i for i, s in enumerate(slots) if s >= 0]   # slot -1: padding, not stored
    if keep:
        bs = kc.shape[1]
        blk = m.Tensor([slots[i] // bs for i in keep], m.int64)
        off = m.Tensor([slots[i] % bs for i in keep], m.int64)
        rows = m.Tensor(keep, m.int64)
        kc[blk, off] = ops().gather(ins["key"], rows, 0)
        vc[blk, off] = ops().gather(ins["value"], rows, 0)
    return [kc, vc]  # the caller's caches themselves, so the write is visible to them


def _gather(cache: Any, table: Any) -> Any:
    """fp32 blocks of ``table`` ([..., nblk]) as one run: [..., nblk * BS, Hkv, D]."""
    m = ms()
    if cache.dtype == m.bfloat16:  # no bf16 gather on the CPU: move the bits as int16
        g = ops().gather(cache.view(m.int16), table, 0).view(m.bfloat16)
    else:
        g = ops().gather(cache, table, 0)                   # [..., nblk, BS, Hkv, D]
    g = f32(g)
    return g.reshape((*g.shape[:-4], g.shape[-4] * g.shape[-3], *g.shape[-2:]))


@kernel("PagedAttention", impl="block gather + mindspore chunked attention (fp32 compute)")
def paged_attention(p, ins):
    m, mt = ms(), mint()
    q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
    t, h, d = q.shape
    bs = kc.shape[1]
    scale = p.scale if p.scale is not None else d ** -0.5
    ctx = host_ints(ins["context_lens"])
    bt = ins["block_tables"].astype(m.int64)
    qsl = ins.get("q_seq_lens")
    qlens = None if qsl is None else host_ints(qsl)
    if qlens is None or all(n == 1 for n in qlens):
        # decode: one padded gather for the batch; keys past each context are masked.
        nblk = -(-max(ctx) // bs)
        table = mt.clamp(bt[:, :nblk], 0, kc.shape[0] - 1)  # entries past a context may be padding
        k = mt.transpose(_gather(kc, table), 1, 2)           # [B, Hkv, nblk*BS, D]
        v = mt.transpose(_gather(vc, table), 1, 2)
        q4 = mt.transpose(f32(q).reshape((t, 1, h, d)), 1, 2)  # [B, H, 1, D]
        o = attention_bnsd(q4, k, v, scale=scale, causal=p.causal, window=p.window, kv_lens=ctx)
        return [cast(mt.transpose(o, 1, 2).reshape((t, h, d)), q.dtype)]
    outs, start = [], 0
    for b, (n, ql) in enumerate(zip(ctx, qlens)):
        table = bt[b, :-(-n // bs)]
        k = mt.transpose(_gather(kc, table)[:n], 0, 1).reshape((1, kc.shape[2], n, d))
        v = mt.transpose(_gather(vc, table)[:n], 0, 1).reshape((1, kc.shape[2], n, d))
        qb = mt.transpose(f32(q[start:start + ql]), 0, 1).reshape((1, h, ql, d))
        o = attention_bnsd(qb, k, v, scale=scale, causal=p.causal, window=p.window)
        outs.append(mt.transpose(o[0], 0, 1))                 # [ql, H, D]
        start += ql
    return [cast(mt.cat(outs, 0) if len(outs) > 1 else outs[0], q.dtype)]
