"""Torch kernel for RoPE, with cos/sin tables cached per (rotary_dim, base, type, device).

Tables are computed once in float64 (so positions in the thousands keep fp32
accuracy), stored in fp32, and grown (doubling) when a position exceeds them; every
op with the same rotary geometry on a device shares one table. Half types are
rotated in fp32 and rounded once.

On the CPU, q and k rotate in one C kernel call (:func:`rope_c`): it reads the
cached table rows by position, writes into planned ``out`` buffers or in place
(``out=[q, k]``), and can write the rotated k and v straight into a KV cache
(the ``RopeKVCache`` op). The C kernel checks every position before writing; a
position past the table makes it return the length needed, and the table grows
once. Elsewhere (CUDA, no C compiler, rotary_dim > 1024) the torch composite
(:func:`apply_rope`, ~10 aten ops for q and k) runs and the fallback is logged.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import InputError
from ...runtime.binding import Slot
from ...ops.rope import RoPEParams, RopeGeometry, rope_geometry
from ...ops.rope_tables import RopeTables
from ...tensor import describe
from ..cpu_kernels import torch_ops as ck
from . import kernel

__all__ = ["rope_tables", "clear_rope_cache", "rope_cache_stats", "apply_rope", "rope_c",
           "rope_composite", "rope_with_v", "geometry"]

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


def _make(key: tuple, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rd, base, rotary_type, device, dtype = key
    return _build(rd, base, rotary_type, size, torch.device(device), dtype)


# (rotary_dim, base, rotary_type, device, dtype) -> (cos [P, rd], sin [P, rd])
_TABLES = RopeTables(_make)


def rope_tables(rotary_dim: int, base: float, rotary_type: str, length: int,
                device: Any = "cpu", dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos/sin tables ``[P, rotary_dim]`` with ``P >= length`` (cached)."""
    return _TABLES.get((int(rotary_dim), float(base), rotary_type, str(torch.device(device)),
                        dtype), length)


def clear_rope_cache() -> None:
    """Drop every cached table (tests, or to free device memory)."""
    _TABLES.clear()


def rope_cache_stats() -> dict[str, Any]:
    """Builds, hits and the cached table sizes, for diagnostics."""
    return {"builds": _TABLES.builds, "hits": _TABLES.hits, "tables": _TABLES.sizes()}


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
    ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type,
                         max(need, min(int(p.max_seq_len), MAX_TABLE_LEN)), device)
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


def geometry(op: str, p: RoPEParams, ins: dict) -> RopeGeometry:
    """The validated geometry of a call (cached per params and input shapes/dtypes)."""
    key = (op, p, *((n, None if v is None else (tuple(v.shape), v.dtype)) for n, v in ins.items()))
    g = _GEOMS.get(key)
    if g is None:
        descs = {n: (None if v is None else describe(v)) for n, v in ins.items()}
        g = rope_geometry(op, p, descs)
        if len(_GEOMS) > 256:
            _GEOMS.clear()
        _GEOMS[key] = g
    return g


_GEOMS: dict[tuple, RopeGeometry] = {}


def rope_composite(p: RoPEParams, g: RopeGeometry, ins: dict) -> list:
    """q (and k) rotated by torch ops (the path for CUDA and fallbacks)."""
    q = ins["q"]
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


def c_unsupported(g: RopeGeometry, ins: dict) -> str | None:
    """Why :func:`rope_c` cannot take this call (None = it can)."""
    if g.rotary_dim > ck.MAX_ROTARY_DIM:
        return f"rotary_dim {g.rotary_dim} > {ck.MAX_ROTARY_DIM}"
    return ck.why_not(ins["q"], ins.get("k"), ins.get("cos"), ins.get("sin"))


def _usable(o: Any, like: torch.Tensor) -> bool:
    return (o is not None and o.shape == like.shape and o.dtype == like.dtype
            and (o.numel() == 0 or o.stride(-1) == 1))


def _call(op: str, q: Any, k: Any, cos: Any, sin: Any, **kw: Any) -> int:
    try:
        return ck.rope(q, k, cos, sin, **kw)
    except ValueError as e:  # the C kernel checked positions before writing anything
        raise InputError(op, "position_ids values", ">= 0 and inside the table/cache",
                         str(e)) from None


