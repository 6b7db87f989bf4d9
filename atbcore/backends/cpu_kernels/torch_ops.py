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
from typing import Any

import torch

from atbcore.errors import ShapeError

from . import torch_checks as chk
from . import native
from .bindings import entry, unavailable_reason
from .threads import pool_threads

__all__ = ["why_not", "rms_norm", "layer_norm", "norm_bound", "rope_packed", "rope", "activation", "activation_bound",
           "softmax", "DTYPE_CODES",
           "ACT_CODES", "MAX_ROTARY_DIM", "c_launches", "log_fallback", "into", "out_at"]

# the codes, activations and argument layouts every caller shares live in .native
DTYPE_CODES = {d.torch: c for d, c in native.DTYPE_CODES.items()}
_BOOL = native.BOOL_CODE
ACT_CODES = native.ACT_CODES
MAX_ROTARY_DIM = 1024  # ATB_ROPE_MAX_RD in rope.c
_SM_DIMS = native.SM_DIMS

_NORM = native.NORM
_ROPE = struct.Struct("<46q")  # RopeArgs (rope.c)
_SOFTMAX = native.SOFTMAX

_calls: dict[str, Any] = {}


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
        if not isinstance(t, torch.Tensor):
            return f"C kernels take torch tensors; given {type(t).__name__}"
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


_check = native.check_status  # the wrappers check every argument first


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
    chk.tensor(name, "x", x)
    n = chk.integer(name, "n", n, 0)
    chk.suffix_numel(name, "x", x, n)
    eps, w_offset = chk.real(name, "eps", eps), chk.real(name, "w_offset", w_offset)
    chk.vector(name, "weight", w, n)
    chk.vector(name, "bias", b, n)
    chk.output(name, "out", out, x.shape)
    if residual is not None:
        chk.tensor(name, "residual", residual, (x.dtype,))
        if residual.shape != x.shape:
            raise ShapeError(name, "'residual' shape", list(x.shape), list(residual.shape))
        chk.output(name, "sum_out", sum_out, x.shape)
    if x.numel() == 0:  # no rows (or empty rows): empty outputs, no C call
        y = out if out is not None else torch.empty_like(x)
        s = None if residual is None else (sum_out if sum_out is not None else
                                           torch.empty_like(x))
        return y, s
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
        pool_threads(), eps, w_offset)
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
        raise chk.PositionError("rope", "position ids", ">= 0", "a negative id")
    if status == -3:
        raise chk.PositionError("rope", "cache row (position)", f"< cache_len {cache_len}",
                                "a row past it")
    if status < 0:
        _check(status, "rope")
    return status


def rope(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
         layout: str, head_dim: int, rotary_dim: int, q_heads: int, k_heads: int,
         interleave: bool, batch: int, seq: int, table_len: int, pos: torch.Tensor | None = None,
         tab_offset: int = 0, q_out: torch.Tensor | None = None,
         k_out: torch.Tensor | None = None, v: torch.Tensor | None = None,
         v_out: torch.Tensor | None = None, cache_len: int = 0, cache_offset: int = 0,
         slot: torch.Tensor | None = None) -> int:
    """Rotate q (and k) into ``q_out`` / ``k_out`` (which may be q / k: in place).

    ``cos``/``sin``: ``[P, rd]`` tables indexed by ``pos`` (or ``s + tab_offset``),
    or per token ``[B|1, S, rd]`` (``tab_offset`` 0, ``table_len`` S). With
    ``cache_len > 0``, ``k_out``/``v_out`` are ``[B, cache_len, Hk, D]`` caches
    and token ``(b, s)`` is written at row ``pos[b, s]`` (or ``s + cache_offset``);
    with ``slot`` (see :func:`.torch_bound.rope_packed`) at row ``slot[b * seq + s]``
    of caches given as ``[1, cache_len, Hk, D]``.
    Returns 0, or the table length needed when a position is past ``table_len``
    (nothing is written then; grow the table and call again). Raises ValueError
    (:class:`.torch_checks.PositionError`, also a ValueError) for a negative
    position or one past the cache; every other bad argument raises an AtbError
    subclass before anything is written.
    """
    return rope_packed(q, k, cos, sin, layout=layout, head_dim=head_dim, rotary_dim=rotary_dim,
                       q_heads=q_heads, k_heads=k_heads, interleave=interleave, batch=batch,
                       seq=seq, table_len=table_len, pos=pos, tab_offset=tab_offset,
                       q_out=q_out, k_out=k_out, v=v, v_out=v_out, cache_len=cache_len,
                       cache_offset=cache_offset, slot=slot)()


_NO_LEAD = (1,) * _SM_DIMS + (0,) * _SM_DIMS


def softmax(x: torch.Tensor, *, scale: float = 1.0, mask: torch.Tensor | None = None,
            causal: bool = False, empty_rows_zero: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last axis of ``x * scale (+ mask)``, causal over the last two axes.

    ``mask``: bool (False = masked) or additive float, broadcastable to x."""
    op = "softmax"
    chk.tensor(op, "x", x, dims=tuple(range(1 + int(bool(causal)), 65)))
    scale = chk.real(op, "scale", scale, finite=False)
    chk.output(op, "out", out, x.shape)
    if mask is not None:
        chk.tensor(op, "mask", mask, (torch.bool, *DTYPE_CODES))
        if x.dim() - 1 > _SM_DIMS:
            raise ShapeError(op, "'x' rank with a mask", f"<= {_SM_DIMS + 1}", x.dim())
        try:
            torch.broadcast_shapes(mask.shape, x.shape)
        except RuntimeError:
            raise ShapeError(op, "'mask' shape (broadcast to x)", list(x.shape),
                             list(mask.shape)) from None
        if torch.broadcast_shapes(mask.shape, x.shape) != x.shape:
            raise ShapeError(op, "'mask' shape (broadcast to x)", list(x.shape),
                             list(mask.shape))
    if x.numel() == 0:
        return out if out is not None else torch.empty_like(x)
    n = x.shape[-1]
    x2, rows, xs = _rows(x, n)
    y, ys = _out(out, x, n)
    if mask is None:
        nd, geom, mlast, mdt, mptr = 1, _NO_LEAD, 0, 0, 0
    else:
        lead = list(x.shape[:-1]) or [1]
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
    try:
        o.copy_(y)
    except RuntimeError as e:  # a buffer the result cannot go into (shape, device)
        raise ShapeError("into", f"out[{i}]", f"a buffer taking {list(y.shape)} {y.dtype}",
                         f"{list(o.shape)} {o.dtype} on {o.device} ({str(e)[:120]})") from None
    return o


def out_at(out: list | None, i: int) -> torch.Tensor | None:
    """``out[i]`` or None."""
    return None if out is None or i >= len(out) else out[i]


# the activation kernel lives in its own module; callers import it from here
from .torch_act import activation, activation_bound  # noqa: E402
from .torch_bound import norm_bound, rope_packed  # noqa: E402
