"""Torch kernels of the paged KV cache ops.

ReshapeAndCache is one indexed write per cache, in place. PagedAttention gathers
the blocks of each sequence into a contiguous key/value run and reuses the
FlashAttention core (SDPA); decode batches (one query per sequence) are gathered
together, padded to the longest context, and run as one SDPA call.
"""

from __future__ import annotations

import torch

from .attention import sdpa_attention
from . import kernel

__all__ = ["reshape_and_cache", "paged_attention"]


@kernel("ReshapeAndCache", impl="torch indexed write into the block caches (in place)",
        launches=8)
def reshape_and_cache(p, ins):
    kc, vc = ins["key_cache"], ins["value_cache"]
    slots = ins["slot_mapping"].long()
    keep = slots >= 0  # slot -1 marks padding tokens that are not stored
    s = slots[keep]
    blk, off = s // kc.shape[1], s % kc.shape[1]
    kc[blk, off] = ins["key"][keep]
    vc[blk, off] = ins["value"][keep]
    return [kc, vc]  # the caller's caches themselves, so the write is visible to them


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Blocks of ``table`` ([..., nblk]) as one run: [..., nblk * block_size, Hkv, D]."""
    g = cache[table.long()]  # [..., nblk, BS, Hkv, D]
    return g.flatten(-4, -3)


@kernel("PagedAttention", impl="block gather + torch scaled_dot_product_attention "
        "(fp32 compute)", launches=18)
def paged_attention(p, ins):
    q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
    bt, ctx, qsl = ins["block_tables"], ins["context_lens"], ins.get("q_seq_lens")
    t, h, d = q.shape
    nb, bs = kc.shape[0], kc.shape[1]
    scale = p.scale if p.scale is not None else d ** -0.5
    lens = ctx.long()
    qlens = None if qsl is None else [int(x) for x in qsl.tolist()]
    if qlens is None or all(n == 1 for n in qlens):
        # decode: one padded gather for the batch; keys past each context are masked.
        nblk = -(-int(lens.max()) // bs)
        table = bt[:, :nblk].long().clamp(0, nb - 1)  # entries past a context may be padding
        k = _gather(kc, table).transpose(1, 2).float()  # [B, Hkv, nblk*BS, D]
        v = _gather(vc, table).transpose(1, 2).float()
        q4 = q.reshape(t, 1, h, d).transpose(1, 2).float()  # [B, H, 1, D]
        o = sdpa_attention(q4, k, v, scale=scale, causal=p.causal, window=p.window,
                           kv_lens=lens)
        return [o.transpose(1, 2).reshape(t, h, d).to(q.dtype)]
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    start = 0
    for b, (n, ql) in enumerate(zip(lens.tolist(), qlens)):
        table = bt[b, :-(-n // bs)]
        k = _gather(kc, table)[:n].transpose(0, 1)[None].float()  # [1, Hkv, n, D]
        v = _gather(vc, table)[:n].transpose(0, 1)[None].float()
        qb = q[start:start + ql].transpose(0, 1)[None].float()  # [1, H, ql, D]
        o = sdpa_attention(qb, k, v, scale=scale, causal=p.causal, window=p.window)
        out[start:start + ql] = o[0].transpose(0, 1).to(q.dtype)
        start += ql
    return [out]
