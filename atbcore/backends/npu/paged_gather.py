"""PagedAttention on an NPU over its K/V rows gathered contiguous, for the calls
torch_npu's paged ops do not take: several query tokens per sequence (a prefill or
a chunk over the cache, ``q_seq_lens``), a sliding window, and the 310P (whose ATB
paged ops take NZ caches, atb's are ND).

Each sequence's first ``max(context_lens)`` cache rows are gathered through its
block table into ``[B, Skv, Hkv*D]``, its query tokens placed at the end of a
``[B, Sq, H*D]`` batch (right-aligned, as PagedAttention aligns a sequence's new
tokens to the end of its context), and FlashAttention's NPU kernel runs the batch:
``npu_fusion_attention`` for several query rows (A2/A3; the causal bottom-right
``sparse_mode=3`` when every row is a whole prompt), ``npu_fused_infer_attention_score``
/ ``npu_incre_flash_attention`` for one. Other rows see no key (their output is
dropped). Host reads: the per-row lengths, once per call.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from ...ops.attention import FlashAttentionParams

__all__ = ["gathered_reason", "paged_attention_gathered"]


def _fa_params(p: Any, h: int, hkv: int, d: int, causal: bool) -> FlashAttentionParams:
    scale = p.scale if p.scale is not None else 1.0 / math.sqrt(d)
    return FlashAttentionParams(num_heads=h, num_kv_heads=hkv, head_dim=d, scale=scale,
                                causal=causal, layout="BSH")


def gathered_reason(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why FlashAttention's NPU kernel cannot take this PagedAttention call over its
    gathered rows (checked on meta tensors of the batch it would see)."""
    from .attention import flash_attention_reasons

    q, kc = ins["query"], ins["key_cache"]
    t, h, d = q.shape
    hkv, b = kc.shape[2], ins["block_tables"].shape[0]
    sq = 1 if t == b else 2  # one query row per sequence, or several
    meta = dict(dtype=q.dtype, device="meta")
    probe = {"q": torch.empty(b, sq, h * d, **meta), "k": torch.empty(b, sq, hkv * d, **meta),
             "v": torch.empty(b, sq, hkv * d, **meta),
             "mask": torch.empty(b, 1, sq, sq, dtype=torch.bool, device="meta")}
    return flash_attention_reasons(_fa_params(p, h, hkv, d, False), probe)


def _gather_rows(cache: torch.Tensor, tables: torch.Tensor, skv: int) -> torch.Tensor:
    """Each sequence's first ``skv`` cache rows ``[B, Skv, Hkv*D]`` (a copy)."""
    nb, bs, hkv, d = cache.shape
    b = tables.shape[0]
    nblk = -(-skv // bs)
    if nblk == 1:  # one block per sequence: only its first skv rows are read
        return cache[:, :skv].index_select(0, tables[:, 0].long()).reshape(b, skv, hkv * d)
    rows = cache[tables[:, :nblk].long()]                               # [B, nblk, bs, Hkv, D]
    return rows.reshape(b, nblk * bs, hkv * d)[:, :skv]


def paged_attention_gathered(p: Any, ins: Mapping[str, Any]) -> torch.Tensor:
    """The attention ``[T, H, D]`` of a PagedAttention call (see the module docstring)."""
    from .attention import flash_attention_npu

    q, kc, vc, tables = ins["query"], ins["key_cache"], ins["value_cache"], ins["block_tables"]
    t, h, d = q.shape
    hkv, b = kc.shape[2], tables.shape[0]
    ctx = np.asarray(ins["context_lens"].tolist(), dtype=np.int64)
    qsl = ins.get("q_seq_lens")
    q_lens = np.ones(b, dtype=np.int64) if qsl is None or t == b else \
        np.asarray(qsl.tolist(), dtype=np.int64)
    sq, skv = int(q_lens.max()), max(int(ctx.max()), 1)
    # packed token -> its slot in the right-aligned [B * Sq] batch
    row = np.repeat(np.arange(b), q_lens)
    within = np.arange(t) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    slot = torch.as_tensor(row * sq + sq - q_lens[row] + within, device=q.device)
    qb = q.new_zeros(b * sq, h * d)
    qb[slot] = q.reshape(t, h * d)
    fa_ins: dict[str, Any] = {"q": qb.view(b, sq, h * d), "k": _gather_rows(kc, tables, skv),
                              "v": _gather_rows(vc, tables, skv)}
    causal = p.causal or p.window is not None
    whole = bool((q_lens == sq).all() and (ctx == skv).all() and sq == skv)
    if causal and p.window is None and whole:  # every row a whole prompt: sparse_mode 3
        fa = _fa_params(p, h, hkv, d, True)
    else:
        fa = _fa_params(p, h, hkv, d, False)
        fa_ins["mask"] = _visible(ctx, sq, skv, causal, p.window, q.device)
    o, = flash_attention_npu(fa, fa_ins)                               # [B, Sq, H*D]
    return o.reshape(b * sq, h * d)[slot].view(t, h, d)


def _visible(ctx: np.ndarray, sq: int, skv: int, causal: bool, window: int | None,
             device: torch.device) -> torch.Tensor:
    """Bool ``[B, 1, Sq, Skv]``, True where right-aligned query slot ``j`` of row
    ``b`` (position ``ctx[b] - Sq + j``) sees key ``s``."""
    c = torch.as_tensor(ctx, device=device)
    keys = torch.arange(skv, device=device)
    pos = c[:, None] - sq + torch.arange(sq, device=device)                  # [B, Sq]
    allow = (keys[None, None, :] < c[:, None, None]).expand(-1, sq, -1)     # [B, Sq, Skv]
    if causal:
        allow = allow & (keys[None, None, :] <= pos[:, :, None])
    if window is not None:
        allow = allow & (keys[None, None, :] > pos[:, :, None] - window)
    return allow[:, None]
