"""The activation C kernel on torch CPU tensors (``act(x + b) [* (up + b_up)]``, the
merged gate|up form, fp32 compute, one rounding), and its bound form for plans whose
buffers are fixed. Re-exported by :mod:`.torch_ops`, where its callers import it."""

from __future__ import annotations

from typing import Any, Callable

import torch

from atbcore.errors import InputError, ShapeError

from . import native
from . import torch_checks as chk
from .threads import pool_threads
from .torch_ops import ACT_CODES, DTYPE_CODES, _check, _deliver, _fn, _out, _rows, _vec

__all__ = ["activation", "activation_bound"]

_ACT_HEAD = native.ACT_HEAD  # ActArgs up to the thread count
_Q = native.Q


def activation(x: torch.Tensor, act: str, *, up: torch.Tensor | None = None,
               split: bool = False, bias: torch.Tensor | None = None,
               bias_up: torch.Tensor | None = None, out: torch.Tensor | None = None,
               bound: bool = False) -> Any:
    """``act(x + bias) [* (up + bias_up)]``; ``split``: x is ``[..., 2n]`` = gate | up.

    ``up`` has x's shape and dtype; ``bias``/``bias_up`` are ``[n]`` vectors of one
    float dtype."""
    op = "activation_bound" if bound else "activation"
    chk.tensor(op, "x", x, dims=tuple(range(1, 65)))
    chk.choice(op, "act", act, ACT_CODES)
    n = x.shape[-1] // 2 if split else x.shape[-1]
    if split and (x.shape[-1] % 2 or up is not None):
        raise ShapeError(op, "'x' with split=True (gate | up halves, no separate up)",
                         "an even last dim and up=None", f"{list(x.shape)}, up "
                         f"{'given' if up is not None else 'None'}")
    if up is not None:
        chk.tensor(op, "up", up, (x.dtype,))
        if up.shape != x.shape:
            raise ShapeError(op, "'up' shape (as x)", list(x.shape), list(up.shape))
    elif bias_up is not None and not split:
        raise InputError(op, "bias_up", "None without up (or split)", "a tensor")
    chk.vector(op, "bias", bias, n)
    chk.vector(op, "bias_up", bias_up, n)
    if bias is not None and bias_up is not None and bias.dtype != bias_up.dtype:
        raise ShapeError(op, "'bias_up' dtype (one dtype for both biases)", str(bias.dtype),
                         str(bias_up.dtype))
    shape = (*x.shape[:-1], n)
    chk.output(op, "out", out, shape)
    if x.numel() == 0 or n == 0:
        return out if out is not None else torch.empty(shape, dtype=x.dtype)
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
    head = _ACT_HEAD.pack(g_ptr, u_ptr, y.data_ptr(), bp, bup, DTYPE_CODES[x.dtype],
                          bdt or budt, ACT_CODES[act], rows, n, xs, us, ys)
    if bound:
        return head, y, (x2, u2 if not split else None, bk, buk)
    _check(_fn("activation")(head + _Q.pack(pool_threads())), "activation")
    return _deliver(out, y)


def activation_bound(x: torch.Tensor, act: str, out: torch.Tensor, *,
                     up: torch.Tensor | None = None, split: bool = False,
                     bias: torch.Tensor | None = None, bias_up: torch.Tensor | None = None
                     ) -> Callable[[], None] | None:
    """:func:`activation` of these very buffers (checked now), its arguments packed
    once: ``call()`` reruns it. None when ``out`` is not the buffer the kernel writes
    in place (another dtype, or not contiguous), or there is nothing to compute."""
    n = x.shape[-1] // 2 if split else x.shape[-1]
    if (out.dtype != x.dtype or not out.is_contiguous() or x.numel() == 0 or n == 0
            or (bias is not None and not bias.is_contiguous())
            or (bias_up is not None and not bias_up.is_contiguous())):
        activation(x, act, up=up, split=split, bias=bias, bias_up=bias_up, out=out)  # checks
        return None
    head, y, keep = activation(x, act, up=up, split=split, bias=bias, bias_up=bias_up,
                               out=out, bound=True)
    if y is not out:
        return None
    fn = _fn("activation")

    def call() -> None:
        _check(fn(head + _Q.pack(pool_threads())), "activation")
    call.keep = (keep, out)  # type: ignore[attr-defined]  # the buffers live with the call
    call.native = True  # type: ignore[attr-defined]  # one C call (runtime/native_run.py)
    return call
