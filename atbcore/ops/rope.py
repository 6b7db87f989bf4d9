"""RoPE: rotary position embedding of q (and k) in one op.

Two layouts of the rotated pairs are supported:

* ``"half"`` (GPT-NeoX / LLaMA, HF ``rotate_half``): dim ``i`` pairs with ``i + rd/2``;
* ``"interleave"`` (GPT-J, the ATB seed's default): dims ``(2i, 2i+1)`` pair up.

Pair ``i`` turns by ``pos * base**(-2i / rd)`` where ``rd`` is ``rotary_dim`` (the
first ``rd`` dims of every head rotate, the rest pass through: partial rotary).
Rotation is per head (``head_dim``), as ATB and every HF model do it.

Cos/sin are *full width* (``rd`` values per position, HF style): ``cat(c, c)`` for
"half", ``repeat_interleave(c, 2)`` for "interleave"; the op computes
``x * cos + rotate(x) * sin`` on the rotated part. Cos/sin given as inputs:

* without ``position_ids``: per-token values ``[S, rd]`` or ``[B|1, S, rd]``;
* with ``position_ids``: a table ``[P, rd]`` indexed by the ids (each id < P).

Example (the seed's usage)::

    op = Builder().build_operation("RoPE", {"head_num": 32, "size_per_head": 128,
                                            "rotary_type": "interleave"})
    q_out, = op.execute([q, position_ids])      # q: [B, S, 32*128]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ShapeError
from ..tensor import TensorDesc
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype, expect_rank,
                   expect_same_dtype, f64)
from .registry import register_op

__all__ = ["RoPEParams", "RoPE", "ROTARY_TYPES", "LAYOUTS", "rope_angles", "rope_cos_sin",
           "apply_rope_np", "check_positions"]

# accepted spelling -> canonical rotary type
ROTARY_TYPES = {
    "half": "half", "neox": "half", "rotate_half": "half", "gpt_neox": "half", "llama": "half",
    "interleave": "interleave", "interleaved": "interleave", "gptj": "interleave",
    "gpt_j": "interleave", "rotate_every_two": "interleave",
}
LAYOUTS = ("BSH", "BSND", "BNSD")
INT_DTYPES = frozenset({Dtype.INT32, Dtype.INT64})


@dataclass(frozen=True)
class RoPEParams(Params):
    """``head_dim`` (size_per_head), ``num_heads`` (head_num), ``num_kv_heads``
    (kv_head_num), ``rotary_dim`` (None = head_dim), ``base`` (rotary_base),
    ``rotary_type`` ("half"/"neox"/"rotate_half" or "interleave"/"gptj"/"interleaved"),
    ``layout`` (None = BSH for 3-D, BSND for 4-D inputs), ``max_seq_len`` (initial
    size of the cached tables; they grow past it), ``position_offset``, ``dtype``."""

    ALIASES = {"rotary_dims": "rotary_dim", "rotary_ndims": "rotary_dim", "theta": "base",
               "rope_theta": "base", "input_layout": "layout", "offset": "position_offset"}
    head_dim: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    rotary_dim: int | None = None
    base: float = 10000.0
    rotary_type: str = "half"
    layout: str | None = None
    max_seq_len: int = 8192
    position_offset: int = 0
    dtype: Dtype | None = None

    def validate(self) -> None:
        rt = ROTARY_TYPES.get(str(self.rotary_type).lower())
        if rt is None:
            self.fail("rotary_type", f"one of {sorted(ROTARY_TYPES)}", repr(self.rotary_type))
        object.__setattr__(self, "rotary_type", rt)
        if self.layout is not None:
            lay = str(self.layout).upper()
            if lay not in LAYOUTS:
                self.fail("layout", f"one of {list(LAYOUTS)}", repr(self.layout))
            object.__setattr__(self, "layout", lay)
        for name in ("head_dim", "num_heads", "num_kv_heads", "rotary_dim"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool)
                                  or v <= 0):
                self.fail(name, "a positive int or None", repr(v))
        if self.rotary_dim is not None and self.rotary_dim % 2:
            self.fail("rotary_dim", "an even number", self.rotary_dim)
        if self.head_dim is not None and self.head_dim % 2 and self.rotary_dim is None:
            self.fail("head_dim (rotary_dim defaults to it)", "an even number", self.head_dim)
        if self.head_dim is not None and self.rotary_dim is not None and self.rotary_dim > self.head_dim:
            self.fail("rotary_dim", f"<= head_dim {self.head_dim}", self.rotary_dim)
        if self.num_heads and self.num_kv_heads and self.num_heads % self.num_kv_heads:
            self.fail("num_kv_heads", f"a divisor of num_heads {self.num_heads}", self.num_kv_heads)
        if not (isinstance(self.base, (int, float)) and self.base > 1.0):
            self.fail("base", "a number > 1", repr(self.base))
        for name, low in (("max_seq_len", 1), ("position_offset", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                self.fail(name, f"an int >= {low}", repr(v))


# ----------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class RopeGeometry:
    """What shape inference resolved: layout, head_dim, heads of q and k, rotary dim."""

    layout: str
    batch: int
    seq: int
    head_dim: int
    q_heads: int
    k_heads: int | None
    rotary_dim: int


def _layout(op: str, p: RoPEParams, q: TensorDesc) -> str:
    expect_rank(op, "q", q, (3, 4))
    lay = p.layout or ("BSH" if q.rank == 3 else "BSND")
    want = 3 if lay == "BSH" else 4
    if q.rank != want:
        raise ShapeError(op, f"input 'q' rank for layout {lay}", f"rank {want}", f"shape {list(q.shape)}")
    return lay


def _heads(op: str, name: str, d: TensorDesc, lay: str, head_dim: int | None,
           want_heads: int | None) -> tuple[int, int]:
    """(heads, head_dim) of one input; checks them against the params."""
    if lay == "BSH":
        hidden = d.shape[2]
        if head_dim is None:
            if not want_heads:
                raise ShapeError(op, f"input {name!r}: BSH layout needs head_dim or num_heads",
                                 "head_dim (size_per_head) or num_heads (head_num) in params",
                                 f"shape {list(d.shape)} and neither")
            if hidden % want_heads:
                raise ShapeError(op, f"input {name!r} hidden size divisible by num_heads "
                                 f"{want_heads}", f"a multiple of {want_heads}",
                                 f"{hidden} (shape {list(d.shape)})")
            head_dim = hidden // want_heads
        if hidden % head_dim:
            raise ShapeError(op, f"input {name!r} hidden size divisible by head_dim {head_dim}",
                             f"a multiple of {head_dim}", f"{hidden} (shape {list(d.shape)})")
        heads = hidden // head_dim
    else:
        hd_axis, h_axis = 3, (2 if lay == "BSND" else 1)
        heads = d.shape[h_axis]
        if head_dim is not None and d.shape[hd_axis] != head_dim:
            raise ShapeError(op, f"input {name!r} head_dim (last dim, layout {lay})", head_dim,
                             f"{d.shape[hd_axis]} (shape {list(d.shape)})")
        head_dim = d.shape[hd_axis]
    if want_heads is not None and heads != want_heads:
        raise ShapeError(op, f"input {name!r} number of heads (layout {lay}, head_dim {head_dim})",
                         want_heads, f"{heads} (shape {list(d.shape)})")
    return heads, head_dim


def _bs(lay: str, d: TensorDesc) -> tuple[int, int]:
    return (d.shape[0], d.shape[2]) if lay == "BNSD" else (d.shape[0], d.shape[1])


def rope_geometry(op: str, p: RoPEParams, ins: Mapping[str, TensorDesc | None]) -> RopeGeometry:
    """Validate the inputs of a RoPE call; raises AtbError subclasses."""
    q, k = ins["q"], ins.get("k")
    assert q is not None
    expect_dtype(op, "q", q, FLOAT_DTYPES)
    expect_param_dtype(op, p, "q", q)
    lay = _layout(op, p, q)
    q_heads, hd = _heads(op, "q", q, lay, p.head_dim, p.num_heads)
    if p.rotary_dim is None and hd % 2:
        raise ShapeError(op, "head_dim (rotary_dim defaults to it) must be even", "an even head_dim", hd)
    rd = p.rotary_dim if p.rotary_dim is not None else hd
    if rd > hd:
        raise ShapeError(op, "rotary_dim <= head_dim", f"<= {hd}", rd)
    b, s = _bs(lay, q)
    k_heads = None
    if k is not None:
        expect_dtype(op, "k", k, FLOAT_DTYPES)
        expect_same_dtype(op, "q", q, "k", k)
        if k.rank != q.rank:
            raise ShapeError(op, f"input 'k' rank (same layout {lay} as q)", f"rank {q.rank}",
                             f"shape {list(k.shape)}")
        k_heads, _ = _heads(op, "k", k, lay, hd, p.num_kv_heads)
        if _bs(lay, k) != (b, s):
            raise ShapeError(op, f"input 'k' batch and seq (layout {lay})", [b, s],
                             f"{list(_bs(lay, k))} (shape {list(k.shape)})")
        if q_heads % k_heads:
            raise ShapeError(op, "kv heads must divide q heads", f"a divisor of {q_heads}",
                             f"{k_heads} kv heads (k shape {list(k.shape)})")
    pos = ins.get("position_ids")
    if pos is not None:
        expect_dtype(op, "position_ids", pos, INT_DTYPES)
        if pos.rank == 1:
            if pos.shape[0] != s:
                raise ShapeError(op, "input 'position_ids' shape", f"[{s}] or [{b}, {s}]",
                                 list(pos.shape))
        elif pos.rank == 2:
            if pos.shape[1] != s or pos.shape[0] not in (1, b):
                raise ShapeError(op, "input 'position_ids' shape", f"[{s}] or [{b}, {s}]",
                                 list(pos.shape))
        else:
            raise ShapeError(op, "input 'position_ids' rank", f"rank 1 [{s}] or 2 [{b}, {s}]",
                             f"shape {list(pos.shape)}")
    _check_cos_sin(op, ins, b, s, rd, pos is not None)
    return RopeGeometry(lay, b, s, hd, q_heads, k_heads, rd)


def _check_cos_sin(op: str, ins: Mapping[str, TensorDesc | None], b: int, s: int, rd: int,
                   have_pos: bool) -> None:
    cos, sin = ins.get("cos"), ins.get("sin")
    if (cos is None) != (sin is None):
        raise InputError(op, "cos and sin must be given together", "both or neither",
                         "only " + ("cos" if sin is None else "sin"))
    if cos is None:
        return
    assert sin is not None
    for name, d in (("cos", cos), ("sin", sin)):
        expect_dtype(op, name, d, FLOAT_DTYPES)
        if d.shape[-1:] != (rd,):
            raise ShapeError(op, f"input {name!r} last dim (rotary_dim, full width)", rd,
                             f"shape {list(d.shape)}")
        if have_pos:
            if d.rank != 2:
                raise ShapeError(op, f"input {name!r} with position_ids is a table [P, rotary_dim]",
                                 f"rank 2 [P, {rd}]", f"shape {list(d.shape)}")
        elif d.rank == 2:
            if d.shape[0] != s:
                raise ShapeError(op, f"input {name!r} shape (per token, no position_ids)",
                                 f"[{s}, {rd}] or [{b}, {s}, {rd}]", list(d.shape))
        elif d.rank == 3:
            if d.shape[1] != s or d.shape[0] not in (1, b):
                raise ShapeError(op, f"input {name!r} shape (per token)",
                                 f"[{s}, {rd}] or [{b}, {s}, {rd}]", list(d.shape))
        else:
            raise ShapeError(op, f"input {name!r} rank", "rank 2 or 3", f"shape {list(d.shape)}")
    if cos.shape != sin.shape:
        raise ShapeError(op, "input 'sin' shape must equal 'cos'", list(cos.shape), list(sin.shape))


# ----------------------------------------------------------------------------- math (NumPy)


def rope_angles(positions: np.ndarray, rotary_dim: int, base: float) -> np.ndarray:
    """Angles ``pos * base**(-2i/rd)`` in float64, shape ``positions.shape + [rd/2]``."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    return np.asarray(positions, dtype=np.float64)[..., None] * inv_freq


