"""Paddle kernel for RoPE: cos/sin tables built once in float64 (cached per rotary
geometry and device, grown by doubling), rotation in fp32, rounded once.

On a GPU, fp32 inputs with the "half" rotation over the full head use
``paddle.incubate.nn.functional.fused_rotary_position_embedding`` (Paddle calls
that layout ``use_neox_rotary_style=False``: halves, with ``cat(freqs, freqs)``
tables, as PaddleNLP's LLaMA passes them), given our own float64-built tables so
both paths turn by the same angles. Paddle 3.3 registers no CPU kernel for it, so on
the CPU the composition below always runs. (The GPU path is untested on this
CPU-only machine.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF

from atbcore.ops.rope import rope_angles, rope_cos_sin, rope_geometry
from atbcore.ops.rope_tables import RopeTables
from atbcore.tensor import describe

from . import kernel
from .common import PATHS, f32, fused_reason, take, to_dtype

__all__ = ["rope_tables", "clear_rope_cache"]

MAX_TABLE_LEN = 1 << 20   # positions past this are rotated from on-the-fly angles


def _cos_sin(positions: np.ndarray, rd: int, base: float, rotary_type: str, place) -> tuple:
    # float64 angles: fp32 ones drift ~1e-4 rad by position 2048
    c, s = rope_cos_sin(rope_angles(positions, rd, base), rotary_type)
    return (paddle.to_tensor(c.astype(np.float32), place=place),
            paddle.to_tensor(s.astype(np.float32), place=place))


def _make(key: tuple, size: int, place: Any) -> tuple:
    rd, base, rotary_type, _ = key
    return _cos_sin(np.arange(size), rd, base, rotary_type, place)


_TABLES = RopeTables(_make)  # (rd, base, type, place) -> (cos, sin) [P, rd] fp32


def rope_tables(rd: int, base: float, rotary_type: str, length: int, place) -> tuple:
    """fp32 cos/sin tables ``[P, rd]`` with ``P >= length`` on ``place`` (cached)."""
    return _TABLES.get((int(rd), float(base), rotary_type, str(place)), length, place)


def clear_rope_cache() -> None:
    """Drop the cached tables (tests, or to free device memory)."""
    _TABLES.clear()


def _token_cos_sin(p, g, ins, place) -> tuple:
    """fp32 cos/sin per token, [B|1, S, rd]."""
    pos, cos, sin = ins.get("position_ids"), ins.get("cos"), ins.get("sin")
    if cos is not None:
        cos, sin = f32(cos), f32(sin)
        if pos is not None:                           # a table indexed by the ids
            ids = pos if pos.ndim == 2 else pos.unsqueeze(0)
            return take(cos, ids, 0), take(sin, ids, 0)
        return (cos.unsqueeze(0), sin.unsqueeze(0)) if cos.ndim == 2 else (cos, sin)
    if pos is None:
        start = int(p.position_offset)
        if start + g.seq > MAX_TABLE_LEN:
            c, s = _cos_sin(np.arange(start, start + g.seq), g.rotary_dim, p.base, p.rotary_type, place)
            return c.unsqueeze(0), s.unsqueeze(0)
        ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type, start + g.seq, place)
        return ct[start:start + g.seq].unsqueeze(0), st[start:start + g.seq].unsqueeze(0)
    ids = pos if pos.ndim == 2 else pos.unsqueeze(0)
    need = int(ids.max()) + 1 if ids.numel() else 1
    if need > MAX_TABLE_LEN:
        ids_np = ids.numpy().astype(np.int64)
        return _cos_sin(ids_np, g.rotary_dim, p.base, p.rotary_type, place)
    ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type, max(need, int(p.max_seq_len)), place)
    return take(ct, ids, 0), take(st, ids, 0)


def _rotate(x, rotary_type: str):
    if rotary_type == "half":
        h = x.shape[-1] // 2
        return paddle.concat([-x[..., h:], x[..., :h]], axis=-1)
    pairs = x.reshape([*x.shape[:-1], -1, 2])          # (x0, x1) -> (-x1, x0) per pair
    return paddle.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


def apply_rope(x, cos, sin, rotary_type: str):
    """Rotate the first ``rd`` dims of ``x`` [..., D]; cos/sin fp32 broadcastable [..., rd]."""
    rd = cos.shape[-1]
    xr = f32(x[..., :rd])
    rot = to_dtype(xr * cos + _rotate(xr, rotary_type) * sin, x.dtype)
    if rd == x.shape[-1]:
        return rot
    return paddle.concat([rot, x[..., rd:]], axis=-1)


def _as_heads(x, g, heads: int):
    # BSH [B, S, H*D] -> [B, S, H, D]; 4-D layouts as they are
    return x.reshape([g.batch, g.seq, heads, g.head_dim]) if g.layout == "BSH" else x


def _fused_gpu(p, g, ins) -> list | None:
    """fused_rotary_position_embedding on a GPU; None where it does not apply."""
    q = ins["q"]
    if (fused_reason("fused_rotary_position_embedding", q) or q.dtype != paddle.float32
            or p.rotary_type != "half" or g.rotary_dim != g.head_dim or g.layout == "BNSD"):
        return None
    cos, sin = _token_cos_sin(p, g, ins, q.place)          # [B|1, S, D]
    if cos.shape[0] != 1:
        return None                                         # the op takes one table for all
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)           # [1, S, 1, D]
    xs = [_as_heads(ins[n], g, h) for n, h in (("q", g.q_heads), ("k", g.k_heads))
          if ins.get(n) is not None]
    outs = IF.fused_rotary_position_embedding(xs[0], xs[1] if len(xs) > 1 else None, None,
                                              sin=sin, cos=cos, use_neox_rotary_style=False)
    PATHS[("RoPE", "fused_rotary_position_embedding")] += 1
    return [o.reshape(ins[n].shape) for o, n in zip(outs, ("q", "k")) if ins.get(n) is not None]


@kernel("RoPE", impl="paddle rotary composition (fp64-built cached tables, fp32 compute); "
        "GPU fp32: fused_rotary_position_embedding", launches=2)
def rope(p, ins):
    g = rope_geometry("RoPE", p, {n: (None if v is None else describe(v)) for n, v in ins.items()})
    fused = _fused_gpu(p, g, ins)
    if fused is not None:
        return fused
    PATHS[("RoPE", "composed")] += 1
    cos, sin = _token_cos_sin(p, g, ins, ins["q"].place)    # [B|1, S, rd]
    if g.layout == "BNSD":                                  # -> [B|1, 1, S, rd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    else:                                                   # -> [B|1, S, 1, rd]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    outs = []
    for name, heads in (("q", g.q_heads), ("k", g.k_heads)):
        x = ins.get(name)
        if x is None:
            continue
        outs.append(apply_rope(_as_heads(x, g, heads), cos, sin, p.rotary_type).reshape(x.shape))
    return outs
