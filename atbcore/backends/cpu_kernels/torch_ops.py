"""The C kernels on torch CPU tensors: one C call (one launch) per function.

Each function reads the tensors' addresses and strides, packs the argument
block, calls the kernel and returns torch tensors. Outputs are written into
the given ``out`` tensors when those have the input's dtype and rows of unit
stride (planned arena buffers do), else into fresh ones. Inputs whose rows
cannot be addressed with one row stride are made contiguous first (one copy);
:func:`why_not` tells a caller when the C path cannot run at all (no library,
not the CPU, a dtype other than fp32/bf16/fp16) so it runs its torch
composite instead.

Imported only by the torch backend (it imports torch).
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import torch

from atbcore.errors import DtypeError, ShapeError

from .bindings import entry, unavailable_reason

__all__ = ["why_not", "rms_norm", "layer_norm", "rope", "activation", "softmax", "DTYPE_CODES",
           "ACT_CODES", "MAX_ROTARY_DIM", "c_launches", "log_fallback", "into", "out_at",
           "linear_rows", "LINEAR_WEIGHT_DTYPES", "parked_torch_threads", "decode_attention",
           "decode_attention_bound", "rope_cache_bound", "paged_decode_attention"]

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BOOL = 3
ACT_CODES = {"silu": 0, "swish": 0, "gelu": 1, "gelu_tanh": 2, "quick_gelu": 3, "relu": 4,
             "none": 5}
MAX_ROTARY_DIM = 1024  # ATB_ROPE_MAX_RD in rope.c
_SM_DIMS = 8           # ATB_SM_DIMS in softmax.c

_NORM = struct.Struct("<16q2d")
_ROPE = struct.Struct("<44q")
_ACT = struct.Struct("<14q")
_SOFTMAX = struct.Struct(f"<13q{2 * _SM_DIMS}qqd")
_LINEAR = struct.Struct("<20q2d")
_ATTN = struct.Struct("<32qd2q")
# weight dtypes of the few-row matmul (int8 takes a per-output-channel fp32 scale)
LINEAR_WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 4}

_calls: dict[str, Any] = {}
# The C pool's thread count while torch's own intra-op pool is parked at one thread
# (see parked_torch_threads); 0 = follow torch.get_num_threads().
_POOL_THREADS = [0]


def _fn(name: str) -> Any:
    f = _calls.get(name)
    if f is None:
        f = _calls[name] = entry(name)
    return f


def why_not(*tensors: Any) -> str | None:
    """Why the C kernels cannot take these tensors (None = they can)."""
    why = unavailable_reason()
    if why:
        return why
    for t in tensors:
        if t is None:
            continue
        if not t.is_cpu:
            return f"C kernels run on the CPU; tensor on {t.device}"
        if t.dtype not in DTYPE_CODES:
            return f"C kernels take fp32/bf16/fp16; given {str(t.dtype)[6:]}"
    return None


# The per-call Python work below is kept to attribute reads (~0.1 us each): a
# contiguous tensor is passed as is (rows n apart), only strided ones are viewed.
def _rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int]:
    """``(t2, rows, row stride)``: ``t`` as rows of ``n`` unit-stride elements (a view
    when possible, else a contiguous copy the caller keeps alive for the call)."""
    if t.is_contiguous():
        return t, (t.numel() // n if n else 0), n
    try:
        t2 = t.view(-1, n)
    except RuntimeError:
        t2 = t.reshape(-1, n)
    if t2.shape[0] > 0 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2, t2.shape[0], t2.stride(0)


def _out(out: torch.Tensor | None, like: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """``(y, row stride)``: ``out`` when it can take rows shaped like ``like``, else a new tensor."""
    if out is not None and out.dtype == like.dtype and out.shape == like.shape:
        if out.is_contiguous():
            return out, n
        try:
            o2 = out.view(-1, n)
            if o2.shape[0] == 0 or o2.stride(1) == 1:
                return out, o2.stride(0)
        except RuntimeError:
            pass
    if like.is_contiguous():
        return torch.empty_like(like), n
    return torch.empty(like.shape, dtype=like.dtype), n


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"C kernel {what} failed with status {status} (bad arguments)")


def _deliver(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    # an unusable out buffer (strided, other dtype) still receives the result
    if out is not None and out is not y:
        out.copy_(y)
        return out
    return y


def _vec(t: torch.Tensor | None) -> tuple[int, int, torch.Tensor | None]:
    """(address, dtype code, tensor kept alive) of a weight/bias vector."""
    if t is None:
        return 0, 0, None
    if not t.is_contiguous():
        t = t.contiguous()
    return t.data_ptr(), DTYPE_CODES[t.dtype], t


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, n: int, eps: float, w_offset: float = 0.0,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             sum_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RmsNorm over the last ``n`` elements (AddRmsNorm with ``residual``): ``(y, sum)``."""
    return _norm("rms_norm", x, w, None, n, eps, w_offset, residual, out, sum_out)


