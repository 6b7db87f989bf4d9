"""Triton decode attention over a paged KV cache (one query token per sequence).

Grid ``(B, Hkv, splits)``: each program takes the ``G = H / Hkv`` query heads that
share a kv head (padded to 16 rows for the tensor-core dot), so every key and value
row is read once for the whole group (GQA without expanding K/V). Keys are walked in
chunks of ``BLOCK_N`` tokens, each token's address found through the block table
(any block size); an online softmax in fp32 (exp2, scale folded in) accumulates
``P @ V``. Long contexts are split over ``splits`` programs per (sequence, kv head)
(split-K, "flash decoding"); a second kernel merges the partial results by their
log-sum-exp. A sliding window starts each sequence's keys at ``len - window``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import interpreting
from .online_softmax import online_softmax_chunk
from .rounding import round_to

__all__ = ["paged_decode_attention", "choose_splits", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_BLOCK_N = 32
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, o_ptr, po_ptr, lse_ptr,
                   sq_t, sq_h, sk_blk, sk_tok, sk_h, sv_blk, sv_tok, sv_h, s_bt, so_t, so_h,
                   scale_log2, window, block_size, group, head_dim, per_split, n_heads,
                   G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    n_ctx = tl.load(lens_ptr + b).to(tl.int32)
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, n_ctx)
    if HAS_WINDOW:
        lo = tl.maximum(lo, n_ctx - window)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    gmask = g < group
    dmask = d < head_dim
    heads = kvh * group + g
    q = tl.load(q_ptr + b * sq_t + heads[:, None] * sq_h + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)           # [G_PAD, BLOCK_D]
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        blk = tl.load(bt_ptr + b * s_bt + n // block_size, mask=nmask, other=0).to(tl.int64)
        off = (n % block_size).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + (blk * sk_blk + off * sk_tok + kvh * sk_h)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)                               # [BLOCK_N, BLOCK_D]
        v = tl.load(vc_ptr + (blk * sv_blk + off * sv_tok + kvh * sv_h)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        m, l_sum, acc = online_softmax_chunk(q, k, v, nmask[None, :], scale_log2, m, l_sum,
                                             acc, IEEE)
    safe = tl.where(l_sum > 0, l_sum, 1.0)
    o = acc / safe[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        n_split = tl.num_programs(2)
        row = (b * n_heads + heads) * n_split + sp                          # [G_PAD]
        tl.store(po_ptr + row[:, None] * BLOCK_D + d[None, :], o, mask=omask)
        lse = tl.where(l_sum > 0, m + tl.log2(safe), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=gmask)
    else:
        tl.store(o_ptr + b * so_t + heads[:, None] * so_h + d[None, :],
                 round_to(o, o_ptr), mask=omask)


@triton.jit
def _merge_kernel(po_ptr, lse_ptr, o_ptr, so_t, so_h, n_heads, n_split, head_dim,
                  S_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    sp = tl.arange(0, S_PAD)
    d = tl.arange(0, BLOCK_D)
    row = (b * n_heads + h) * n_split + sp
    lse = tl.load(lse_ptr + row, mask=sp < n_split, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - top)
    part = tl.load(po_ptr + row[:, None] * BLOCK_D + d[None, :],
                   mask=(sp < n_split)[:, None] & (d < head_dim)[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + b * so_t + h * so_h + d, round_to(o, o_ptr), mask=d < head_dim)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(batch: int, kv_heads: int, capacity: int, device: torch.device) -> int:
    """Programs per (sequence, kv head): enough to fill the GPU twice over when
    ``batch * kv_heads`` alone cannot, at least 256 keys each, at most 32. Chosen from
    the block table's capacity, not the context lengths, so no host sync is needed."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = max(1, (2 * sms) // max(1, batch * kv_heads))
    return max(1, min(want, 32, capacity // 256))


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, splits: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention: ``q`` [B, H, D] over caches [NB, BS, Hkv, D] (unit stride on D)
    through ``block_tables`` [B, MB]; returns [B, H, D] in q's dtype."""
    bsz, heads, d = q.shape
    kvh, bs = key_cache.shape[2], key_cache.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    o = out if (out is not None and out.shape == q.shape and out.dtype == q.dtype
                and out.stride(-1) == 1) else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return o
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    cap = tables.shape[1] * bs
    n_split = splits or choose_splits(bsz, kvh, cap, q.device)
    per_split = -(-cap // n_split)
    per_split = -(-per_split // _BLOCK_N) * _BLOCK_N
    n_split = -(-cap // per_split)
    group = heads // kvh
    block_d = max(16, triton.next_power_of_2(d))
    if n_split > 1:
        part = torch.empty(bsz * heads * n_split, block_d, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz * heads * n_split, dtype=torch.float32, device=q.device)
    else:
        part = lse = o
    _decode_kernel[(bsz, kvh, n_split)](
        q, key_cache, value_cache, tables, lens, o, part, lse, q.stride(0), q.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3], tables.stride(0), o.stride(0),
        o.stride(1), float(scale) * _LOG2E, int(window or 0), bs, group, d, per_split, heads,
        G_PAD=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=_BLOCK_N,
        SPLIT=n_split > 1, HAS_WINDOW=window is not None,
        # fp32 dots: fp32 inputs (no TF32), and the interpreter (its bf16 dot is wrong)
        IEEE=q.dtype == torch.float32 or interpreting())
    if n_split > 1:
        _merge_kernel[(bsz, heads)](part, lse, o, o.stride(0), o.stride(1), heads, n_split, d,
                                    S_PAD=max(2, triton.next_power_of_2(n_split)),
                                    BLOCK_D=block_d)
    return o

