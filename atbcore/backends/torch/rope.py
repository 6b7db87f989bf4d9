"""Torch kernel for RoPE, with cos/sin tables cached per (rotary_dim, base, type, device).

Tables are computed once in float64 (so positions in the thousands keep fp32
accuracy), stored in fp32, and grown (doubling) when a position exceeds them; every
op with the same rotary geometry on a device shares one table. Half types are
rotated in fp32 and rounded once.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ...ops.rope import RoPEParams, RopeGeometry, rope_geometry
from ...tensor import describe
from . import kernel

__all__ = ["rope_tables", "clear_rope_cache", "rope_cache_stats", "apply_rope"]

_LOCK = threading.Lock()
# (rotary_dim, base, rotary_type, device, dtype) -> (cos [P, rd], sin [P, rd])
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_STATS = {"builds": 0, "hits": 0}


# Positions past this are rotated from angles computed on the fly, not from a table,
# so one huge position id cannot make the cache allocate gigabytes.
MAX_TABLE_LEN = 1 << 20


def _cos_sin_at(positions: torch.Tensor, rd: int, base: float, rotary_type: str,
                device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # float64: fp32 angles lose ~1e-4 rad at position 2048.
    inv_freq = base ** (-torch.arange(0, rd, 2, dtype=torch.float64, device=positions.device) / rd)
    ang = positions.to(torch.float64)[..., None] * inv_freq                # [..., rd/2]
    full = torch.cat([ang, ang], -1) if rotary_type == "half" else ang.repeat_interleave(2, -1)
    return full.cos().to(device, dtype), full.sin().to(device, dtype)


def _build(rd: int, base: float, rotary_type: str, length: int, device: torch.device,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # built on the host once, then moved: not every device has float64
    return _cos_sin_at(torch.arange(length), rd, base, rotary_type, device, dtype)


def rope_tables(rotary_dim: int, base: float, rotary_type: str, length: int,
                device: Any = "cpu", dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos/sin tables ``[P, rotary_dim]`` with ``P >= length`` (cached)."""
    device = torch.device(device)
    key = (int(rotary_dim), float(base), rotary_type, str(device), dtype)
    hit = _TABLES.get(key)
    if hit is not None and hit[0].shape[0] >= length:
        _STATS["hits"] += 1
        return hit
    with _LOCK:
        hit = _TABLES.get(key)
        if hit is not None and hit[0].shape[0] >= length:
            return hit
        size = max(int(length), 2 * hit[0].shape[0] if hit is not None else 0)
        tables = _build(int(rotary_dim), float(base), rotary_type, size, device, dtype)
        _TABLES[key] = tables
        _STATS["builds"] += 1
        return tables


def clear_rope_cache() -> None:
    """Drop every cached table (tests, or to free device memory)."""
    with _LOCK:
        _TABLES.clear()
        _STATS.update(builds=0, hits=0)


def rope_cache_stats() -> dict[str, Any]:
    """Builds, hits and the cached table sizes, for diagnostics."""
    return {"builds": _STATS["builds"], "hits": _STATS["hits"],
            "tables": {k: int(v[0].shape[0]) for k, v in _TABLES.items()}}


def _rotate(x: torch.Tensor, rotary_type: str) -> torch.Tensor:
    if rotary_type == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    # interleave: (x0, x1) -> (-x1, x0) per pair
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def _token_cos_sin(p: RoPEParams, g: RopeGeometry, ins: dict, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin per token: [B|1, S, rd]."""
    pos, cos, sin = ins.get("position_ids"), ins.get("cos"), ins.get("sin")
    if cos is not None:
        cos, sin = cos.float(), sin.float()
        if pos is not None:  # a table indexed by the ids
            ids = pos.long()
            ids = ids[None] if ids.dim() == 1 else ids
            return cos[ids], sin[ids]
        return (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)
    if pos is None:
        start = int(p.position_offset)
        if start + g.seq > MAX_TABLE_LEN:
            ids = torch.arange(start, start + g.seq)[None]
            return _cos_sin_at(ids, g.rotary_dim, p.base, p.rotary_type, device, torch.float32)
        ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type, start + g.seq, device)
        return ct[None, start:start + g.seq], st[None, start:start + g.seq]
    ids = pos.long()
    ids = ids[None] if ids.dim() == 1 else ids
    need = int(ids.max()) + 1 if ids.numel() else 1
    if need > MAX_TABLE_LEN:
        return _cos_sin_at(ids, g.rotary_dim, p.base, p.rotary_type, device, torch.float32)
    ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type, max(need, int(p.max_seq_len)), device)
    return ct[ids], st[ids]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_type: str
               ) -> torch.Tensor:
    """Rotate the first ``rd`` dims of ``x`` [..., D]; cos/sin fp32 broadcastable [..., rd]."""
    rd = cos.shape[-1]
    xr = x[..., :rd].float()
    rot = (xr * cos + _rotate(xr, rotary_type) * sin).to(x.dtype)
    if rd == x.shape[-1]:
        return rot
    return torch.cat((rot, x[..., rd:]), dim=-1)


def _as_heads(x: torch.Tensor, g: RopeGeometry, heads: int) -> torch.Tensor:
    # BSH [B, S, H*D] -> [B, S, H, D]; 4-D layouts as they are
    return x.unflatten(-1, (heads, g.head_dim)) if g.layout == "BSH" else x


@kernel("RoPE", impl="torch rotary (cached fp64-built cos/sin tables, fp32 compute)", launches=2)
def rope(p, ins):
    q = ins["q"]
    descs = {n: (None if v is None else describe(v)) for n, v in ins.items()}
    g = rope_geometry("RoPE", p, descs)
    cos, sin = _token_cos_sin(p, g, ins, q.device)           # [B|1, S, rd]
    if g.layout == "BNSD":                                    # -> [B|1, 1, S, rd]
        cos, sin = cos[:, None], sin[:, None]
    else:                                                     # -> [B|1, S, 1, rd]
        cos, sin = cos[:, :, None], sin[:, :, None]
    outs = []
    for name, heads in (("q", g.q_heads), ("k", g.k_heads)):
        x = ins.get(name)
        if x is None:
            continue
        y = apply_rope(_as_heads(x, g, heads), cos, sin, p.rotary_type)
        outs.append(y.reshape(x.shape))
    return outs
