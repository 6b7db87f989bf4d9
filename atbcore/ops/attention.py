"""Scaled dot-product attention: ``FlashAttention`` (aliases SelfAttention, MhaV2,
MhaV3, SelfAttentionOperation).

    op = Builder().build_operation("MhaV3", {"head_num": 32, "kv_head_num": 8,
                                             "size_per_head": 128, "is_causal": True})
    out, = op.execute([q, k, v])       # q [B, S, 32*128], k/v [B, S, 8*128]

Semantics shared by every backend (the NumPy reference below is the oracle):

* Layouts: BSH ``[B, S, H*D]``, BNSD ``[B, H, S, D]``, BSND ``[B, S, H, D]``; a 3-D q
  defaults to BSH, a 4-D q to BNSD. The output has q's layout. A single 3-D input
  is read as packed QKV ``[B, S, (H + 2*Hkv)*D]`` (q heads, then k, then v).
* GQA/MQA: ``num_kv_heads`` divides ``num_heads``; q head h reads kv head
  ``h // (H / Hkv)``.
* Positions are bottom-right aligned: query row i of a batch entry whose kv length
  is L (``seq_lens[b]``, else Skv) sits at position ``max(L - Sq, 0) + i`` -- decode
  and chunked prefill (Sq < L) see the end of the keys, while a right-padded prefill
  (Sq = padded length >= L) keeps row i at position i. Key j is visible
  when ``j < L``, and with ``causal`` when ``j <= pos``, and with ``window`` when
  ``pos - window < j`` (a window implies causal, as in Mistral).
* ``mask``: additive float, or bool with True = attend (as torch SDPA), broadcastable
  to ``[B, H, Sq, Skv]``; it is combined with the rules above.
* A query row that sees no key at all returns zeros (as flash kernels do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import DtypeError, InputError, ShapeError
from ..tensor import TensorDesc
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype, expect_rank,
                   expect_same_dtype, f64)
from .registry import register_op

__all__ = ["FlashAttentionParams", "AttnDims", "attention_dims", "ref_attention", "effective_window",
           "visible_keys", "validate_head_params", "check_seq_lens", "host_ints", "split_packed",
           "INT_DTYPES", "LAYOUTS"]

LAYOUTS = ("BSH", "BNSD", "BSND")
INT_DTYPES = frozenset({Dtype.INT32, Dtype.INT64})
# Query rows per step of the reference: bounds its [H, rows, Skv] score block.
REF_CHUNK = 256


def validate_head_params(p: Params) -> None:
    """Shared checks of attention params: positive head counts, head_dim and
    window; kv heads dividing heads; a finite non-zero scale; a bool causal."""
    for name in ("num_heads", "num_kv_heads", "head_dim", "window"):
        v = getattr(p, name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
            p.fail(name, "a positive int or None", repr(v))
        object.__setattr__(p, name, int(v))
    if p.num_heads and p.num_kv_heads and p.num_heads % p.num_kv_heads:
        p.fail("num_kv_heads must divide num_heads", f"a divisor of {p.num_heads}",
               p.num_kv_heads)
    if p.scale is not None:
        try:
            s = float(p.scale)
        except (TypeError, ValueError):
            s = float("nan")
        if not np.isfinite(s) or s == 0:
            p.fail("scale", "a finite non-zero float or None", repr(p.scale))
        object.__setattr__(p, "scale", s)
    if not isinstance(p.causal, (bool, np.bool_)):
        p.fail("causal", "a bool", repr(p.causal))
    object.__setattr__(p, "causal", bool(p.causal))


def effective_window(window: int | None, q_len: int, kv_len: int) -> int | None:
    """``window``, or None when it reaches past every key a causal row can see
    (``window >= q_len + kv_len``): such a window is plain causal attention, and
    kernels that hold positions in int32 never see a window they would wrap."""
    if window is None or window >= q_len + kv_len:
        return None
    return window


@dataclass(frozen=True)
class FlashAttentionParams(Params):
    """``num_heads`` (head_num), ``num_kv_heads`` (kv_head_num; None = inferred from
    k, equal to num_heads for MHA), ``head_dim`` (size_per_head; None = inferred),
    ``scale`` (None = 1/sqrt(head_dim)), ``causal`` (is_causal), ``window``
    (sliding window, implies causal), ``layout`` ("BSH" | "BNSD" | "BSND"; None =
    by rank), optional ``dtype`` the inputs must have."""

    ALIASES = {"sliding_window": "window", "window_size": "window", "input_layout": "layout",
               "qk_scale": "scale"}
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    scale: float | None = None
    causal: bool = False
    window: int | None = None
    layout: str | None = None
    dtype: Dtype | None = None

    def validate(self) -> None:
        validate_head_params(self)
        if self.layout is not None:
            lay = str(self.layout).upper()
            if lay not in LAYOUTS:
                self.fail("layout", " | ".join(LAYOUTS), repr(self.layout))
            object.__setattr__(self, "layout", lay)


@dataclass(frozen=True)
class AttnDims:
    """The resolved geometry of one attention call."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    layout: str
    packed: bool = False

    @property
    def scale_default(self) -> float:
        return 1.0 / float(np.sqrt(self.head_dim))


