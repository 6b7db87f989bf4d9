"""Argument checks of the C-kernel wrappers, run before any C call.

The C kernels trust the sizes, strides and indices they are given (a short
weight or a lying head count reads or writes past a buffer, a block id past
the cache reads foreign memory), so every exported wrapper in
:mod:`.torch_ops`, :mod:`.torch_decode` and :mod:`.torch_prefill` checks its
tensors here first and raises an :class:`~atbcore.errors.AtbError` subclass that
names the function; nothing is written when a check fails. The ``*_bound``
forms check once at bind time and per call only the ints that change.
"""

from __future__ import annotations

import ctypes
import math
import operator
from typing import Any, Iterable

import numpy as np
import torch

from atbcore.errors import DeviceError, DtypeError, InputError, ParamsError, ShapeError

__all__ = ["FLOATS", "INTS", "INT32_MAX", "PositionError", "tensor", "output", "vector",
           "integer", "real", "choice", "suffix_numel", "check_block_tables"]

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64)
INT32_MAX = 2 ** 31 - 1


class PositionError(InputError, ValueError):
    """A RoPE position is negative or past the KV cache (nothing was written).

    Also a ValueError: callers that caught the kernel's former ValueError keep working."""


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def tensor(op: str, name: str, t: Any, dtypes: Iterable[torch.dtype] | None = FLOATS, *,
           dims: tuple[int, ...] | None = None, cpu: bool = True) -> torch.Tensor:
    """``t`` when it is a CPU torch tensor of one of ``dtypes`` (None: any) and rank in
    ``dims``. ``cpu=False``: any device (a tensor read for its shape only)."""
    # the wrappers run per kernel call: attribute reads only on the good path
    if not isinstance(t, torch.Tensor):
        raise InputError(op, f"{name!r}", "a torch.Tensor", type(t).__name__)
    if cpu and not t.is_cpu:
        raise DeviceError(op, f"{name!r} device", "cpu", str(t.device))
    if dtypes is not None and t.dtype not in dtypes:
        raise DtypeError(op, f"{name!r} dtype", _dtype_names(dtypes), str(t.dtype))
    if dims is not None and t.dim() not in dims:
        raise ShapeError(op, f"{name!r} rank", " or ".join(map(str, dims)),
                         f"{t.dim()} (shape {list(t.shape)})")
    return t


def output(op: str, name: str, t: Any, shape: tuple[int, ...] | torch.Size,
           dtypes: Iterable[torch.dtype] = FLOATS) -> torch.Tensor | None:
    """An ``out`` buffer checked before anything is computed: a CPU tensor of
    ``shape`` that an in-place copy may write (None passes)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or not t.is_cpu or t.dtype not in dtypes:
        tensor(op, name, t, dtypes)
    if t.shape != shape:
        raise ShapeError(op, f"{name!r} shape", list(shape), list(t.shape))
    if t.requires_grad and t.is_leaf and torch.is_grad_enabled():
        raise InputError(op, f"{name!r}", "a tensor that does not require grad",
                         "a leaf tensor with requires_grad=True")
    return t


def vector(op: str, name: str, t: Any, n: int, dtypes: Iterable[torch.dtype] = FLOATS
           ) -> torch.Tensor | None:
    """A per-column vector (weight, bias, scale) of exactly ``n`` elements, or None."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or not t.is_cpu or t.dtype not in dtypes:
        tensor(op, name, t, dtypes)
    if t.numel() != n:
        raise ShapeError(op, f"{name!r} length", n, f"{t.numel()} (shape {list(t.shape)})")
    return t


