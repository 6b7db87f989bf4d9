"""Torch kernels of the paged KV cache ops.

ReshapeAndCache is one indexed write per cache, in place. PagedAttention has two
paths:

* decode (one query per sequence, the continuous-batching hot loop): on the CPU
  one C kernel reads each sequence's blocks in place through its block table
  (fp32 scores and softmax, the query heads of a kv head sharing each key read);
  elsewhere one block gather per cache for the whole batch, padded to the longest
  context, then one SDPA call in which the ``H / Hkv`` query heads sharing a kv
  head are folded into query rows (``[B, Hkv, G, D]`` against ``[B, Hkv, N, D]``),
  so K/V are never expanded for GQA; a ``[B, 1, 1, N]`` mask hides keys past each
  context (and outside a sliding window);
* several queries per sequence (``q_seq_lens``): where every context is one block
  and the blocks are consecutive (the in-place cache form of a GraphOp), one C
  flash call reads the cache rows in place; else each sequence's blocks are
  gathered and attended on their own through the FlashAttention core.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ...runtime.binding import Slot, getter, resolve, same_objects
from ...runtime.native_run import native_call, not_native
from ...tensor import copy_into
from ..cpu_kernels import torch_ops as ck
from ..cpu_kernels.torch_decode import paged_decode_attention as c_paged_decode_attention
from ..cpu_kernels.torch_decode import paged_decode_attention_bound as \
    c_paged_decode_attention_bound
from ..cpu_kernels.torch_decode import reshape_and_cache as c_reshape_and_cache
from ..cpu_kernels.torch_decode import reshape_and_cache_bound as c_reshape_and_cache_bound
from ..cpu_kernels.torch_prefill import MAX_HEAD_DIM, prefill_attention
from ...ops.attention import effective_window
from .attention import sdpa_attention
from . import kernel

__all__ = ["reshape_and_cache", "paged_attention", "paged_decode_attention", "decode_mask"]


def _bind_reshape_and_cache(p: Any, ins: Mapping[str, Any], outs: list, ctx: Any) -> Any:
    """The C copy with its arguments packed once per set of tensors (a program fed
    the same cache and index tensors each step packs once); the outputs are the
    caches themselves."""
    if any(type(o) is not Slot for o in outs):
        return None
    gets = [getter(ins[n]) for n in ("key", "value", "key_cache", "value_cache",
                                      "slot_mapping")]
    ok, ov = outs[0].index, outs[1].index
    state: list[Any] = [None, None]  # the tensors bound, their packed call

    def call(env: list) -> None:
        cur = tuple(g(env) for g in gets)
        if not same_objects(cur, state[0]):
            bound = None if ck.why_not(*cur[:4]) else c_reshape_and_cache_bound(*cur)
            state[:] = [cur, bound]
        if state[1] is not None:
            state[1]()
        else:
            reshape_and_cache(p, dict(zip(("key", "value", "key_cache", "value_cache",
                                           "slot_mapping"), cur)))
        env[ok], env[ov] = cur[2], cur[3]
    return call


_bind_reshape_and_cache.fills_slots = True  # type: ignore[attr-defined]


@kernel("ReshapeAndCache", impl="C row copy into the block caches (CPU), else torch "
        "indexed write (in place)", launches=ck.c_launches(8), bind=_bind_reshape_and_cache)
def reshape_and_cache(p, ins):
    kc, vc = ins["key_cache"], ins["value_cache"]
    k, v, sm = ins["key"], ins["value"], ins["slot_mapping"]
    why = ck.why_not(k, v, kc, vc)
    if why is None and c_reshape_and_cache(k, v, kc, vc, sm):
        return [kc, vc]
    ck.log_fallback("ReshapeAndCache", why or "a layout the C copy does not take")
    slots = sm.long()
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


def decode_mask(lens: torch.Tensor, n: int, window: int | None = None) -> torch.Tensor:
    """bool [B, n]: key ``j`` is visible to sequence ``b``'s query (at position
    ``lens[b] - 1``) when ``j < lens[b]`` and, with a sliding window, within it."""
    keys = torch.arange(n, device=lens.device)
    allow = keys[None] < lens[:, None]
    if window is not None:
        allow = allow & (keys[None] >= lens[:, None] - window)
    return allow


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           allow: torch.Tensor) -> torch.Tensor:
    """One query per sequence over padded keys/values: ``q`` [B, H, D], ``k``/``v``
    [B, N, Hkv, D] (any strides), ``allow`` bool [B, N] (:func:`decode_mask`; every
    row must allow some key) or an additive fp32 mask. Returns [B, H, D] in q's
    dtype, computed in fp32."""
    b, h, d = q.shape
    hkv = k.shape[2]
    # the G = H / Hkv query heads sharing a kv head become G query rows: no K/V expansion
    qf = q.reshape(b, hkv, h // hkv, d).float()                      # [B, Hkv, G, D]
    o = F.scaled_dot_product_attention(qf, k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                       attn_mask=allow[:, None, None, :], scale=scale)
    return o.reshape(b, h, d).to(q.dtype)                            # [B, Hkv, G, D] -> [B, H, D]


def _bind_paged_attention(p: Any, ins: Mapping[str, Any], outs: list, ctx: Any) -> Any:
    """Decode (one query per sequence) into a planned buffer: the C kernel packed once
    per set of cache/table tensors (tables checked per call unless the node's inputs
    are trusted); None (the generic call) otherwise."""
    q, o, bt = ins["query"], outs[0], ins["block_tables"]
    qshape = q.desc.shape if type(q) is Slot else tuple(q.shape)
    rows = bt.desc.shape[0] if type(bt) is Slot else bt.shape[0]
    if type(o) is Slot or qshape[0] != rows or qshape[2] > 512:
        return None
    names = ("query", "key_cache", "value_cache", "block_tables", "context_lens")
    gets = [getter(ins[n]) for n in names]
    qsl = ins.get("q_seq_lens")
    scale = p.scale if p.scale is not None else qshape[2] ** -0.5
    state: list[Any] = [None, None]

    def call(env: list) -> None:
        cur = tuple(g(env) for g in gets)
        if not same_objects(cur, state[0]):
            q, kc, vc, tables, lens = cur
            bound = None
            if (ck.why_not(q, kc, vc) is None and kc.dtype == vc.dtype
                    and tables.is_contiguous() and lens.is_contiguous()):
                window = effective_window(p.window, 1, kc.shape[0] * kc.shape[1])
                bound = c_paged_decode_attention_bound(
                    q, kc, vc, tables, lens, scale=scale, window=window, out=o,
                    check_tables=not ctx.trusted)
            state[:] = [cur, bound]
        if state[1] is not None:
            if not ctx.trusted:  # the tables' values checked per call: not recorded
                not_native()
            state[1]()
            return
        not_native()
        got = dict(zip(names, cur), q_seq_lens=resolve(qsl, env))
        copy_into(o, paged_attention(p, got)[0])
    return native_call(call)


def _contiguous_prefill(p: Any, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                        bt: torch.Tensor, lens: list[int], qlens: list[int],
                        scale: float) -> torch.Tensor | None:
    """Several queries per sequence when each sequence's context is one block and the
    sequences' blocks are consecutive (the in-place cache form: row ``b`` is block
    ``b``): C flash calls over the cache rows in place, bottom-right aligned (one for
    the batch when every row has as many queries, else one per row). None when the
    call does not fit that (the gathering path runs)."""
    b, (t, h, d), bs = bt.shape[0], q.shape, kc.shape[1]
    if (q.device.type != "cpu" or sum(qlens) != t or d > MAX_HEAD_DIM
            or any(n > bs or m > n for n, m in zip(lens, qlens)) or kc.dtype != vc.dtype
            or ck.why_not(q, kc, vc) is not None):
        return None
    first = bt[:, 0].tolist()
    if first != list(range(first[0], first[0] + b)) or first[0] + b > kc.shape[0]:
        return None
    out = torch.empty(t, h, d, dtype=q.dtype)
    kw = dict(scale=scale, causal=p.causal, window=p.window)
    if len(set(qlens)) == 1:
        s, rows = qlens[0], slice(first[0], first[0] + b)
        prefill_attention(q.view(b, s, h, d), kc[rows], vc[rows], kv_lens=lens,
                          out=out.view(b, s, h, d), **kw)
        return out
    start = 0
    for r, (n, m) in enumerate(zip(lens, qlens)):
        row = slice(first[0] + r, first[0] + r + 1)
        prefill_attention(q[start:start + m][None], kc[row], vc[row], kv_lens=[n],
                          out=out[start:start + m][None], **kw)
        start += m
    return out


def _gathered_prefill(p: Any, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      bt: torch.Tensor, lens: list[int], qlens: list[int],
                      scale: float) -> torch.Tensor | None:
    """Several queries per sequence over blocks anywhere in the cache (a paged cache's
    prefill chunks and drafts): every sequence's keys/values gathered packed (one
    index_select each), then one packed C flash call. None when the C kernel cannot
    take it (the per-sequence path runs)."""
    t, h, d = q.shape
    bs = kc.shape[1]
    if (q.device.type != "cpu" or sum(qlens) != t or d > MAX_HEAD_DIM or kc.dtype != vc.dtype
            or any(m > n for n, m in zip(lens, qlens)) or ck.why_not(q, kc, vc) is not None):
        return None
    n_all = np.asarray(lens, dtype=np.int64)
    seq = np.repeat(np.arange(len(lens)), n_all)                               # [Tk]
    pos = np.arange(int(n_all.sum())) - np.repeat(np.cumsum(n_all) - n_all, n_all)
    table = bt.cpu().numpy().astype(np.int64, copy=False)
    slots = torch.from_numpy(table[seq, pos // bs] * bs + pos % bs)             # [Tk]
    k = kc.reshape(-1, *kc.shape[2:]).index_select(0, slots)                   # [Tk, Hkv, D]
    v = vc.reshape(-1, *vc.shape[2:]).index_select(0, slots)
    return prefill_attention(q, k, v, scale=scale, q_lens=qlens, kv_lens=lens, causal=p.causal,
                             window=p.window)


@kernel("PagedAttention", impl="decode: C kernel reading the blocks in place (CPU), else "
        "batched block gather + torch scaled_dot_product_attention (GQA folded into query "
        "rows); multi-token queries: C flash over contiguous cache rows in place, else over "
        "the sequences' blocks gathered packed, else per sequence; fp32 compute", launches=ck.c_launches(8),
        bind=_bind_paged_attention)
def paged_attention(p, ins):
    q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
    bt, ctx, qsl = ins["block_tables"], ins["context_lens"], ins.get("q_seq_lens")
    t, h, d = q.shape
    nb, bs = kc.shape[0], kc.shape[1]
    scale = p.scale if p.scale is not None else d ** -0.5
    lens = ctx.long()
    if qsl is None or t == bt.shape[0]:  # one query per sequence (sum(q_seq_lens) == B)
        why = ck.why_not(q, kc, vc)
        # one query per sequence sits at its last position: a window past the whole
        # cache is no window (and never wraps in the kernel's int32 positions)
        window = effective_window(p.window, 1, nb * bs)
        if why is None and kc.dtype == vc.dtype and d <= 512:
            return [c_paged_decode_attention(q, kc, vc, bt, ctx, scale=scale, window=window)]
        ck.log_fallback("PagedAttention", why or "head_dim > 512 or mixed cache dtypes")
        nblk = -(-int(lens.max()) // bs)
        table = bt[:, :nblk].long().clamp(0, nb - 1)  # entries past a context may be padding
        # [B, nblk*BS, Hkv, D] gathered copies
        n = table.shape[1] * bs
        return [paged_decode_attention(q, _gather(kc, table), _gather(vc, table), scale,
                                       decode_mask(lens, n, window))]
    qlens = [int(x) for x in qsl.tolist()]
    fast = _contiguous_prefill(p, q, kc, vc, bt, lens.tolist(), qlens, scale)
    if fast is None:
        fast = _gathered_prefill(p, q, kc, vc, bt, lens.tolist(), qlens, scale)
    if fast is not None:
        return [fast]
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