def host_ints(x: Any) -> np.ndarray:
    """Integer values of a small index tensor (NumPy or torch, any device) on the host."""
    if hasattr(x, "detach"):  # torch: no import needed to move it
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(np.int64)


def _heads_of(op: str, what: str, hidden: int, heads: int | None, head_dim: int | None,
              name: str) -> tuple[int, int]:
    """(heads, head_dim) of a BSH hidden size; validates divisibility."""
    if heads is None and head_dim is None:
        raise ShapeError(op, f"{what} heads of a BSH input", "num_heads or head_dim in params",
                         "neither")
    if heads is None:
        if hidden % head_dim:
            raise ShapeError(op, f"head_dim must divide input {name!r} hidden size",
                             f"a multiple of {head_dim}", hidden)
        return hidden // head_dim, head_dim
    if hidden % heads:
        raise ShapeError(op, f"{what} heads must divide input {name!r} hidden size",
                         f"a multiple of {heads}", hidden)
    return heads, hidden // heads


def attention_dims(op: str, p: FlashAttentionParams,
                   ins: Mapping[str, TensorDesc | None]) -> AttnDims:
    """Validate a FlashAttention call and resolve its geometry."""
    q, k, v = ins["q"], ins.get("k"), ins.get("v")
    assert q is not None
    expect_dtype(op, "q", q, FLOAT_DTYPES)
    expect_param_dtype(op, p, "q", q)
    expect_rank(op, "q", q, (3, 4))
    layout = p.layout or ("BSH" if q.rank == 3 else "BNSD")
    expect_rank(op, "q", q, 3 if layout == "BSH" else 4)
    if k is None or v is None:
        return _packed_dims(op, p, q, layout)
    for name, d in (("k", k), ("v", v)):
        expect_same_dtype(op, "q", q, name, d)
        expect_rank(op, name, d, q.rank)
    if tuple(v.shape) != tuple(k.shape):
        raise ShapeError(op, "input 'v' shape must equal 'k'", list(k.shape), list(v.shape))
    if k.shape[0] != q.shape[0]:
        raise ShapeError(op, "input 'k' batch must equal q's", q.shape[0], k.shape[0])
    if layout == "BSH":
        b, sq, hid = q.shape
        h, d = _heads_of(op, "num_heads", hid, p.num_heads, p.head_dim, "q")
        skv, kvhid = k.shape[1], k.shape[2]
        if kvhid % d:
            raise ShapeError(op, "input 'k' hidden size must be a multiple of head_dim",
                             f"a multiple of {d}", kvhid)
        hkv = kvhid // d
    else:
        if layout == "BNSD":
            b, h, sq, d = q.shape
            _, hkv, skv, dk = k.shape
        else:
            b, sq, h, d = q.shape
            _, skv, hkv, dk = k.shape
        if dk != d:
            raise ShapeError(op, "input 'k' head_dim must equal q's", d, dk)
        if p.num_heads is not None and p.num_heads != h:
            raise ShapeError(op, f"input 'q' heads ({layout})", p.num_heads, h)
    if p.head_dim is not None and p.head_dim != d:
        raise ShapeError(op, "head_dim of the inputs (params head_dim)", p.head_dim, d)
    if p.num_kv_heads is not None and p.num_kv_heads != hkv:
        raise ShapeError(op, f"input 'k' kv heads ({layout})", p.num_kv_heads, hkv)
    if h % hkv:
        raise ShapeError(op, "kv heads must divide heads", f"a divisor of {h}", hkv)
    dims = AttnDims(b, h, hkv, sq, skv, d, layout)
    _check_extras(op, ins, dims)
    return dims


def _packed_dims(op: str, p: FlashAttentionParams, q: TensorDesc, layout: str) -> AttnDims:
    if layout != "BSH":
        raise InputError(op, "inputs 'k' and 'v' are missing (packed QKV needs a 3-D BSH input)",
                         "q, k, v", f"one {layout} tensor")
    if p.num_heads is None:
        raise ShapeError(op, "packed QKV input needs num_heads", "num_heads in params", None)
    h = p.num_heads
    hkv = p.num_kv_heads or h
    b, s, hid = q.shape
    if hid % (h + 2 * hkv):
        raise ShapeError(op, "packed QKV hidden size", f"a multiple of {h + 2 * hkv} "
                         f"((num_heads + 2*num_kv_heads) * head_dim)", hid)
    d = hid // (h + 2 * hkv)
    if p.head_dim is not None and p.head_dim != d:
        raise ShapeError(op, "packed QKV head_dim (params head_dim)", p.head_dim, d)
    return AttnDims(b, h, hkv, s, s, d, layout, packed=True)