def rope_cos_sin(angles: np.ndarray, rotary_type: str) -> tuple[np.ndarray, np.ndarray]:
    """Full-width cos/sin from half-width angles (cat for "half", interleave otherwise)."""
    if rotary_type == "half":
        full = np.concatenate([angles, angles], axis=-1)
    else:
        full = np.repeat(angles, 2, axis=-1)
    return np.cos(full), np.sin(full)


def _rotate_np(x: np.ndarray, rotary_type: str) -> np.ndarray:
    if rotary_type == "half":
        h = x.shape[-1] // 2
        return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    out = np.empty_like(x)
    out[..., 0::2] = -x[..., 1::2]
    out[..., 1::2] = x[..., 0::2]
    return out


def apply_rope_np(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_type: str) -> np.ndarray:
    """``x`` [..., D] float64; cos/sin [..., rd] broadcastable; rotates the first rd dims."""
    rd = cos.shape[-1]
    out = x.copy()
    xr = x[..., :rd]
    out[..., :rd] = xr * cos + _rotate_np(xr, rotary_type) * sin
    return out


def _to_heads(x: np.ndarray, g: RopeGeometry, heads: int) -> np.ndarray:
    # BSH [B, S, H*D] -> [B, S, H, D]; BSND as is; BNSD as is
    return x.reshape(g.batch, g.seq, heads, g.head_dim) if g.layout == "BSH" else x


