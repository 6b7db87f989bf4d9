"""Torch kernel for RopeKVCache: q and k rotated and k, v written into the KV cache.

On the CPU this is one C kernel (the RoPE kernel with cache rows as its k/v
destination): tables are RoPE's cached ones, positions are checked before
anything is written, and the caches are updated in place. Elsewhere (CUDA, no
C compiler, positions past any table) RoPE's torch composite runs followed by
two indexed writes (``index_put_``), logged.
"""

from __future__ import annotations

import torch

from ..cpu_kernels import torch_ops as ck
from . import kernel
from .rope import c_unsupported, geometry, rope_c, rope_composite

__all__: list[str] = []

_ROPE_INS = ("q", "k", "position_ids", "cos", "sin")


def _heads(x: torch.Tensor, lay: str, heads: int, d: int) -> torch.Tensor:
    """``x`` in ``lay`` as ``[B, S, H, D]`` (a view)."""
    if lay == "BSH":
        return x.unflatten(-1, (heads, d))
    return x if lay == "BSND" else x.transpose(1, 2)


@kernel("RopeKVCache", impl="C rope of q, k + k/v cache write, one kernel (CPU); else torch "
        "rotary + index_put_", launches=ck.c_launches(16), writes_out=True)
def rope_kv_cache(p, ins, out=None):
    rins = {n: ins.get(n) for n in _ROPE_INS}
    v, kc, vc = ins["v"], ins["key_cache"], ins["value_cache"]
    g = geometry("RopeKVCache", p, rins)
    why = c_unsupported(g, rins) or ck.why_not(v, kc, vc)
    if why is None and (kc.stride(-1) != 1 or vc.stride(-1) != 1):
        why = "KV cache head_dim not contiguous"
    if why is None:
        res = rope_c(p, g, rins, q_out=ck.out_at(out, 0), k_out=kc, v=v, v_out=vc,
                     cache_len=kc.shape[1], op="RopeKVCache")
        if res is not None:
            return [res[0], kc, vc]
        why = "positions past any cos/sin table"
    ck.log_fallback("RopeKVCache", why)
    q_rot, k_rot = rope_composite(p, g, rins)
    pos = ins.get("position_ids")
    if pos is None:
        rows = torch.arange(g.seq, device=kc.device) + int(p.position_offset)
    else:
        rows = pos.to(kc.device, torch.long)
    rows = (rows[None] if rows.dim() == 1 else rows).expand(g.batch, g.seq)   # [B, S]
    bidx = torch.arange(g.batch, device=kc.device)[:, None].expand(g.batch, g.seq)
    kc[bidx, rows] = _heads(k_rot, g.layout, g.k_heads, g.head_dim)          # [B, S, Hkv, D]
    vc[bidx, rows] = _heads(v, g.layout, g.k_heads, g.head_dim)
    return [ck.into(out, 0, q_rot), kc, vc]
