"""MindSpore kernel for RoPE, with cos/sin tables cached per (rotary_dim, base, type).

Tables are built once on the host in float64 (fp32 angles lose ~1e-4 rad by
position 2048), stored as fp32 MindSpore tensors and grown (doubling) when a
position exceeds them; rows are picked on the device with ``ops.gather``. The
rotation runs in fp32 and rounds once. On Ascend, a full-width rotation of a 4-D
input uses the fused ``ops.rotary_position_embedding``; elsewhere (it is not
registered on the CPU) the composition below runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from atbcore.ops.rope import RoPEParams, RopeGeometry, rope_angles, rope_cos_sin, rope_geometry
from atbcore.ops.rope_tables import RopeTables

from . import kernel
from .common import cast, descs, f32, mint, ms, note, on_ascend, ops

__all__ = ["rope_tables", "clear_rope_cache", "apply_rope", "token_cos_sin"]

def _make(key: tuple, size: int) -> tuple[Any, Any]:
    rotary_dim, base, rotary_type = key
    c, s = rope_cos_sin(rope_angles(np.arange(size), rotary_dim, base), rotary_type)  # [P, rd]
    m = ms()
    return m.Tensor(c.astype(np.float32)), m.Tensor(s.astype(np.float32))


_TABLES = RopeTables(_make)  # (rd, base, type) -> (cos, sin) [P, rd] fp32


def rope_tables(rotary_dim: int, base: float, rotary_type: str, length: int) -> tuple[Any, Any]:
    """Full-width fp32 cos/sin tables ``[P, rotary_dim]`` with ``P >= length`` (cached)."""
    return _TABLES.get((int(rotary_dim), float(base), rotary_type), length)


def clear_rope_cache() -> None:
    """Drop every cached table."""
    _TABLES.clear()


def _rotate(x: Any, rotary_type: str) -> Any:
    mt = mint()
    if rotary_type == "half":
        h = x.shape[-1] // 2
        return mt.cat([mt.neg(x[..., h:]), x[..., :h]], -1)
    # interleave: pairs (x0, x1) -> (-x1, x0); x: [..., rd] -> [..., rd/2, 2]
    pairs = x.reshape((*x.shape[:-1], x.shape[-1] // 2, 2))
    out = mt.cat([mt.neg(pairs[..., 1:2]), pairs[..., 0:1]], -1)
    return out.reshape(x.shape)


def apply_rope(x: Any, cos: Any, sin: Any, rotary_type: str) -> Any:
    """Rotate the first ``rd`` dims of ``x`` [..., D]; cos/sin fp32 broadcastable [..., rd]."""
    mt = mint()
    rd = cos.shape[-1]
    xr = f32(x[..., :rd])
    rot = cast(mt.add(mt.mul(xr, cos), mt.mul(_rotate(xr, rotary_type), sin)), x.dtype)
    if rd == x.shape[-1]:
        return rot
    return mt.cat([rot, x[..., rd:]], -1)


def token_cos_sin(p: RoPEParams, g: RopeGeometry, ins: dict) -> tuple[Any, Any]:
    """fp32 cos/sin per token: ``[B|1, S, rd]``."""
    m, take = ms(), ops().gather
    pos, cos, sin = ins.get("position_ids"), ins.get("cos"), ins.get("sin")
    if cos is not None:
        cos, sin = f32(cos), f32(sin)
        if pos is not None:  # a table indexed by the ids
            ids = pos.astype(m.int64)
            ids = ids.reshape((1, -1)) if ids.ndim == 1 else ids
            return take(cos, ids, 0), take(sin, ids, 0)
        return (cos.reshape((1, *cos.shape)), sin.reshape((1, *sin.shape))) if cos.ndim == 2 \
            else (cos, sin)
    if pos is None:
        start = int(p.position_offset)
        ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type, start + g.seq)
        return (ct[start:start + g.seq].reshape((1, g.seq, -1)),
                st[start:start + g.seq].reshape((1, g.seq, -1)))
    ids = pos.astype(m.int64)
    ids = ids.reshape((1, -1)) if ids.ndim == 1 else ids
    need = int(ids.max()) + 1 if ids.size else 1
    ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type, max(need, int(p.max_seq_len)))
    return take(ct, ids, 0), take(st, ids, 0)


def _as_heads(x: Any, g: RopeGeometry, heads: int) -> Any:
    # BSH [B, S, H*D] -> [B, S, H, D]; 4-D layouts as they are
    return x.reshape((g.batch, g.seq, heads, g.head_dim)) if g.layout == "BSH" else x


def fused_rope_reason(p: RoPEParams, g: Any, q: Any, cos: Any) -> str:
    """Why ``ops.rotary_position_embedding`` cannot take this call ('' = it can): its
    documented layout constraints (4-D BNSD/BSND, D even and < 896; half mode B, N <
    1000; interleaved mode B*N < 1000 and one cos/sin row set for the whole batch; no
    BNSD call with a 32-byte aligned D and B*N > 8S)."""
    if not on_ascend(q):
        return "ops.rotary_position_embedding is Ascend-only"
    if g.rotary_dim != g.head_dim or g.layout == "BSH":
        return "partial rotary or a BSH input"
    d, heads = g.head_dim, max(g.q_heads, g.k_heads or 0)
    if d % 2 or d >= 896:
        return f"head_dim {d}: the fused op takes an even D < 896"
    if str(q.dtype) == "BFloat16":  # cos/sin take x's dtype
        return "bf16: cos/sin rounded to bf16 (they take x's dtype) miss the bf16 tolerance"
    if p.rotary_type == "half" and (g.batch >= 1000 or heads >= 1000):
        return "half mode takes B and N < 1000"
    if p.rotary_type != "half" and (g.batch * heads >= 1000 or cos.shape[0] != 1):
        return "interleaved mode takes B*N < 1000 and positions shared by the batch"
    size = 2 if str(q.dtype) == "Float16" else 4
    if g.layout == "BNSD" and (d * size) % 32 == 0 and g.batch * heads > 8 * g.seq:
        return "BNSD with a 32-byte aligned D and B*N > 8S is refused by the fused op"
    return ""


def rope_outputs(p: RoPEParams, ins: dict, op: str = "RoPE") -> list:
    """Rotated q (and k) for the RoPE op's inputs (MindSpore tensors)."""
    g = rope_geometry(op, p, descs(ins))
    cos, sin = token_cos_sin(p, g, ins)                      # [B|1, S, rd]
    if g.layout == "BNSD":                                   # -> [B|1, 1, S, rd]
        cos, sin = cos.reshape((cos.shape[0], 1, *cos.shape[1:])), \
            sin.reshape((sin.shape[0], 1, *sin.shape[1:]))
    else:                                                    # -> [B|1, S, 1, rd]
        cos, sin = cos.reshape((*cos.shape[:2], 1, cos.shape[2])), \
            sin.reshape((*sin.shape[:2], 1, sin.shape[2]))
    why = fused_rope_reason(p, g, ins["q"], cos)
    fused = not why
    note(op, "ops.rotary_position_embedding (Ascend fused)" if fused else
         "composed x*cos + rotate(x)*sin, fp32", why)
    outs = []
    for name, heads in (("q", g.q_heads), ("k", g.k_heads)):
        x = ins.get(name)
        if x is None:
            continue
        if fused:
            mode = 0 if p.rotary_type == "half" else 1
            y = ops().rotary_position_embedding(x, cast(cos, x.dtype), cast(sin, x.dtype), mode)
        else:
            y = apply_rope(_as_heads(x, g, heads), cos, sin, p.rotary_type)
        outs.append(y.reshape(x.shape))
    return outs


@kernel("RoPE", impl="mindspore rotary (cached fp64-built cos/sin tables, fp32 compute)",
        launches=2)
def rope(p, ins):
    return rope_outputs(p, ins)
