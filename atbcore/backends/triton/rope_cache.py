"""Triton RoPE ("half" / NeoX layout) of q and k, fused with the KV-cache write.

One program per (token, head): q heads are rotated into ``q_out``; k heads are
rotated straight into row ``cache_rows[b, s]`` of the key cache and the matching v
head is copied into the value cache, so k never round-trips through memory. Math is
fp32 with one rounding; partial rotary (``rotary_dim < head_dim``) passes the
trailing dims through. Cos/sin come from a full-width fp32 table ``[P, rotary_dim]``
read at ``table_rows[b, s]``. Rows outside the cache or the table are not written
(the op checks positions before a kernel runs). Paged caches (``slot_mapping``) are
written at each token's flat slot. :func:`rope` is the same kernel
writing rotated k into ``k_out`` instead of a cache (the RoPE op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_to

__all__ = ["rope_kv_cache", "rope"]


@triton.jit
def _rotate_row(src, dst, cos_row, sin_row, d, head_dim, HALF: tl.constexpr, ok):
    """dst[d] = src[d] * cos[d] + sign(d) * src[partner(d)] * sin[d] on the rotary dims."""
    rd = 2 * HALF
    dmask = d < head_dim
    rmask = d < rd
    x = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    xp = tl.load(src + partner, mask=rmask, other=0.0).to(tl.float32)
    c = tl.load(cos_row + d, mask=rmask, other=1.0).to(tl.float32)
    s = tl.load(sin_row + d, mask=rmask, other=0.0).to(tl.float32)
    sign = tl.where(d < HALF, -1.0, 1.0)
    tl.store(dst + d, round_to(x * c + sign * xp * s, dst), mask=dmask & ok)


@triton.jit
def _rope_kv_cache_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr,
                          crow_ptr, trow_ptr, seq, q_heads, head_dim, cache_len, table_len,
                          sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                          so_b, so_s, so_h, skc_b, skc_s, skc_h, svc_b, svc_s, svc_h, s_tab,
                          HALF: tl.constexpr, BLOCK_D: tl.constexpr, HAS_V: tl.constexpr):
    tok = tl.program_id(0)
    h = tl.program_id(1)
    b = (tok // seq).to(tl.int64)
    s = (tok % seq).to(tl.int64)
    crow = tl.load(crow_ptr + tok).to(tl.int64)
    trow = tl.load(trow_ptr + tok).to(tl.int64)
    t_ok = (trow >= 0) & (trow < table_len)
    trow = tl.where(t_ok, trow, 0)
    cos_row = cos_ptr + trow * s_tab
    sin_row = sin_ptr + trow * s_tab
    d = tl.arange(0, BLOCK_D)
    if h < q_heads:
        _rotate_row(q_ptr + b * sq_b + s * sq_s + h * sq_h, qo_ptr + b * so_b + s * so_s + h * so_h,
                    cos_row, sin_row, d, head_dim, HALF, t_ok)
    else:
        hk = (h - q_heads).to(tl.int64)
        ok = t_ok & (crow >= 0) & (crow < cache_len)
        crow = tl.where(ok, crow, 0)
        _rotate_row(k_ptr + b * sk_b + s * sk_s + hk * sk_h,
                    kc_ptr + b * skc_b + crow * skc_s + hk * skc_h,
                    cos_row, sin_row, d, head_dim, HALF, ok)
        if HAS_V:
            vrow = tl.load(v_ptr + b * sv_b + s * sv_s + hk * sv_h + d, mask=d < head_dim,
                           other=0.0)
            tl.store(vc_ptr + b * svc_b + crow * svc_s + hk * svc_h + d,
                     vrow.to(vc_ptr.dtype.element_ty), mask=(d < head_dim) & ok)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_out: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, cache_rows: torch.Tensor, table_rows: torch.Tensor,
                  rotary_dim: int, paged: bool = False) -> None:
    """Rotate ``q`` into ``q_out`` and write rotated ``k`` and ``v`` into the caches.

    q/k/v/q_out: ``[B, S, H, D]`` views (any strides; unit stride on D); caches
    ``[B, S_max, Hkv, D]``; cos/sin ``[P, rotary_dim]`` full width; cache_rows and
    table_rows int ``[B, S]``. ``paged``: the caches are contiguous blocks
    ``[num_blocks, block_size, Hkv, D]`` and cache_rows are flat slots into their
    ``num_blocks * block_size`` rows, shared by every batch row (a negative slot is
    not written)."""
    b, s, hq, d = q.shape
    hk = k.shape[2]
    if b * s == 0:
        return
    q, k, v = _unit(q), _unit(k), _unit(v)
    cos, sin = cos.contiguous(), sin.contiguous()
    crow = cache_rows.to(torch.int32).expand(b, s).contiguous()
    trow = table_rows.to(torch.int32).expand(b, s).contiguous()
    if paged:  # one flat [rows, Hkv, D] cache; batch stride 0: slots are absolute
        kc = key_cache.view(-1, *key_cache.shape[2:])
        vc = value_cache.view(-1, *value_cache.shape[2:])
        rows, kcs, vcs = kc.shape[0], (0, *kc.stride()[:2]), (0, *vc.stride()[:2])
    else:
        kc, vc, rows = key_cache, value_cache, key_cache.shape[1]
        kcs, vcs = key_cache.stride()[:3], value_cache.stride()[:3]
    _rope_kv_cache_kernel[(b * s, hq + hk)](
        q, k, v, q_out, kc, vc, cos, sin, crow, trow, s, hq, d,
        rows, cos.shape[0], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *q_out.stride()[:3], *kcs, *vcs, cos.stride(0),
        HALF=rotary_dim // 2, BLOCK_D=max(16, triton.next_power_of_2(d)), HAS_V=True)


def rope(q: torch.Tensor, k: torch.Tensor | None, q_out: torch.Tensor,
         k_out: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
         table_rows: torch.Tensor, rotary_dim: int) -> None:
    """Plain RoPE: ``q`` into ``q_out`` and ``k`` into ``k_out`` (all ``[B, S, H, D]``
    views, unit stride on D), the same kernel with k's rows as its "cache"."""
    b, s, hq, d = q.shape
    if b * s == 0:
        return
    q = _unit(q)
    kk = q if k is None else _unit(k)
    ko = q_out if k_out is None else k_out
    hk = 0 if k is None else k.shape[2]
    cos, sin = cos.contiguous(), sin.contiguous()
    rows = torch.arange(s, device=q.device, dtype=torch.int32)[None].expand(b, s).contiguous()
    trow = table_rows.to(torch.int32).expand(b, s).contiguous()
    _rope_kv_cache_kernel[(b * s, hq + hk)](
        q, kk, q, q_out, ko, q_out, cos, sin, rows, trow, s, hq, d, s, cos.shape[0],
        *q.stride()[:3], *kk.stride()[:3], *q.stride()[:3], *q_out.stride()[:3],
        *ko.stride()[:3], *q_out.stride()[:3], cos.stride(0),
        HALF=rotary_dim // 2, BLOCK_D=max(16, triton.next_power_of_2(d)), HAS_V=False)