def integer(op: str, name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` as an int (bools refused) inside ``[lo, hi]``."""
    if type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi):
        return v
    if isinstance(v, bool):
        raise ParamsError(op, name, "an int", repr(v))
    try:
        i = operator.index(v)
    except TypeError:
        raise ParamsError(op, name, "an int", repr(v)) from None
    if (lo is not None and i < lo) or (hi is not None and i > hi):
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise ParamsError(op, name, f"an int in [{lo_s}, {hi_s}]", i)
    return i


def real(op: str, name: str, v: Any, *, finite: bool = True) -> float:
    """``v`` as a float (a real number; finite unless told)."""
    if type(v) is float and (not finite or math.isfinite(v)):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
        raise ParamsError(op, name, "a real number", repr(v))
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ParamsError(op, name, "a real number", repr(v)) from None
    if finite and not math.isfinite(f):
        raise ParamsError(op, name, "a finite number", f)
    return f


def choice(op: str, name: str, v: Any, options: Iterable[Any]) -> Any:
    """``v`` when it is one of ``options``."""
    opts = list(options)
    if not isinstance(v, str) or v not in opts:
        raise ParamsError(op, name, "one of " + ", ".join(map(repr, opts)), repr(v))
    return v


def suffix_numel(op: str, name: str, t: torch.Tensor, n: int) -> None:
    """``t``'s trailing dims hold exactly ``n`` elements (the normalized extent)."""
    if t.dim() and t.shape[-1] == n:
        return
    size = 1
    for d in reversed(t.shape):
        if size == n:
            return
        size *= d
    if size != n:
        raise ShapeError(op, f"{name!r} trailing dims", f"a suffix of {n} elements",
                         list(t.shape))


# The bytes of the last block tables and lengths found valid (with num_blocks and
# block_size): a decode step attends every layer over the same tables, so they are
# scanned once per step and compared (a memcmp) on the other layers. Bytes, not the
# tensors' addresses or version counters: a freed table's address is reused by the
# next one, and writes through a NumPy view bypass the version counter. NumPy, not
# torch ops: the check dispatches no kernel, so launch counts stay the kernel's own.
_CHECKED: list[tuple] = [()]


def _snapshot(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def check_block_tables(op: str, tables: torch.Tensor, lens: torch.Tensor, num_blocks: int,
                       block_size: int) -> None:
    """Every block id a row reads (its first ``ceil(len / block_size)`` entries) is in
    ``[0, num_blocks)``; ``lens`` in ``[0, columns * block_size]``. Both contiguous."""
    key = (num_blocks, block_size, _snapshot(tables), _snapshot(lens))
    if _CHECKED[0] == key:
        return
    reach = tables.shape[1] * block_size
    ln = lens.numpy().astype(np.int64)
    if ln.size:
        if ln.min() < 0 or ln.max() > reach:
            raise ShapeError(op, "context_lens", f"0 <= length <= {reach} (the block table's "
                             "reach)", ln.tolist())
        used = np.arange(tables.shape[1]) < ((ln + block_size - 1) // block_size)[:, None]
        ids = tables.numpy()[used]
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            bad = ids[(ids < 0) | (ids >= num_blocks)]
            raise InputError(op, "block_tables ids (the blocks the context lengths read)",
                             f"0 <= id < {num_blocks}", bad[:8].tolist())
    _CHECKED[0] = key


def _bshd_shape(layout: str, batch: int, seq: int, heads: int, head_dim: int) -> tuple:
    if layout == "BSH":
        return (batch, seq, heads * head_dim)
    if layout == "BNSD":
        return (batch, heads, seq, head_dim)
    return (batch, seq, heads, head_dim)


def check_rope(op: str, q: Any, k: Any, cos: Any, sin: Any, *, layout: Any, head_dim: Any,
               rotary_dim: Any, q_heads: Any, k_heads: Any, batch: Any, seq: Any,
               table_len: Any, pos: Any, tab_offset: Any, q_out: Any, k_out: Any, v: Any,
               v_out: Any, cache_len: Any, cache_offset: Any, max_rotary_dim: int,
               slot: Any = None) -> None:
    """Every tensor of a RoPE call against the geometry it claims (layout, heads,
    head_dim, batch, seq), the tables against ``table_len``, the caches against
    ``cache_len`` (``[1, cache_len, Hk, D]`` with per-token ``slot`` rows): the kernel
    addresses rows from these numbers alone."""
    layout = choice(op, "layout", layout, ("BSH", "BSND", "BNSD"))
    hd = integer(op, "head_dim", head_dim, 1)
    rd = integer(op, "rotary_dim", rotary_dim, 2, min(hd, max_rotary_dim))
    if rd % 2:
        raise ParamsError(op, "rotary_dim", "an even int", rd)
    b, s = integer(op, "batch", batch, 0), integer(op, "seq", seq, 0)
    hq = integer(op, "q_heads", q_heads, 0)
    hk = integer(op, "k_heads", k_heads or 0, 0)
    integer(op, "tab_offset", tab_offset, 0, INT32_MAX)
    cl = integer(op, "cache_len", cache_len, 0)
    integer(op, "cache_offset", cache_offset, 0)
    tensor(op, "q", q)
    want = _bshd_shape(layout, b, s, hq, hd)
    if tuple(q.shape) != want:
        raise ShapeError(op, f"'q' shape (layout {layout}, {hq} heads of {hd})", list(want),
                         list(q.shape))
    output(op, "q_out", q_out, want, (q.dtype,))
    if k is None:
        if v is not None or k_out is not None or v_out is not None:
            raise InputError(op, "k", "k given with k_out / v / v_out", "None")
    else:
        tensor(op, "k", k, (q.dtype,))
        kwant = _bshd_shape(layout, b, s, hk, hd)
        if tuple(k.shape) != kwant:
            raise ShapeError(op, f"'k' shape (layout {layout}, {hk} heads of {hd})",
                             list(kwant), list(k.shape))
        if k_out is None:
            raise InputError(op, "k_out", "a tensor when k is given", "None")
        if slot is not None:
            tensor(op, "slot", slot, (torch.int32, torch.int64))
            if not cl or slot.numel() != b * s or not slot.is_contiguous():
                raise ShapeError(op, "'slot' (a cache row per token, with cache_len)",
                                 f"{b * s} contiguous ids, cache_len > 0",
                                 f"{list(slot.shape)}, cache_len {cl}")
        cwant = ((1 if slot is not None else b), cl, hk, hd) if cl else kwant
        output(op, "k_out", k_out, cwant, (q.dtype,))
        if v is not None:
            tensor(op, "v", v, (q.dtype,))
            if tuple(v.shape) != kwant:
                raise ShapeError(op, "'v' shape (as k)", list(kwant), list(v.shape))
            if v_out is None:
                raise InputError(op, "v_out", "a tensor when v is given", "None")
            output(op, "v_out", v_out, cwant, (q.dtype,))
        elif v_out is not None:
            raise InputError(op, "v", "v given with v_out", "None")
    for name, t in (("q_out", q_out), ("k_out", k_out), ("v_out", v_out)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ShapeError(op, f"'{name}' strides", "a unit-stride last dim", list(t.stride()))
    tensor(op, "cos", cos, dims=(2, 3))
    tensor(op, "sin", sin, (cos.dtype,))
    if sin.shape != cos.shape:
        raise ShapeError(op, "'sin' shape (as cos)", list(cos.shape), list(sin.shape))
    if cos.shape[-1] < rd:
        raise ShapeError(op, "'cos' / 'sin' last dim", f">= rotary_dim {rd}", list(cos.shape))
    n = integer(op, "table_len", table_len, 0, cos.shape[-2])
    if cos.dim() == 3 and cos.shape[0] not in (1, b):
        raise ShapeError(op, "'cos' / 'sin' batch", f"1 or {b}", list(cos.shape))
    if pos is None:
        if s and n == 0:
            raise ShapeError(op, "table_len", "rows for the sequence", 0)
        return
    tensor(op, "pos", pos, INTS, dims=(1, 2))
    if pos.shape[-1] != s or (pos.dim() == 2 and pos.shape[0] not in (1, b)):
        raise ShapeError(op, "'pos' shape", f"[{s}] or [1 or {b}, {s}]", list(pos.shape))