def layer_norm(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, n: int,
               eps: float, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
               sum_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LayerNorm over the last ``n`` elements (AddLayerNorm with ``residual``): ``(y, sum)``."""
    return _norm("layer_norm", x, w, b, n, eps, 0.0, residual, out, sum_out)


def _norm(name, x, w, b, n, eps, w_offset, residual, out, sum_out):
    x2, rows, xs = _rows(x, n)
    y, ys = _out(out, x, n)
    r2, rs, s, ss = None, 0, None, 0
    if residual is not None:
        r2, _, rs = _rows(residual, n)
        s, ss = _out(sum_out, x, n)
    wp, wdt, wk = _vec(w)
    bp, bdt, bk = _vec(b)
    args = _NORM.pack(
        x2.data_ptr(), 0 if r2 is None else r2.data_ptr(), 0 if s is None else s.data_ptr(),
        y.data_ptr(), wp, bp, DTYPE_CODES[x.dtype], wdt, bdt, rows, n, xs, rs, ss, ys,
        _POOL_THREADS[0] or torch.get_num_threads(), eps, w_offset)
    _check(_fn(name)(args), name)
    del wk, bk
    return _deliver(out, y), (None if s is None else _deliver(sum_out, s))


def _bshd(t: torch.Tensor, layout: str, head_dim: int) -> tuple[int, int, int]:
    """Element strides of (batch, seq, head) for a q/k/v tensor in ``layout`` (D unit stride)."""
    st = t.stride()
    if layout == "BSH":
        return st[0], st[1], head_dim * st[2]
    if layout == "BNSD":
        return st[0], st[2], st[1]
    return st[0], st[1], st[2]


def _unit_last(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.numel() == 0 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _rope_fields(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
                 layout: str, head_dim: int, rotary_dim: int, q_heads: int, k_heads: int,
                 interleave: bool, batch: int, seq: int, table_len: int,
                 pos: torch.Tensor | None = None, tab_offset: int = 0,
                 q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
                 v: torch.Tensor | None = None, v_out: torch.Tensor | None = None,
                 cache_len: int = 0) -> tuple[tuple, tuple]:
    """The packed RoPE arguments but the last (cache_offset), and the tensors they
    point into (kept alive by the caller for the call)."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    cs_sb = cos.stride(0) if cos.dim() == 3 and cos.shape[0] > 1 else 0
    pos_sb = 0
    if pos is not None:
        pos = _unit_last(pos)
        pos_sb = pos.stride(0) if pos.dim() == 2 and pos.shape[0] > 1 else 0
    qo = q if q_out is None else q_out
    cache_lay = "BSND" if cache_len else layout
    z3 = (0, 0, 0)
    fields = (
        q.data_ptr(), qo.data_ptr(), 0 if k is None else k.data_ptr(),
        0 if k_out is None else k_out.data_ptr(), 0 if v is None else v.data_ptr(),
        0 if v_out is None else v_out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        0 if pos is None else pos.data_ptr(),
        DTYPE_CODES[q.dtype], DTYPE_CODES[cos.dtype], int(pos is not None and pos.dtype == torch.int32),
        int(interleave), batch, seq, head_dim, rotary_dim, q_heads, k_heads or 0,
        *_bshd(q, layout, head_dim), *_bshd(qo, layout, head_dim),
        *(z3 if k is None else _bshd(k, layout, head_dim)),
        *(z3 if k_out is None else _bshd(k_out, cache_lay, head_dim)),
        *(z3 if v is None else _bshd(v, layout, head_dim)),
        *(z3 if v_out is None else _bshd(v_out, cache_lay, head_dim)),
        cs_sb, cos.stride(-2), table_len, tab_offset, pos_sb, cache_len)
    return fields, (q, qo, k, k_out, v, v_out, cos, sin, pos)


def _rope_status(status: int, cache_len: int) -> int:
    if status == -2:
        raise ValueError("negative position id")
    if status == -3:
        raise ValueError(f"position past the cache length {cache_len}")
    if status < 0:
        _check(status, "rope")
    return status


def rope(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
         layout: str, head_dim: int, rotary_dim: int, q_heads: int, k_heads: int,
         interleave: bool, batch: int, seq: int, table_len: int, pos: torch.Tensor | None = None,
         tab_offset: int = 0, q_out: torch.Tensor | None = None,
         k_out: torch.Tensor | None = None, v: torch.Tensor | None = None,
         v_out: torch.Tensor | None = None, cache_len: int = 0, cache_offset: int = 0
         ) -> int:
    """Rotate q (and k) into ``q_out`` / ``k_out`` (which may be q / k: in place).

    ``cos``/``sin``: ``[P, rd]`` tables indexed by ``pos`` (or ``s + tab_offset``),
    or per token ``[B|1, S, rd]`` (``tab_offset`` 0, ``table_len`` S). With
    ``cache_len > 0``, ``k_out``/``v_out`` are ``[B, cache_len, Hk, D]`` caches
    and token ``(b, s)`` is written at row ``pos[b, s]`` (or ``s + cache_offset``).
    Returns 0, or the table length needed when a position is past ``table_len``
    (nothing is written then; grow the table and call again). Raises ValueError
    for a negative position or one past the cache.
    """
    fields, keep = _rope_fields(q, k, cos, sin, layout=layout, head_dim=head_dim,
                                rotary_dim=rotary_dim, q_heads=q_heads, k_heads=k_heads,
                                interleave=interleave, batch=batch, seq=seq,
                                table_len=table_len, pos=pos, tab_offset=tab_offset,
                                q_out=q_out, k_out=k_out, v=v, v_out=v_out, cache_len=cache_len)
    status = _fn("rope")(_ROPE.pack(*fields, cache_offset))
    del keep
    return _rope_status(status, cache_len)


def rope_cache_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                     head_dim: int, rotary_dim: int) -> Callable[[int], None]:
    """Bind the decode step's RoPE: ``q`` [B, Hq*D] rotated in place, ``k`` rotated and
    ``v`` copied into the caches [B, cap, Hk, D] at slot ``call(slot)``. ``cos``/``sin``
    are the step's per-row tables [B, 1, rd] (fp32). The tensors must stay alive and
    in place while the call is used (their addresses are packed once)."""
    b = q.shape[0]
    hq, hk = q.shape[-1] // head_dim, k.shape[-1] // head_dim
    q3, k3, v3 = q.view(b, 1, -1), k.view(b, 1, -1), v.view(b, 1, -1)
    cap = k_cache.shape[1]
    fields, keep = _rope_fields(q3, k3, cos, sin, layout="BSH", head_dim=head_dim,
                                rotary_dim=rotary_dim, q_heads=hq, k_heads=hk, interleave=False,
                                batch=b, seq=1, table_len=1, k_out=k_cache, v=v3,
                                v_out=v_cache, cache_len=cap)
    if keep[0] is not q3 or keep[2] is not k3 or keep[4] is not v3 or keep[6] is not cos:
        raise ShapeError("rope_cache_bound", "q/k/v/cos/sin", "unit-stride last dims",
                         "a strided tensor")
    fn, pack = _fn("rope"), _ROPE.pack

    def call(slot: int) -> None:
        _rope_status(fn(pack(*fields, slot)), cap)
        return None
    call.keep = keep  # type: ignore[attr-defined]
    return call