def _token_cos_sin(p: RoPEParams, g: RopeGeometry, ins: Mapping[str, Any]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin per token, float64, [B|1, S, rd]."""
    pos, cos, sin = ins.get("position_ids"), ins.get("cos"), ins.get("sin")
    if cos is not None:
        cos, sin = f64(cos), f64(sin)
        if pos is not None:  # table lookup
            ids = np.asarray(pos).astype(np.int64)
            ids = ids[None] if ids.ndim == 1 else ids
            return cos[ids], sin[ids]
        return (cos[None], sin[None]) if cos.ndim == 2 else (cos, sin)
    if pos is None:
        positions = np.arange(g.seq, dtype=np.int64)[None] + int(p.position_offset)
    else:
        positions = np.asarray(pos).astype(np.int64)
        positions = positions[None] if positions.ndim == 1 else positions
    return rope_cos_sin(rope_angles(positions, g.rotary_dim, p.base), p.rotary_type)


# ----------------------------------------------------------------------------- the op


@register_op
class RoPE(OpDef):
    name = "RoPE"
    aliases = ("RotaryEmbedding", "RopeOperation", "RotaryPositionEmbedding")
    Params = RoPEParams
    inputs = ("q", "k?", "position_ids?", "cos?", "sin?")
    outputs = ("q_out", "k_out")

    def num_outputs(self, p, ins):
        return 2 if ins.get("k") is not None else 1

    def bind(self, p: Params, items: Sequence[Any]) -> dict[str, Any]:
        """q first; then by kind: an integer tensor is position_ids; of the other float
        tensors, three are (k, cos, sin), two are (cos, sin), one is k. ``None``
        placeholders switch to plain positional order (q, k, position_ids, cos, sin)."""
        if len(items) < 1 or len(items) > 5:
            raise InputError(self.name, "number of inputs", "1 to 5 (q, k?, position_ids?, cos?, sin?)",
                             len(items))
        if any(x is None for x in items[1:]):
            return super().bind(p, items)
        bound: dict[str, Any] = {n: None for n in self.input_names}
        bound["q"] = items[0]
        floats, ints = [], []
        for x in items[1:]:
            (ints if TensorDesc.of(x).dtype.is_integer else floats).append(x)
        if len(ints) > 1:
            raise InputError(self.name, "integer inputs (position_ids)", "at most 1",
                             f"{len(ints)} integer tensors")
        bound["position_ids"] = ints[0] if ints else None
        if len(floats) == 3:
            bound["k"], bound["cos"], bound["sin"] = floats
        elif len(floats) == 2:
            bound["cos"], bound["sin"] = floats
        elif len(floats) == 1:
            if TensorDesc.of(floats[0]).rank < 3:
                raise InputError(self.name, "cos and sin must be given together", "both or neither",
                                 f"one rank-{TensorDesc.of(floats[0]).rank} float tensor after q")
            bound["k"] = floats[0]
        return bound

    def infer_shape(self, p, ins):
        g = rope_geometry(self.name, p, ins)
        outs = [ins["q"]]
        if g.k_heads is not None:
            outs.append(ins["k"])
        return outs

    def check_values(self, p, ins):
        check_positions(self.name, ins.get("position_ids"), ins.get("cos"))

    def reference(self, p, ins):
        descs = {n: (None if v is None else TensorDesc(np.shape(v), Dtype.of(np.asarray(v).dtype)))
                 for n, v in ins.items()}
        g = rope_geometry(self.name, p, descs)
        cos, sin = _token_cos_sin(p, g, ins)          # [B|1, S, rd]
        if g.layout == "BNSD":                       # -> [B|1, 1, S, rd]
            cos, sin = cos[:, None], sin[:, None]
        else:                                        # -> [B|1, S, 1, rd]
            cos, sin = cos[:, :, None], sin[:, :, None]
        outs = []
        for name, heads in (("q", g.q_heads), ("k", g.k_heads)):
            x = ins.get(name)
            if x is None:
                continue
            xh = _to_heads(f64(x), g, heads)
            y = apply_rope_np(xh, cos, sin, p.rotary_type).reshape(np.shape(x))
            outs.append(y.astype(np.asarray(x).dtype))
        return outs


def check_positions(op: str, pos: Any, cos: Any) -> None:
    """``position_ids`` (NumPy or torch) are >= 0 and, with a cos/sin table, index
    into it; errors name ``op`` (RoPE, or the fused op that rotates)."""
    if pos is None or _numel(pos) == 0:
        return
    lo, hi = int(pos.min()), int(pos.max())
    if lo < 0:
        raise InputError(op, "position_ids values", ">= 0", f"min {lo}")
    if cos is not None and hi >= cos.shape[0]:
        raise InputError(op, "position_ids values (index into the cos/sin table)",
                         f"< {cos.shape[0]}", f"max {hi}")


def _numel(x: Any) -> int:
    return int(np.prod(tuple(x.shape))) if len(x.shape) else 1