def _check_extras(op: str, ins: Mapping[str, TensorDesc | None], dims: AttnDims) -> None:
    mask, lens = ins.get("mask"), ins.get("seq_lens")
    if mask is not None:
        if not (mask.dtype in FLOAT_DTYPES or mask.dtype == Dtype.BOOL):
            raise DtypeError(op, "input 'mask' dtype", "FP32/FP16/BF16 or BOOL", mask.dtype.name)
        full = (dims.batch, dims.heads, dims.q_len, dims.kv_len)
        ok = 2 <= mask.rank <= 4 and all(
            m in (1, f) for m, f in zip(mask.shape[::-1], full[::-1]))
        if not ok:
            raise ShapeError(op, "input 'mask' shape (broadcastable to [B, H, Sq, Skv])",
                             f"[{dims.q_len}, {dims.kv_len}] or [{dims.batch}|1, {dims.heads}|1, "
                             f"{dims.q_len}, {dims.kv_len}]", list(mask.shape))
    if lens is not None:
        if lens.dtype not in INT_DTYPES:
            raise DtypeError(op, "input 'seq_lens' dtype", "INT32/INT64", lens.dtype.name)
        if tuple(lens.shape) != (dims.batch,):
            raise ShapeError(op, "input 'seq_lens' shape", [dims.batch], list(lens.shape))


# ----------------------------------------------------------------------------- reference


def visible_keys(pos: np.ndarray, keys: np.ndarray, kv_len: int, causal: bool,
                 window: int | None) -> np.ndarray:
    """Bool [rows, keys]: which keys each query row (at absolute ``pos``) may see."""
    allow = keys[None, :] < kv_len
    if causal or window is not None:
        allow = allow & (keys[None, :] <= pos[:, None])
    if window is not None:
        allow = allow & (keys[None, :] > pos[:, None] - window)
    return allow


def ref_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float, causal: bool,
                  window: int | None = None, mask: np.ndarray | None = None,
                  kv_lens: Sequence[int] | None = None, chunk: int = REF_CHUNK) -> np.ndarray:
    """Plain float64 attention on q ``[B, H, Sq, D]``, k/v ``[B, Hkv, Skv, D]``, a few
    query rows at a time so long sequences stay small in memory. Returns float64."""
    q, k, v = f64(q), f64(k), f64(v)
    b_, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = h // hkv
    m4 = None
    if mask is not None:
        m4 = np.asarray(mask)
        m4 = m4.reshape((1,) * (4 - m4.ndim) + m4.shape)
        m4 = m4 if m4.dtype == np.bool_ else f64(m4)
    out = np.zeros((b_, h, sq, d))
    keys = np.arange(skv)
    for b in range(b_):
        kv_len = skv if kv_lens is None else int(kv_lens[b])
        qb = q[b].reshape(hkv, g, sq, d)  # q head h = kv head h // g
        for r0 in range(0, sq, chunk):
            r1 = min(sq, r0 + chunk)
            # [Hkv, G, c, D] @ [Hkv, 1, D, Skv] -> [Hkv, G, c, Skv]
            s = (qb[:, :, r0:r1] @ k[b].swapaxes(-1, -2)[:, None]) * scale
            allow = visible_keys(max(kv_len - sq, 0) + np.arange(r0, r1), keys, kv_len, causal, window)
            allow = np.broadcast_to(allow, s.shape)
            if m4 is not None:
                mc = m4[min(b, m4.shape[0] - 1)]
                mc = mc[:, r0:r1] if mc.shape[1] != 1 else mc
                mc = np.broadcast_to(mc, (h, r1 - r0, skv)).reshape(hkv, g, r1 - r0, skv)
                if mc.dtype == np.bool_:
                    allow = allow & mc
                else:
                    s = s + mc
                    allow = allow & (mc > -np.inf)  # an additive -inf hides the key too
            s = np.where(allow, s, -np.inf)
            # a row that sees no key gives zeros; any other row follows the
            # arithmetic, so NaN/Inf in q, k or v propagate as in torch (a NaN or
            # data-made -inf max makes the row NaN, as torch's softmax does)
            seen = allow.any(axis=-1, keepdims=True)
            mx = np.where(seen, s.max(axis=-1, keepdims=True), 0.0)
            with np.errstate(invalid="ignore", over="ignore"):
                e = np.where(allow, np.exp(s - mx), 0.0)
                o = (e @ v[b][:, None]) / np.where(seen, e.sum(-1, keepdims=True), 1)
            out[b, :, r0:r1] = np.where(seen, o, 0.0).reshape(h, r1 - r0, d)  # [Hkv, G, c, D]
    return out