def activation(x: torch.Tensor, act: str, *, up: torch.Tensor | None = None,
               split: bool = False, bias: torch.Tensor | None = None,
               bias_up: torch.Tensor | None = None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``act(x + bias) [* (up + bias_up)]``; ``split``: x is ``[..., 2n]`` = gate | up."""
    if split:
        n = x.shape[-1] // 2
        x2, rows, xs = _rows(x, 2 * n)                           # [rows, 2n]
        g_ptr = x2.data_ptr()
        u_ptr, us = g_ptr + n * x.element_size(), xs
        shape = (*x.shape[:-1], n)
        y = out if (out is not None and out.dtype == x.dtype and out.shape == shape
                    and out.is_contiguous()) else torch.empty(shape, dtype=x.dtype)
        ys = n
    else:
        n = x.shape[-1]
        x2, rows, xs = _rows(x, n)
        g_ptr, u_ptr, us, u2 = x2.data_ptr(), 0, 0, None
        if up is not None:
            u2, _, us = _rows(up, n)
            u_ptr = u2.data_ptr()
        y, ys = _out(out, x, n)
    bp, bdt, bk = _vec(bias)
    bup, budt, buk = _vec(bias_up)
    args = _ACT.pack(g_ptr, u_ptr, y.data_ptr(), bp, bup, DTYPE_CODES[x.dtype], bdt or budt,
                     ACT_CODES[act], rows, n, xs, us, ys,
                     _POOL_THREADS[0] or torch.get_num_threads())
    _check(_fn("activation")(args), "activation")
    return _deliver(out, y)


_NO_LEAD = (1,) * _SM_DIMS + (0,) * _SM_DIMS


def softmax(x: torch.Tensor, *, scale: float = 1.0, mask: torch.Tensor | None = None,
            causal: bool = False, empty_rows_zero: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last axis of ``x * scale (+ mask)``, causal over the last two axes."""
    n = x.shape[-1]
    x2, rows, xs = _rows(x, n)
    y, ys = _out(out, x, n)
    if mask is None:
        nd, geom, mlast, mdt, mptr = 1, _NO_LEAD, 0, 0, 0
    else:
        lead = list(x.shape[:-1]) or [1]
        if len(lead) > _SM_DIMS:
            raise ValueError(f"softmax C kernel takes at most {_SM_DIMS} leading dims")
        me = mask.expand(x.shape)                                 # a view: broadcast strides
        mstr = list(me.stride()[:-1]) if x.dim() > 1 else [0]
        pad = _SM_DIMS - len(lead)
        nd, geom = len(lead), (*lead, *([1] * pad), *mstr, *([0] * pad))
        mlast, mptr = me.stride(-1), me.data_ptr()
        mdt = _BOOL if mask.dtype == torch.bool else DTYPE_CODES[mask.dtype]
    args = _SOFTMAX.pack(x2.data_ptr(), y.data_ptr(), mptr, DTYPE_CODES[x.dtype], mdt, rows, n,
                         xs, ys, int(causal), x.shape[-2] if causal else 0, int(empty_rows_zero),
                         nd, *geom, mlast, scale)
    _check(_fn("softmax")(args), "softmax")
    return _deliver(out, y)




class parked_torch_threads:
    """``with parked_torch_threads(): ...`` runs the block with torch's intra-op pool at
    one thread while the C kernels' pool keeps the count torch had.

    torch's OpenMP workers spin for a while after each parallel region; on a machine
    with as many cores as threads a spinning worker holds the core the C pool's worker
    needs, so a few-row matmul that follows any parallel torch op ran at one core's
    bandwidth (measured: the 32000x512 fp32 LM head 3.1 ms after an SDPA, 1.9 ms
    alone). Decode steps made of C matmuls and small torch ops run parked."""

    __slots__ = ("n",)

    def __enter__(self) -> "parked_torch_threads":
        self.n = torch.get_num_threads()
        if self.n > 1 and not _POOL_THREADS[0]:
            _POOL_THREADS[0] = self.n
            torch.set_num_threads(1)
        else:
            self.n = 0                      # nested or single-threaded: nothing to undo
        return self

    def __exit__(self, *exc: object) -> None:
        if self.n:
            torch.set_num_threads(self.n)
            _POOL_THREADS[0] = 0


def linear_rows(x: torch.Tensor, w: torch.Tensor, *, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                accumulate: bool = False, threads: int | None = None,
                rms_norm_eps: float | None = None,
                rms_norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T * scale + bias`` for few rows of ``x`` [..., K] (``w`` [N, K]); with
    ``accumulate`` the result is added into ``out``. fp32 sums, one rounding. ``threads``
    (default torch's intra-op count) is the most pool threads the weight rows split over.
    With ``rms_norm_eps``, ``x`` is RmsNorm'd first (``rms_norm_weight`` optional), rounded
    to x's dtype exactly as the separate RmsNorm kernel would store it."""
    k, n = x.shape[-1], w.shape[0]
    x2, rows, xs = _rows(x, k)
    shape = (*x.shape[:-1], n)
    if accumulate and out is None:
        raise ValueError("linear_rows: accumulate needs out")
    y = out if (out is not None and out.shape == shape and out.dtype in DTYPE_CODES
                and out.is_contiguous()) else None
    if y is None:
        if accumulate:
            y = out.contiguous()
        else:
            y = torch.empty(shape, dtype=x.dtype)
    if not w.is_contiguous():
        w = w.contiguous()
    if rms_norm_weight is not None and (rms_norm_weight.numel() != k or
                                        not rms_norm_weight.is_contiguous() or
                                        rms_norm_weight.dtype not in DTYPE_CODES):
        raise ShapeError("linear_rows", "rms_norm_weight", f"a contiguous fp32/bf16/fp16 [{k}]",
                         f"{rms_norm_weight.dtype} {tuple(rms_norm_weight.shape)}")
    args = _LINEAR.pack(
        x2.data_ptr(), w.data_ptr(), 0 if scale is None else scale.data_ptr(),
        0 if bias is None else bias.data_ptr(), y.data_ptr(), DTYPE_CODES[x.dtype],
        LINEAR_WEIGHT_DTYPES[w.dtype], 0 if bias is None else DTYPE_CODES[bias.dtype],
        DTYPE_CODES[y.dtype], rows, k, n, xs, w.stride(0), n,
        threads or _POOL_THREADS[0] or torch.get_num_threads(),
        int(accumulate), int(rms_norm_eps is not None),
        0 if rms_norm_weight is None else rms_norm_weight.data_ptr(),
        0 if rms_norm_weight is None else DTYPE_CODES[rms_norm_weight.dtype],
        float(rms_norm_eps or 0.0), 0.0)
    _check(_fn("linear_rows")(args), "linear_rows")
    return _deliver(out, y)


def decode_attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                           key_mask: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> Callable[[int, int], torch.Tensor]:
    """Bind one-token attention over a KV cache; returns ``call(lo, n) -> out``.

    ``q`` [B, H, D]; ``k``/``v`` caches [B, cap, KV, D] (H a multiple of KV; any
    strides with D unit-stride); ``key_mask`` bool [B, cap] (keys attended where
    True); ``out`` [B, H, D] (a new one in q's dtype when None). ``call(lo, n)``
    attends to cache positions ``lo <= s < n`` and writes ``out``: fp32 scores and
    softmax, one rounding; a row with every key masked gives zeros. The tensors are
    bound (their addresses packed once): they must stay alive and in place."""
    op = "decode_attention"
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ShapeError(op, "q / k / v shapes", "q [B, H, D], k and v [B, cap, KV, D]",
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, d = q.shape
    kv = k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or h % kv or d > 512:
        raise ShapeError(op, "q against the cache", "the same batch and head_dim (<= 512), "
                         "query heads a multiple of KV heads", f"q {tuple(q.shape)}, cache "
                         f"{tuple(k.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in DTYPE_CODES:
            raise DtypeError(op, name, "float32, bfloat16 or float16", str(t.dtype))
    if k.dtype != v.dtype:
        raise DtypeError(op, "v", f"the key cache's dtype {k.dtype}", str(v.dtype))
    if out is None:
        out = torch.empty(b, h, d, dtype=q.dtype)
    if out.shape != q.shape or out.dtype not in DTYPE_CODES:
        raise ShapeError(op, "out", f"{tuple(q.shape)} fp32/bf16/fp16",
                         f"{tuple(out.shape)} {out.dtype}")
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.dim() != 2 or
                                 key_mask.shape[0] != b or key_mask.shape[1] < k.shape[1]):
        raise ShapeError(op, "key_mask", f"bool [{b}, >= {k.shape[1]}]",
                         f"{key_mask.dtype} {tuple(key_mask.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.stride(-1) != 1:
            raise ShapeError(op, name, "a unit-stride last dim", f"strides {t.stride()}")
    cap = k.shape[1]
    m = key_mask
    pre = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
           0 if m is None else m.data_ptr(), DTYPE_CODES[q.dtype], DTYPE_CODES[k.dtype],
           DTYPE_CODES[out.dtype], b, h, kv, d, q.stride(0), q.stride(1),
           k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           out.stride(0), out.stride(1), 0 if m is None else m.stride(0),
           0 if m is None else m.stride(1), 0, 0, 0, 0, 0, 0, 0)
    fn, pack, scale = _fn("decode_attention"), _ATTN.pack, float(scale)
    keep = (q, k, v, out, m)  # the packed addresses stay valid while the call lives

    def call(lo: int, n: int) -> torch.Tensor:
        if not 0 <= lo < n <= cap:
            raise ShapeError(op, "key range", f"0 <= lo < n <= {cap}", f"[{lo}, {n})")
        th = _POOL_THREADS[0] or torch.get_num_threads()
        _check(fn(pack(*pre, th, scale, lo, n)), "decode_attention")
        return keep[3]
    return call


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                           scale: float, window: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """PagedAttention for one query token per sequence, reading the blocks in place.

    ``q`` [B, H, D]; caches [num_blocks, block_size, KV, D] (D unit-stride);
    ``block_tables`` int32/int64 [B, max_blocks]; ``context_lens`` int32/int64 [B]
    (the keys of row b are its first ``context_lens[b]`` positions, the last
    ``window`` of them with a sliding window). fp32 scores and softmax, one
    rounding into ``out`` [B, H, D] (new when None); a row with no key gives zeros.
    Table entries are trusted: the caller's block manager owns them."""
    op = "PagedAttention"
    b, h, d = q.shape
    nb, bs, kv, dk = key_cache.shape
    if value_cache.shape != key_cache.shape or dk != d or h % kv or d > 512:
        raise ShapeError(op, "q against the caches", "caches [blocks, block_size, KV, D] "
                         "with q's D (<= 512), query heads a multiple of KV heads",
                         f"q {tuple(q.shape)}, caches {tuple(key_cache.shape)}, "
                         f"{tuple(value_cache.shape)}")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in DTYPE_CODES:
            raise DtypeError(op, name, "float32, bfloat16 or float16", str(t.dtype))
    if value_cache.dtype != key_cache.dtype:
        raise DtypeError(op, "value_cache", f"the key cache's dtype {key_cache.dtype}",
                         str(value_cache.dtype))
    ints = (torch.int32, torch.int64)
    if (block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype not in ints
            or context_lens.shape != (b,) or context_lens.dtype not in ints):
        raise ShapeError(op, "block_tables / context_lens", f"int32/int64 [{b}, *] and [{b}]",
                         f"{block_tables.dtype} {tuple(block_tables.shape)}, "
                         f"{context_lens.dtype} {tuple(context_lens.shape)}")
    q = _unit_last(q)
    bt, cl = block_tables.contiguous(), context_lens.contiguous()
    n = bt.shape[1] * bs                  # the tables' reach; the kernel checks each length
    y = out if (out is not None and out.shape == q.shape and out.dtype in DTYPE_CODES
                and out.stride(-1) == 1) else torch.empty(b, h, d, dtype=q.dtype)
    if b == 0 or n == 0:
        y.zero_()
        return _deliver(out, y)
    kc, vc = _unit_last(key_cache), _unit_last(value_cache)
    args = _ATTN.pack(
        q.data_ptr(), kc.data_ptr(), vc.data_ptr(), y.data_ptr(), 0, DTYPE_CODES[q.dtype],
        DTYPE_CODES[kc.dtype], DTYPE_CODES[y.dtype], b, h, kv, d, q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        y.stride(0), y.stride(1), 0, 0, cl.data_ptr(), int(cl.dtype == torch.int32),
        int(window or 0), bt.data_ptr(), int(bt.dtype == torch.int32), bt.stride(0), bs,
        _POOL_THREADS[0] or torch.get_num_threads(), float(scale), 0, n)
    status = _fn("decode_attention")(args)
    if status == -3:
        raise ShapeError(op, "context_lens", f"0 <= length <= {n} (the block table's reach)",
                         context_lens.tolist())
    _check(status, "decode_attention")
    return _deliver(out, y)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, n: int, lo: int = 0,
                     scale: float, key_mask: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One-token attention of ``q`` [B, H, D] over cache positions ``[lo, n)`` of
    ``k``/``v`` [B, cap, KV, D]; see :func:`decode_attention_bound`."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    y = None if out is None or out.stride(-1) != 1 else out
    res = decode_attention_bound(q, k, v, scale=scale, key_mask=key_mask, out=y)(lo, n)
    return _deliver(out, res)


# ---------------------------------------------------------------- for the torch kernels
_logged: set[tuple[str, str]] = set()


def c_launches(composite: int, with_c: int = 1) -> int:
    """A kernel's declared launches: ``with_c`` (one C kernel, plus any GEMMs around
    it) when the C kernels load here, else its torch composite's count."""
    return with_c if unavailable_reason() is None else composite


def log_fallback(op: str, why: str) -> None:
    """Say (once per op and reason at INFO, then at DEBUG) that the torch composite runs."""
    from ...log import logger

    key = (op, why)
    level = 10 if key in _logged else 20
    _logged.add(key)
    logger.log(level, "%s: C kernel skipped (%s) -> torch composite", op, why)


def into(out: list | None, i: int, y: torch.Tensor) -> torch.Tensor:
    """Put a composite's result ``y`` into ``out[i]`` when a buffer was given."""
    o = None if out is None or i >= len(out) else out[i]
    if o is None or o is y:
        return y
    o.copy_(y)
    return o


def out_at(out: list | None, i: int) -> torch.Tensor | None:
    """``out[i]`` or None."""
    return None if out is None or i >= len(out) else out[i]
