"""Triton prefill attention (flash attention forward) with atb's FlashAttention rules.

Grid ``(ceil(Sq / BLOCK_M), B * H)``: each program holds ``BLOCK_M`` query rows of one
head in registers and walks that head's kv head (``h // (H / Hkv)``: GQA without
expanding K/V) in ``BLOCK_N`` key chunks with an online softmax (fp32, exp2, scale
folded in). Positions are bottom-right aligned per sequence: row i of a sequence with
kv length L (``seq_lens[b]``, else Skv) sits at ``max(L - Sq, 0) + i``; causal rows
stop at their position, a sliding window starts at ``pos - window + 1``, so a program
visits only the key chunks some of its rows can see. Rows that see no key are zero.

Any layout comes in through strides (q/k/v/out viewed ``[B, N, S, D]``), so BSH,
BSND and BNSD inputs are read in place and the output is written in q's layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .online_softmax import online_softmax_chunk
from .rounding import round_to

__all__ = ["prefill_attention", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lens_ptr,
                    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
                    q_len, kv_cap, n_heads, group, head_dim, scale_log2, window,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_LENS: tl.constexpr,
                    IEEE: tl.constexpr):
    mb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    kvh = h // group
    if HAS_LENS:
        kv_len = tl.load(lens_ptr + b).to(tl.int32)
    else:
        kv_len = kv_cap
    shift = tl.maximum(kv_len - q_len, 0)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = shift + rows                                                   # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    rmask = rows < q_len
    dmask = d < head_dim
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_s + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)         # [BLOCK_M, BLOCK_D]
    hi = kv_len
    if CAUSAL:
        last = shift + tl.minimum(mb * BLOCK_M + BLOCK_M, q_len) - 1
        hi = tl.minimum(hi, last + 1)
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
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + b * sk_b + kvh * sk_h + n[:, None].to(tl.int64) * sk_s + d[None, :],
                    mask=kv_mask, other=0.0)                             # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + b * sv_b + kvh * sv_h + n[:, None].to(tl.int64) * sv_s + d[None, :],
                    mask=kv_mask, other=0.0)
        allow = nmask[None, :] & rmask[:, None]
        if CAUSAL:
            allow = allow & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allow = allow & (n[None, :] > pos[:, None] - window)
        m, l_sum, acc = online_softmax_chunk(q, k, v, allow, scale_log2, m, l_sum, acc, IEEE)
    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]                 # unseen rows: 0
    tl.store(o_ptr + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_s + d[None, :],
             round_to(o, o_ptr), mask=rmask[:, None] & dmask[None, :])


def _bnsd(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """A ``[B, N, S, D]`` view of ``x`` in ``layout`` (no copy)."""
    if layout == "BNSD":
        return x
    if layout == "BSH":
        x = x.unflatten(-1, (heads, -1))
    return x.transpose(1, 2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str,
                      heads: int, kv_heads: int, scale: float, causal: bool,
                      window: int | None = None, seq_lens: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, block_m: int = 64,
                      block_n: int = 64) -> torch.Tensor:
    """Attention of q over k/v in ``layout`` (BSH / BSND / BNSD; head_dim unit-stride),
    GQA, bottom-right aligned causal / window, per-sequence kv lengths ``seq_lens``
    [B]; returns (or writes ``out``) in q's layout and dtype."""
    q4, k4, v4 = _bnsd(q, layout, heads), _bnsd(k, layout, kv_heads), _bnsd(v, layout, kv_heads)
    b, _, sq, d = q4.shape
    o = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    o4 = _bnsd(o, layout, heads)
    if b == 0 or sq == 0:
        return o
    lens = None if seq_lens is None else \
        seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    if interpreting():  # the interpreter runs programs one by one: fewer, larger ones
        block_m = max(block_m, triton.next_power_of_2(sq))
    elif sq <= 16:  # a few query rows (decode, speculation): no 64-row tiles of padding
        block_m = 16
    _prefill_kernel[(triton.cdiv(sq, block_m), b * heads)](
        q4, k4, v4, o4, lens if lens is not None else q4, *q4.stride()[:3], *k4.stride()[:3],
        *v4.stride()[:3], *o4.stride()[:3], sq, k4.shape[2], heads, heads // kv_heads, d,
        float(scale) * _LOG2E, int(window or 0), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)), CAUSAL=bool(causal or window is not None),
        HAS_WINDOW=window is not None, HAS_LENS=lens is not None,
        # fp32 dots: fp32 inputs (no TF32), and the interpreter (its bf16 dot is wrong)
        IEEE=q.dtype == torch.float32 or interpreting())
    return o