def check_seq_lens(op: str, p: FlashAttentionParams, ins: Mapping[str, Any]) -> None:
    """Every ``seq_lens`` value in ``1..Skv``; errors name ``op`` (FlashAttention, or
    the fused op around it)."""
    lens = ins.get("seq_lens")
    if lens is None:
        return
    dims = attention_dims(op, p, {n: None if x is None else TensorDesc.of(x)
                                  for n, x in ins.items()})
    vals = host_ints(lens)
    bad = (vals < 1) | (vals > dims.kv_len)
    if bad.any():
        raise InputError(op, "input 'seq_lens' values", f"in 1..{dims.kv_len}", vals.tolist())


def _np_to_bnsd(x: np.ndarray, layout: str, heads: int) -> np.ndarray:
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, hid = x.shape
        x = x.reshape(b, s, heads, hid // heads)
    return x.transpose(0, 2, 1, 3)  # [B, S, N, D] -> [B, N, S, D]


def _np_from_bnsd(o: np.ndarray, layout: str) -> np.ndarray:
    if layout == "BNSD":
        return o
    o = o.transpose(0, 2, 1, 3)  # [B, N, S, D] -> [B, S, N, D]
    return o.reshape(o.shape[0], o.shape[1], -1) if layout == "BSH" else o


def split_packed(qkv: Any, dims: AttnDims) -> tuple[Any, Any, Any]:
    """Views q, k, v of a packed ``[B, S, (H + 2*Hkv)*D]`` input (NumPy or torch)."""
    hq, hk = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    return qkv[..., :hq], qkv[..., hq:hq + hk], qkv[..., hq + hk:]


@register_op
class FlashAttention(OpDef):
    """Memory-efficient attention with GQA, causal / sliding-window / given masks and
    per-batch kv lengths; see the module docstring for the exact semantics."""

    name = "FlashAttention"
    aliases = ("SelfAttention", "MhaV2", "MhaV3", "SelfAttentionOperation", "Mha",
               "FlashAttentionOperation")
    Params = FlashAttentionParams
    inputs = ("q", "k?", "v?", "mask?", "seq_lens?")
    outputs = ("out",)

    def bind(self, p, items):
        """q, k, v positionally; then mask and seq_lens (a 1-D integer tensor) in any
        order, told apart by dtype and rank. One input alone is packed QKV."""
        items = list(items)
        if not 1 <= len(items) <= 5:
            raise InputError(self.name, "number of inputs", "1 (packed qkv) or 3 to 5 "
                             "(q, k, v, mask?, seq_lens?)", len(items))
        bound: dict[str, Any] = {n: None for n in self.input_names}
        bound["q"] = items[0]
        if len(items) == 2 or (len(items) > 2 and (items[1] is None) != (items[2] is None)):
            raise InputError(self.name, "input 'k' or 'v' is missing", "q, k, v (or packed qkv)",
                             f"{len(items)} inputs")
        if len(items) > 2:
            bound["k"], bound["v"] = items[1], items[2]
        for x in items[3:]:
            if x is None:
                continue
            d = TensorDesc.of(x)
            slot = "seq_lens" if d.dtype.is_integer and d.rank == 1 else "mask"
            if bound[slot] is not None:
                raise InputError(self.name, f"input {slot!r} given twice", "at most one",
                                 "two")
            bound[slot] = x
        return bound

    def infer_shape(self, p, ins):
        dims = attention_dims(self.name, p, ins)
        q = ins["q"]
        if dims.packed:
            return [TensorDesc((dims.batch, dims.q_len, dims.heads * dims.head_dim), q.dtype)]
        return [TensorDesc(q.shape, q.dtype)]

    def check_values(self, p, ins):
        check_seq_lens(self.name, p, ins)

    def reference(self, p, ins):
        q, k, v = ins["q"], ins["k"], ins["v"]
        dims = attention_dims(self.name, p, {n: None if x is None else TensorDesc.of(x)
                                             for n, x in ins.items()})
        if dims.packed:
            q, k, v = split_packed(q, dims)
        lens = ins.get("seq_lens")
        o = ref_attention(_np_to_bnsd(q, dims.layout, dims.heads),
                          _np_to_bnsd(k, dims.layout, dims.kv_heads),
                          _np_to_bnsd(v, dims.layout, dims.kv_heads),
                          scale=p.scale if p.scale is not None else dims.scale_default,
                          causal=p.causal, window=p.window, mask=ins.get("mask"),
                          kv_lens=None if lens is None else host_ints(lens))
        return [_np_from_bnsd(o, dims.layout).astype(ins["q"].dtype)]
