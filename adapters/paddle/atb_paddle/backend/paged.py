"""Paddle kernels of the paged KV cache ops.

ReshapeAndCache writes key/value rows into the caller's block caches in place
(``paddle.index_put_`` on a flat ``[blocks * block_size, Hkv * D]`` view of each
cache; unlike ``scatter_``, it has CPU kernels for fp16/bf16/int8 in Paddle 3.3); the
outputs are the caches themselves.
PagedAttention gathers each batch's blocks into one run and reuses the
FlashAttention kernel's chunked fp32 core (:func:`.attention.attention_bnsd`).
"""

from __future__ import annotations

import paddle

from . import kernel
from .attention import attention_bnsd
from .common import f32, take, to_dtype

__all__: list[str] = []

def _write(cache, rows, slots) -> None:
    """cache.view([N, -1])[slots] = rows.view([T, -1]), in place."""
    flat = cache.view([cache.shape[0] * cache.shape[1], -1])     # shares the cache's memory
    paddle.index_put_(flat, (slots,), rows.reshape([rows.shape[0], -1]))


@kernel("ReshapeAndCache", impl="paddle.index_put_ into the block caches (in place)", launches=2)
def reshape_and_cache(p, ins):
    kc, vc = ins["key_cache"], ins["value_cache"]
    slots = ins["slot_mapping"].astype("int64")
    keep = slots >= 0                        # slot -1 marks padding tokens that are not stored
    if bool(keep.all()):
        k, v, s = ins["key"], ins["value"], slots
    else:
        idx = paddle.nonzero(keep).reshape([-1])
        k, v, s = take(ins["key"], idx, 0), take(ins["value"], idx, 0), take(slots, idx, 0)
    if s.shape[0]:
        _write(kc, k, s)
        _write(vc, v, s)
    return [kc, vc]                          # the caller's caches, so the write is visible


def _gather(cache, table):
    """Blocks of ``table`` ([B, nblk]) as one run per batch: [B, nblk * BS, Hkv, D]."""
    g = take(cache, table, 0)                                    # [B, nblk, BS, Hkv, D]
    return g.reshape([g.shape[0], -1, *cache.shape[2:]])


@kernel("PagedAttention", impl="block gather + paddle chunked attention (fp32 compute)")
def paged_attention(p, ins):
    q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
    bt, ctx, qsl = ins["block_tables"], ins["context_lens"], ins.get("q_seq_lens")
    t, h, d = q.shape
    nb, bs = kc.shape[0], kc.shape[1]
    scale = p.scale if p.scale is not None else d ** -0.5
    lens = ctx.astype("int64")
    qlens = None if qsl is None else [int(x) for x in qsl.numpy().tolist()]
    if qlens is None or all(n == 1 for n in qlens):
        # decode: one padded gather for the batch; keys past each context are masked
        nblk = -(-int(lens.max()) // bs)
        table = paddle.clip(bt[:, :nblk].astype("int64"), 0, nb - 1)   # padding entries
        k = f32(_gather(kc, table)).transpose([0, 2, 1, 3])           # [B, Hkv, L, D]
        v = f32(_gather(vc, table)).transpose([0, 2, 1, 3])
        q4 = f32(q).reshape([t, 1, h, d]).transpose([0, 2, 1, 3])    # [B, H, 1, D]
        o = attention_bnsd(q4, k, v, scale=scale, causal=p.causal, window=p.window,
                           kv_lens=lens)
        return [to_dtype(o.transpose([0, 2, 1, 3]).reshape([t, h, d]), q.dtype)]
    outs = []
    start = 0
    for b, (n, ql) in enumerate(zip(lens.numpy().tolist(), qlens)):
        table = bt[b:b + 1, :-(-n // bs)].astype("int64")
        k = f32(_gather(kc, table)[:, :n]).transpose([0, 2, 1, 3])   # [1, Hkv, n, D]
        v = f32(_gather(vc, table)[:, :n]).transpose([0, 2, 1, 3])
        qb = f32(q[start:start + ql]).transpose([1, 0, 2]).unsqueeze(0)   # [1, H, ql, D]
        o = attention_bnsd(qb, k, v, scale=scale, causal=p.causal, window=p.window)
        outs.append(o[0].transpose([1, 0, 2]))                       # [ql, H, D]
        start += ql
    return [to_dtype(paddle.concat(outs, axis=0), q.dtype)]
