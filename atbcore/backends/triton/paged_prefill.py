"""Triton attention of several new tokens per sequence over a paged KV cache (a
prefill, or a chunk of one, after the tokens' keys were written to the cache).

Queries come packed ``[T, H, D]``: sequence ``b`` owns rows ``cu[b] .. cu[b] +
q_lens[b]``, its new tokens, the last ``q_lens[b]`` of its ``context_lens[b]`` keys
(PagedAttention's alignment: token ``i`` sits at position ``ctx - q_len + i``).
Grid ``(ceil(T / BLOCK_M), B * H)``: each program holds ``BLOCK_M`` query rows of one
sequence and head (programs past a sequence's rows do nothing, so the grid needs no
host read of the lengths and the call can be captured) and walks its kv head's keys
``BLOCK_N`` at a time, each key's address found through the block table; online
softmax in fp32 (exp2, scale folded in), causal rows stop at their position, a
window starts at ``pos - window + 1``. Rows that see no key are zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .online_softmax import online_softmax_chunk
from .rounding import round_to

__all__ = ["paged_prefill_attention", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tab_ptr, ctx_ptr, qlen_ptr, cu_ptr,
                          sq_t, sq_h, sk_blk, sk_row, sk_h, sv_blk, sv_row, sv_h, so_t, so_h,
                          st_b, block_size, n_heads, group, head_dim, scale_log2, window,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
    mb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    kvh = h // group
    kv_len = tl.load(ctx_ptr + b).to(tl.int32)
    q_len = tl.load(qlen_ptr + b).to(tl.int32)
    q0 = tl.load(cu_ptr + b).to(tl.int64)
    shift = kv_len - q_len
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = shift + rows                                                   # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    rmask = rows < q_len
    dmask = d < head_dim
    tok = q0 + rows.to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * sq_t + h * sq_h + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)         # [BLOCK_M, BLOCK_D]
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(hi, shift + tl.minimum(mb * BLOCK_M + BLOCK_M, q_len))
    hi = tl.where(mb * BLOCK_M < q_len, hi, 0)                          # no rows: no keys
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(shift + mb * BLOCK_M - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        blk = tl.load(tab_ptr + b * st_b + n // block_size, mask=nmask, other=0).to(tl.int64)
        row = (n % block_size).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + blk[:, None] * sk_blk + row[:, None] * sk_row + kvh * sk_h
                    + d[None, :], mask=kv_mask, other=0.0)               # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + blk[:, None] * sv_blk + row[:, None] * sv_row + kvh * sv_h
                    + d[None, :], mask=kv_mask, other=0.0)
        allow = nmask[None, :] & rmask[:, None]
        if CAUSAL:
            allow = allow & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allow = allow & (n[None, :] > pos[:, None] - window)
        m, l_sum, acc = online_softmax_chunk(q, k, v, allow, scale_log2, m, l_sum, acc, IEEE)
    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]                 # unseen rows: 0
    tl.store(o_ptr + tok[:, None] * so_t + h * so_h + d[None, :], round_to(o, o_ptr),
             mask=rmask[:, None] & dmask[None, :])


def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            q_seq_lens: torch.Tensor, scale: float, causal: bool = True,
                            window: int | None = None, out: torch.Tensor | None = None,
                            block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """``q`` [T, H, D] (packed, ``q_seq_lens`` [B] tokens per sequence) over caches
    [NB, BS, Hkv, D] (unit stride on D) through ``block_tables`` [B, MB]; returns
    [T, H, D] in q's dtype (see the module docstring)."""
    t, heads, d = q.shape
    kvh, bs = key_cache.shape[2], key_cache.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    o = out if (out is not None and out.shape == q.shape and out.dtype == q.dtype
                and out.stride(-1) == 1) else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    b = block_tables.shape[0]
    if t == 0 or b == 0:
        return o
    tables = block_tables.to(torch.int32).contiguous()
    ctx = context_lens.to(device=q.device, dtype=torch.int32).contiguous()
    qlens = q_seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    cu = (torch.cumsum(qlens, 0, dtype=torch.int32) - qlens).contiguous()   # first row of each
    if interpreting():  # the interpreter runs programs one by one: fewer, larger ones
        block_m = max(block_m, triton.next_power_of_2(t))
    elif t <= 16:
        block_m = 16
    _paged_prefill_kernel[(triton.cdiv(t, block_m), b * heads)](
        q, key_cache, value_cache, o, tables, ctx, qlens, cu, q.stride(0), q.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3], o.stride(0), o.stride(1),
        tables.stride(0), bs, heads, heads // kvh, d, float(scale) * _LOG2E, int(window or 0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        CAUSAL=bool(causal or window is not None), HAS_WINDOW=window is not None,
        # fp32 dots: fp32 inputs (no TF32), and the interpreter (its bf16 dot is wrong)
        IEEE=q.dtype == torch.float32 or interpreting())
    return o
