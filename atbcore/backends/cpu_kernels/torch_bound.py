"""Bound forms of the norm and RoPE C kernels (checked and packed once, for plans that
reuse their buffers): :func:`norm_bound` writes a fixed output from a per-call input,
:func:`rope_packed` reads its positions per call. Re-exported by :mod:`.torch_ops`."""

from __future__ import annotations

from typing import Callable

import torch

from atbcore.errors import ShapeError

from . import torch_checks as chk
from .threads import pool_threads
from .torch_ops import (_NORM, _ROPE, DTYPE_CODES, MAX_ROTARY_DIM, _check, _fn, _out,
                        _rope_fields, _rope_status, _rows, _vec)

__all__ = ["norm_bound", "rope_packed"]


def norm_bound(name: str, w: torch.Tensor | None, b: torch.Tensor | None, n: int, eps: float,
               w_offset: float, out: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """``"rms_norm"`` / ``"layer_norm"`` into the fixed buffer ``out`` with the weight,
    bias and output arguments packed once: ``call(x)`` for an ``x`` shaped like
    ``out`` (a plan's input slot: its dtype and shape are the plan's, its address
    and strides are read per call)."""
    n = chk.integer(name, "n", n, 0)
    chk.vector(name, "weight", w, n)
    chk.vector(name, "bias", b, n)
    chk.tensor(name, "out", out)
    chk.suffix_numel(name, "out", out, n)
    y, ys = _out(out, out, n)
    if y is not out or out.numel() == 0:
        raise ShapeError(name, "'out' (a bound norm's buffer)", "non-empty rows of unit stride",
                         f"shape {list(out.shape)} strides {list(out.stride())}")
    wp, wdt, wk = _vec(w)
    bp, bdt, bk = _vec(b)
    eps, w_offset = chk.real(name, "eps", eps), chk.real(name, "w_offset", w_offset)
    fn, pack, code, yp = _fn(name), _NORM.pack, DTYPE_CODES[out.dtype], y.data_ptr()
    keep = (wk, bk, out)  # the packed addresses stay valid while the call lives

    def call(x: torch.Tensor) -> None:
        x2, rows, xs = _rows(x, n)
        _check(fn(pack(x2.data_ptr(), 0, 0, yp, wp, bp, code, wdt, bdt, rows, n, xs, 0, 0, ys,
                       pool_threads(), eps, w_offset)), name)
    call.keep = keep  # type: ignore[attr-defined]
    return call


def rope_packed(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                *, layout: str, head_dim: int, rotary_dim: int, q_heads: int, k_heads: int,
                interleave: bool, batch: int, seq: int, table_len: int,
                pos: torch.Tensor | None = None, tab_offset: int = 0,
                q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
                v: torch.Tensor | None = None, v_out: torch.Tensor | None = None,
                cache_len: int = 0, cache_offset: int = 0) -> Callable[[], int]:
    """:func:`rope` checked and packed now: ``call()`` runs it (the positions read then,
    so a plan that rewrites its position tensor in place reuses the call) and returns
    what :func:`rope` returns. The tensors must stay alive and in place."""
    chk.check_rope("rope", q, k, cos, sin, layout=layout, head_dim=head_dim,
                   rotary_dim=rotary_dim, q_heads=q_heads, k_heads=k_heads, batch=batch,
                   seq=seq, table_len=table_len, pos=pos, tab_offset=tab_offset, q_out=q_out,
                   k_out=k_out,
                   v=v, v_out=v_out, cache_len=cache_len, cache_offset=cache_offset,
                   max_rotary_dim=MAX_ROTARY_DIM)
    if q.numel() == 0 and (k is None or k.numel() == 0):
        return lambda: 0
    fields, keep = _rope_fields(q, k, cos, sin, layout=layout, head_dim=head_dim,
                                rotary_dim=rotary_dim, q_heads=q_heads, k_heads=k_heads,
                                interleave=interleave, batch=batch, seq=seq,
                                table_len=table_len, pos=pos, tab_offset=tab_offset,
                                q_out=q_out, k_out=k_out, v=v, v_out=v_out, cache_len=cache_len)
    args, fn = _ROPE.pack(*fields, cache_offset), _fn("rope")

    def call() -> int:
        return _rope_status(fn(args), cache_len)
    call.keep = keep  # type: ignore[attr-defined]  # the packed addresses stay valid
    return call