def rope_c(p: RoPEParams, g: RopeGeometry, ins: dict, q_out: Any = None, k_out: Any = None,
           v: Any = None, v_out: Any = None, cache_len: int = 0, op: str = "RoPE",
           slot: Any = None) -> list | None:
    """Rotate q and k in one C call; returns ``[q_out, k_out?]``, or None when the
    positions are too large for a table and a KV cache is the target (the caller
    runs its composite). ``q_out``/``k_out`` may be q/k (in place); with
    ``cache_len`` they are ``[B, cache_len, Hk, D]`` caches for k and v (``[1,
    cache_len, Hk, D]`` with per-token cache rows ``slot``)."""
    q, k = ins["q"], ins.get("k")
    pos, cos, sin = ins.get("position_ids"), ins.get("cos"), ins.get("sin")
    qo = q_out if _usable(q_out, q) else torch.empty(q.shape, dtype=q.dtype)
    ko = None
    if k is not None:
        ko = k_out if (cache_len or _usable(k_out, k)) else torch.empty(k.shape, dtype=k.dtype)
    rd, start = g.rotary_dim, int(p.position_offset)
    kw = dict(layout=g.layout, head_dim=g.head_dim, rotary_dim=rd, q_heads=g.q_heads,
              k_heads=g.k_heads or 0, interleave=p.rotary_type == "interleave", batch=g.batch,
              seq=g.seq, q_out=qo, k_out=ko, v=v, v_out=v_out, cache_len=cache_len,
              cache_offset=start, **({} if slot is None else {"slot": slot}))
    if cos is not None:  # given tables: [P, rd] by position, or per token
        n = cos.shape[0] if pos is not None else g.seq
        if _call(op, q, k, cos, sin, pos=pos, table_len=n, **kw):
            raise InputError(op, "position_ids values (index into the cos/sin table)", f"< {n}",
                             "a larger id")
        return [qo] if k is None else [qo, ko]
    if pos is None and start + g.seq > MAX_TABLE_LEN:       # far positions: per-token angles
        ids = torch.arange(start, start + g.seq)[None]
        ct, st = _cos_sin_at(ids, rd, p.base, p.rotary_type, q.device, torch.float32)
        _call(op, q, k, ct, st, table_len=g.seq, **kw)
        return [qo] if k is None else [qo, ko]
    # max_seq_len only sizes the first table: never past MAX_TABLE_LEN, whatever it says
    length = min(int(p.max_seq_len), MAX_TABLE_LEN) if pos is not None else start + g.seq
    for _ in range(2):
        ct, st = rope_tables(rd, p.base, p.rotary_type, length, q.device)
        need = _call(op, q, k, ct, st, pos=pos, table_len=ct.shape[0],
                       tab_offset=0 if pos is not None else start, **kw)
        if need == 0:
            return [qo] if k is None else [qo, ko]
        if need > MAX_TABLE_LEN:
            break
        length = need
    if cache_len:
        return None
    # positions past any table: per-token angles, and no position lookup
    ids = pos.long()
    ids = ids[None] if ids.dim() == 1 else ids
    ct, st = _cos_sin_at(ids, rd, p.base, p.rotary_type, q.device, torch.float32)
    _call(op, q, k, ct, st, table_len=g.seq, **kw)
    return [qo] if k is None else [qo, ko]


def rope_with_v(p: RoPEParams, ins: dict, v: torch.Tensor, op: str = "RopeFlashAttention"
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(q_rot, k_rot, v_contiguous)``: RoPE of q and k plus a contiguous copy of v
    (e.g. a slice of packed QKV) in one C kernel on the CPU; else RoPE's torch
    path and ``v.contiguous()``. ``ins`` holds RoPE's inputs; v has k's layout."""
    g = geometry(op, p, ins)
    why = c_unsupported(g, ins) or ck.why_not(v)
    if why is None and ins.get("k") is not None and v.shape == ins["k"].shape:
        vo = torch.empty(v.shape, dtype=v.dtype)
        res = rope_c(p, g, ins, v=_unit_stride(v), v_out=vo, op=op)
        if res is not None:
            return res[0], res[1], vo
    outs = rope(p, ins)
    return outs[0], (outs[1] if len(outs) > 1 else None), v.contiguous()


def _unit_stride(v: torch.Tensor) -> torch.Tensor:
    return v if v.numel() == 0 or v.stride(-1) == 1 else v.contiguous()


def _bind_rope(p: Any, ins: dict, outs: list, ctx: Any) -> Any:
    """q and k in planned buffers, positions per run: the C call packed once per
    position tensor (a plan fed the same tensor, rewritten in place, packs once) over
    a table made now; the general call when a position is past the table. None for
    anything else (given tables, no positions, outputs in slots)."""
    q, k, pos = ins["q"], ins.get("k"), ins.get("position_ids")
    if (pos is None or ins.get("cos") is not None or ins.get("sin") is not None
            or any(type(t) is Slot for t in (q, k, *outs) if t is not None)):
        return None
    pd = pos.desc if type(pos) is Slot else describe(pos)
    probe = torch.empty(pd.shape, dtype=pd.dtype.torch)
    g = geometry("RoPE", p, {"q": q, "k": k, "position_ids": probe})
    if c_unsupported(g, {"q": q, "k": k}) or not str(q.device).startswith("cpu"):
        return None
    qo, ko = outs[0], (outs[1] if k is not None else None)
    if not _usable(qo, q) or (k is not None and not _usable(ko, k)):
        return None
    length = min(int(p.max_seq_len), MAX_TABLE_LEN)
    ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type, length, q.device)
    kw = dict(layout=g.layout, head_dim=g.head_dim, rotary_dim=g.rotary_dim, q_heads=g.q_heads,
              k_heads=g.k_heads or 0, interleave=p.rotary_type == "interleave", batch=g.batch,
              seq=g.seq, q_out=qo, k_out=ko, table_len=ct.shape[0])
    get = (lambda env, i=pos.index: env[i]) if type(pos) is Slot else (lambda env: pos)
    state: list[Any] = [None, None]

    def call(env: list) -> None:
        pt = get(env)
        if state[0] is not pt:
            state[:] = [pt, ck.rope_packed(q, k, ct, st, pos=pt, **kw)]
        try:
            need = state[1]()
        except ValueError as e:  # the C kernel checked positions before writing anything
            raise InputError("RoPE", "position_ids values", ">= 0", str(e)) from None
        if need:  # a position past the table: the general call grows it
            rope(p, {"q": q, "k": k, "position_ids": pt, "cos": None, "sin": None},
                 out=[o for o in (qo, ko) if o is not None])
    return call


@kernel("RoPE", impl="C rope of q and k in one kernel, cached fp64-built tables (CPU); else torch "
        "rotary (fp32 compute)", launches=ck.c_launches(10), writes_out=True, bind=_bind_rope)
def rope(p, ins, out=None):
    g = geometry("RoPE", p, ins)
    why = c_unsupported(g, ins)
    if why is None:
        return rope_c(p, g, ins, ck.out_at(out, 0), ck.out_at(out, 1))
    ck.log_fallback("RoPE", why)
    return [ck.into(out, i, y) for i, y in enumerate(rope_composite(p, g, ins))]
