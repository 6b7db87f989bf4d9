"""Bound forms of the norm and RoPE C kernels (checked and packed once, for plans that
reuse their buffers): :func:`norm_bound` writes a fixed output from a per-call input,
:func:`rope_packed` reads its positions per call. Re-exported by :mod:`.torch_ops`."""

from __future__ import annotations

from typing import Callable

import torch

from atbcore.errors import ShapeError

from . import torch_checks as chk
from .bindings import not_native
from .threads import pool_threads
from .torch_ops import (_NORM, _ROPE, DTYPE_CODES, MAX_ROTARY_DIM, _check, _fn, _out,
                        _rope_fields, _rope_status, _rows, _vec)

__all__ = ["norm_bound", "rope_packed"]


def norm_bound(name: str, w: torch.Tensor | None, b: torch.Tensor | None, n: int, eps: float,
               w_offset: float, out: torch.Tensor, sum_out: torch.Tensor | None = None
               ) -> Callable[..., None]:
    """``"rms_norm"`` / ``"layer_norm"`` into the fixed buffer ``out`` with the weight,
    bias and output arguments packed once: ``call(x)`` for an ``x`` shaped like
    ``out`` (a plan's input slot: its dtype and shape are the plan's, its address
    and strides are read per call). With ``sum_out`` (the Add form) ``call(x,
    residual)`` also writes ``x + residual`` there, and normalizes that."""
    n = chk.integer(name, "n", n, 0)
    chk.vector(name, "weight", w, n)
    chk.vector(name, "bias", b, n)
    y, ys = _fixed_rows(name, "out", out, n)
    s, ss = (0, 0) if sum_out is None else _fixed_rows(name, "sum_out", sum_out, n)
    if sum_out is not None and (sum_out.shape != out.shape or sum_out.dtype != out.dtype):
        raise ShapeError(name, "'sum_out' (like 'out')", f"{out.dtype} {list(out.shape)}",
                         f"{sum_out.dtype} {list(sum_out.shape)}")
    wp, wdt, wk = _vec(w)
    bp, bdt, bk = _vec(b)
    eps, w_offset = chk.real(name, "eps", eps), chk.real(name, "w_offset", w_offset)
    fn, pack, code, yp = _fn(name), _NORM.pack, DTYPE_CODES[out.dtype], y.data_ptr()
    sp = 0 if sum_out is None else s.data_ptr()
    keep = (wk, bk, out, sum_out)  # the packed addresses stay valid while the call lives

    def call(x: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            not_native()  # a copy's address: recorded, it would outlive the copy
        x2, rows, xs = _rows(x, n)
        rp = rs = 0
        if sp:
            r2, _, rs = _rows(residual, n)
            rp = r2.data_ptr()
        _check(fn(pack(x2.data_ptr(), rp, sp, yp, wp, bp, code, wdt, bdt, rows, n, xs, rs, ss,
                       ys, pool_threads(), eps, w_offset)), name)
    call.keep = keep  # type: ignore[attr-defined]
    return call


def _fixed_rows(name: str, what: str, t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """A fixed output buffer as rows of ``n`` unit-stride elements: (it, row stride)."""
    chk.tensor(name, what, t)
    chk.suffix_numel(name, what, t, n)
    y, ys = _out(t, t, n)
    if y is not t or t.numel() == 0:
        raise ShapeError(name, f"'{what}' (a bound norm's buffer)",
                         "non-empty rows of unit stride",
                         f"shape {list(t.shape)} strides {list(t.stride())}")
    return y, ys


def rope_packed(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                *, layout: str, head_dim: int, rotary_dim: int, q_heads: int, k_heads: int,
                interleave: bool, batch: int, seq: int, table_len: int,
                pos: torch.Tensor | None = None, tab_offset: int = 0,
                q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
                v: torch.Tensor | None = None, v_out: torch.Tensor | None = None,
                cache_len: int = 0, cache_offset: int = 0,
                slot: torch.Tensor | None = None) -> Callable[[], int]:
    """:func:`rope` checked and packed now: ``call()`` runs it (the positions read then,
    so a plan that rewrites its position tensor in place reuses the call) and returns
    what :func:`rope` returns. The tensors must stay alive and in place. ``slot``
    (int32/int64, one per token, read per call like the positions): k and v go to
    rows ``slot[b * seq + s]`` of ``k_out`` / ``v_out`` given as ``[1, cache_len, Hk,
    D]`` (paged blocks seen flat), not to their position rows."""
    chk.check_rope("rope", q, k, cos, sin, layout=layout, head_dim=head_dim,
                   rotary_dim=rotary_dim, q_heads=q_heads, k_heads=k_heads, batch=batch,
                   seq=seq, table_len=table_len, pos=pos, tab_offset=tab_offset, q_out=q_out,
                   k_out=k_out,
                   v=v, v_out=v_out, cache_len=cache_len, cache_offset=cache_offset,
                   max_rotary_dim=MAX_ROTARY_DIM, slot=slot)
    if q.numel() == 0 and (k is None or k.numel() == 0):
        return lambda: 0
    fields, keep = _rope_fields(q, k, cos, sin, layout=layout, head_dim=head_dim,
                                rotary_dim=rotary_dim, q_heads=q_heads, k_heads=k_heads,
                                interleave=interleave, batch=batch, seq=seq,
                                table_len=table_len, pos=pos, tab_offset=tab_offset,
                                q_out=q_out, k_out=k_out, v=v, v_out=v_out, cache_len=cache_len)
    sp = (0, 0) if slot is None else (slot.data_ptr(), int(slot.dtype == torch.int32))
    args, fn = _ROPE.pack(*fields, cache_offset, *sp), _fn("rope")

    def call() -> int:
        return _rope_status(fn(args), cache_len)
    call.keep = (*keep, slot)  # type: ignore[attr-defined]  # the packed addresses stay valid
    return call
