"""RoPE on framework-free views: q and k rotated in one C call (``atb_rope``).

Cos/sin come from the call (a ``[P, rd]`` table indexed by ``position_ids``, or per
token) or from atb's own tables: fp32, built in float64 once per (rotary_dim, base,
type) and grown by doubling when a position passes their end (the C kernel checks
every position against the table and writes nothing when one is past it: it returns
the length it needs). Positions past ``MAX_TABLE_LEN`` are left to the framework.
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

import numpy as np

from ...dtypes import Dtype
from ...errors import InputError
from ...ops.rope import rope_angles, rope_cos_sin, rope_geometry
from ...ops.rope_tables import RopeTables
from ...tensor import TensorDesc
from .native import DTYPE_CODES, NativeView, array_view
from .native_ops import Step, TableTooShort

__all__ = ["RopeSpec", "TableTooShort", "rope_tables", "MAX_TABLE_LEN", "MAX_ROTARY_DIM"]

ROPE = struct.Struct("<46q")  # RopeArgs (rope.c)
MAX_ROTARY_DIM = 1024         # ATB_ROPE_MAX_RD in rope.c
MAX_TABLE_LEN = 1 << 20       # positions past it: the framework's path (no huge tables)

def _make(key: tuple, size: int) -> tuple[np.ndarray, np.ndarray]:
    rd, base, rotary_type = key
    c, s = rope_cos_sin(rope_angles(np.arange(size), rd, base), rotary_type)  # float64 [P, rd]
    return c.astype(np.float32), s.astype(np.float32)


_TABLES = RopeTables(_make, min_rows=16)


def rope_tables(rd: int, base: float, rotary_type: str, length: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Full-width fp32 cos/sin ``[P, rd]``, ``P >= length`` (cached; built in float64)."""
    return _TABLES.get((int(rd), float(base), rotary_type), length)


def _bshd(v: NativeView, layout: str, head_dim: int) -> tuple[int, int, int]:
    """Element strides of (batch, seq, head) of a q/k tensor in ``layout``."""
    st = v.strides
    if layout == "BSH":
        return st[0], st[1], head_dim * st[2]
    if layout == "BNSD":
        return st[0], st[2], st[1]
    return st[0], st[1], st[2]


def _desc(v: NativeView | None) -> TensorDesc | None:
    return None if v is None else TensorDesc(v.shape, v.dtype)


class RopeSpec:
    """RoPE of q (and k) into new outputs (see the module doc)."""

    entry = "rope"
    has_workspace = False
    launches = 1
    max_table_len = MAX_TABLE_LEN

    def workspace(self, p: Any, shapes: Mapping[str, tuple]) -> int:
        return 0

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        for n in ("q", "k", "cos", "sin", "position_ids"):
            v = views.get(n)
            if v is not None and not v.contiguous:
                return f"{n} is not contiguous"
        for n in ("q", "k", "cos", "sin"):
            v = views.get(n)
            if v is not None and v.dtype not in DTYPE_CODES:
                return f"{n} dtype {v.dtype.value}"
        cos, sin = views.get("cos"), views.get("sin")
        if cos is not None and (sin is None or sin.dtype != cos.dtype):
            return "sin's dtype differs from cos's"
        g = rope_geometry("RoPE", p, {n: _desc(v) for n, v in views.items()})
        if g.rotary_dim > MAX_ROTARY_DIM:
            return f"rotary_dim {g.rotary_dim} > {MAX_ROTARY_DIM}"
        if cos is None and views.get("position_ids") is None \
                and int(p.position_offset) + g.seq > MAX_TABLE_LEN:
            return f"positions past {MAX_TABLE_LEN} (no table that long)"
        return None

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        return [(views[n].shape, views[n].dtype) for n in ("q", "k") if n in views]

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list,
              table_len: int = 0) -> list:
        """The one C call; atb's own tables are at least ``table_len`` long."""
        g = rope_geometry("RoPE", p, {n: _desc(v) for n, v in views.items()})
        q, k, pos = views["q"], views.get("k"), views.get("position_ids")
        cos, sin = views.get("cos"), views.get("sin")
        start, cs_sb, tab_offset = int(p.position_offset), 0, 0
        if cos is not None:
            n = cos.shape[-2] if pos is not None else g.seq
            if table_len > n:  # the caller's table: it cannot grow (a position past it)
                raise InputError("RoPE", "position_ids values (index into the cos/sin table)",
                                 f"< {n}", table_len - 1)
            if cos.shape[-1] < g.rotary_dim:
                raise InputError("RoPE", "cos / sin last dim", f">= {g.rotary_dim}",
                                 list(cos.shape))
            cs_sb = cos.strides[0] if len(cos.shape) == 3 and cos.shape[0] > 1 else 0
        else:
            want = (max(min(int(p.max_seq_len), MAX_TABLE_LEN), table_len) if pos is not None
                    else start + g.seq)
            ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type, want)
            cos, sin, n = array_view(ct), array_view(st), ct.shape[0]
            tab_offset = 0 if pos is not None else start
        pos_sb = pos.strides[0] if pos is not None and len(pos.shape) == 2 \
            and pos.shape[0] > 1 else 0
        hd, lay = g.head_dim, g.layout
        z3 = (0, 0, 0)
        qo, ko = outs[0], (outs[1] if k is not None else None)
        fields = (
            q.address, qo.address, 0 if k is None else k.address, 0 if ko is None else ko.address,
            0, 0, cos.address, sin.address, 0 if pos is None else pos.address,
            DTYPE_CODES[q.dtype], DTYPE_CODES[cos.dtype],
            int(pos is not None and pos.dtype == Dtype.INT32), int(p.rotary_type == "interleave"),
            g.batch, g.seq, hd, g.rotary_dim, g.q_heads, g.k_heads or 0,
            *_bshd(q, lay, hd), *_bshd(qo, lay, hd),
            *(z3 if k is None else _bshd(k, lay, hd)), *(z3 if ko is None else _bshd(ko, lay, hd)),
            *z3, *z3, cs_sb, cos.strides[-2], n, tab_offset, pos_sb, 0, start, 0, 0)
        if q.numel == 0 and (k is None or k.numel == 0):
            return []
        return [Step("rope", ROPE, fields, keep=(cos.owner, sin.owner))]  # tables live on
