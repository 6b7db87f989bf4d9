"""The C kernels on :class:`~.native.NativeView` s: no framework, no copies.

Each ``*_steps`` function checks its views (shapes, dtypes, strides; an
:class:`~atbcore.errors.AtbError` subclass naming the op, before any C call) and
returns the C calls that compute the op as :class:`Step` s. A step's fields are
the C argument block; an address may be a :class:`Ref` — a tensor that changes per
run, named by a key — which :func:`compile_steps` fills per call::

    x, y = view_of(a), view_of(np.empty_like(a))
    run = compile_steps(rms_norm_steps(x, view_of(w), None, 512, 1e-6, 0.0, y))
    run({})                      # every address known: packed once, one C call

    xs = NativeView(Ref("x"), (1, 512), (512, 1), Dtype.FP32)  # bound to a plan slot
    run = compile_steps(rms_norm_steps(xs, view_of(w), None, 512, 1e-6, 0.0, y))
    run({"x": a.ctypes.data})   # the per-run address packed in

The steps read the tensors in place: every tensor here is contiguous (callers make
or refuse the others), the weight of a matmul may have a row stride.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ...dtypes import Dtype
from ...errors import DtypeError, InputError, ShapeError
from .bindings import entry
from .native import (ACT, ACT_CODES, DTYPE_CODES, LINEAR, NORM, PANEL, SM_DIMS, SOFTMAX,
                     WEIGHT_CODES, NativeView, check_status, pool_threads)

__all__ = ["Ref", "Step", "THREADS", "TableTooShort", "compile_steps", "rms_norm_steps",
           "layer_norm_steps", "linear_steps", "activation_steps", "softmax_steps", "copy_step",
           "rows_of"]


class Ref:
    """An address known only per run: ``addrs[key] + offset``."""

    __slots__ = ("key", "offset")

    def __init__(self, key: str, offset: int = 0) -> None:
        self.key, self.offset = key, offset

    def __add__(self, other: int) -> "Ref":
        return Ref(self.key, self.offset + int(other))

    __radd__ = __add__

    def __repr__(self) -> str:
        return f"Ref({self.key!r}{f' + {self.offset}' if self.offset else ''})"


THREADS = Ref("<threads>")  # the pool's thread count, read per run


class TableTooShort(Exception):
    """A C kernel needs a table of ``need`` rows (RoPE; nothing was written)."""

    def __init__(self, need: int) -> None:
        super().__init__(need)
        self.need = need


@dataclass(frozen=True)
class Step:
    """One C call (``entry`` ``atb_<name>`` with ``layout.pack(*fields)``), or with
    ``entry`` ``"memmove"`` a copy of ``fields = (dst, src, nbytes)``; ``keep`` holds
    memory the fields point into that no tensor of the call owns (atb's tables)."""

    entry: str
    layout: Any
    fields: tuple
    keep: Any = field(default=None, repr=False, compare=False)


def _refused(name: str, status: int) -> None:
    if name == "rope" and status > 0:
        raise TableTooShort(status)
    if name == "rope" and status == -2:
        raise InputError("RoPE", "position_ids values", ">= 0", "a negative id")
    check_status(status, name)


def compile_steps(steps: Sequence[Step]) -> Callable[[Mapping[str, int]], None]:
    """``run(addrs)``: the steps with every :class:`Ref` resolved from ``addrs``;
    fields without one are packed once here."""
    plan: list[tuple] = []
    keep = [s.keep for s in steps if s.keep is not None]
    for s in steps:
        dyn = tuple((i, f.key, f.offset) for i, f in enumerate(s.fields) if type(f) is Ref)
        if s.entry == "memmove":
            plan.append((None, list(s.fields), dyn, "memmove", None))
        elif dyn:
            plan.append((entry(s.entry), list(s.fields), dyn, s.entry, s.layout))
        else:
            plan.append((entry(s.entry), s.layout.pack(*s.fields), (), s.entry, None))

    def run(addrs: Mapping[str, int]) -> None:
        for fn, fields, dyn, name, layout in plan:
            if dyn:
                f = fields.copy()
                for i, key, off in dyn:
                    f[i] = pool_threads() if key == "<threads>" else addrs[key] + off
                if fn is None:
                    ctypes.memmove(f[0], f[1], f[2])
                    continue
                status = fn(layout.pack(*f))
            elif fn is None:
                ctypes.memmove(*fields)
                continue
            else:
                status = fn(fields)
            if status:
                _refused(name, status)
    run.keep = keep  # type: ignore[attr-defined]
    return run


# ----------------------------------------------------------------------------- checks
def _float(op: str, name: str, v: NativeView, codes: Mapping[Dtype, int] = DTYPE_CODES) -> int:
    if v.dtype not in codes:
        names = "/".join(d.value for d in codes)
        raise DtypeError(op, f"{name!r} dtype", names, v.dtype.value)
    return codes[v.dtype]


def _contiguous(op: str, name: str, v: NativeView) -> None:
    if not v.contiguous:
        raise ShapeError(op, f"{name!r} strides", "a contiguous tensor",
                         f"shape {list(v.shape)}, strides {list(v.strides)}")


def rows_of(op: str, name: str, v: NativeView, n: int) -> int:
    """Rows of ``n`` elements in the contiguous tensor ``v`` whose trailing dims
    hold exactly ``n`` (the normalised extent)."""
    _contiguous(op, name, v)
    size = 1
    for d in reversed(v.shape):
        if size == n:
            break
        size *= d
    if size != n or n <= 0:
        raise ShapeError(op, f"{name!r} trailing dims", f"a suffix of {n} elements",
                         list(v.shape))
    return v.numel // n


def _same(op: str, name: str, v: NativeView, like: NativeView, dtype: Dtype | None = None
          ) -> None:
    _contiguous(op, name, v)
    want = like.dtype if dtype is None else dtype
    if v.shape != like.shape or v.dtype != want:
        raise ShapeError(op, f"{name!r}", f"{want.value} {list(like.shape)}",
                         f"{v.dtype.value} {list(v.shape)}")


def _vector(op: str, name: str, v: NativeView | None, n: int) -> tuple[Any, int]:
    """(address, dtype code) of an optional per-column vector of ``n`` elements."""
    if v is None:
        return 0, 0
    code = _float(op, name, v)
    _contiguous(op, name, v)
    if v.numel != n:
        raise ShapeError(op, f"{name!r} length", n, f"{v.numel} (shape {list(v.shape)})")
    return v.address, code


# ----------------------------------------------------------------------------- ops
def _norm(name: str, x: NativeView, w: NativeView | None, b: NativeView | None, n: int,
          eps: float, w_offset: float, y: NativeView, residual: NativeView | None,
          sum_out: NativeView | None) -> list[Step]:
    dt = _float(name, "x", x)
    rows = rows_of(name, "x", x, n)
    _same(name, "out", y, x)
    wp, wdt = _vector(name, "weight", w, n)
    bp, bdt = _vector(name, "bias", b, n)
    rp = sp = 0
    if residual is not None:
        _same(name, "residual", residual, x)
        if sum_out is None:
            raise InputError(name, "sum_out", "a tensor when residual is given", "None")
        _same(name, "sum_out", sum_out, x)
        rp, sp = residual.address, sum_out.address
    if rows == 0:
        return []
    return [Step(name, NORM, (x.address, rp, sp, y.address, wp, bp, dt, wdt, bdt, rows, n, n,
                              n, n, n, THREADS, float(eps), float(w_offset)))]


def rms_norm_steps(x: NativeView, w: NativeView | None, residual: NativeView | None, n: int,
                   eps: float, w_offset: float, y: NativeView,
                   sum_out: NativeView | None = None) -> list[Step]:
    """RmsNorm over the last ``n`` elements into ``y`` (AddRmsNorm with ``residual``:
    ``sum_out = x + residual`` rounded, normalised)."""
    return _norm("rms_norm", x, w, None, n, eps, w_offset, y, residual, sum_out)


def layer_norm_steps(x: NativeView, w: NativeView | None, b: NativeView | None,
                     residual: NativeView | None, n: int, eps: float, y: NativeView,
                     sum_out: NativeView | None = None) -> list[Step]:
    """LayerNorm over the last ``n`` elements into ``y`` (AddLayerNorm with ``residual``)."""
    return _norm("layer_norm", x, w, b, n, eps, 0.0, y, residual, sum_out)


def linear_steps(x: NativeView, w: NativeView, bias: NativeView | None, y: NativeView, *,
                 scale: NativeView | None = None, accumulate: bool = False,
                 norm_weight: NativeView | None = None,
                 norm_eps: float | None = None,
                 residual: NativeView | None = None,
                 panels: NativeView | None = None, gated: str | None = None) -> list[Step]:
    """``y (+)= x @ w.T * scale + bias`` for ``x`` [..., K] and a row-major ``w`` [N, K]
    (its rows may be any stride apart); fp32 sums, one rounding into ``y`` [..., N]
    (``y``'s dtype may differ from x's: fp32 intermediates). With ``norm_eps`` the
    rows of x are RmsNorm'd first (weight ``norm_weight`` [K], optional), rounded to
    x's dtype as the RmsNorm kernel would store them. ``residual`` (shaped as ``y``,
    contiguous; not with ``accumulate``) is added to the result, one rounding.
    ``panels``: ``w`` packed in 32-output panels (:mod:`.native_panels`), streamed
    instead of ``w``. ``gated`` (an activation name): ``w`` is gate | up [2 I, K] given
    as float ``panels``, I a multiple of 32, and ``y`` [..., I] is
    ``act(x @ gate.T + b_gate) * (x @ up.T + b_up)`` (the torch binding's
    ``linear_rows(gated=...)``; no scale, accumulate or residual)."""
    op = "linear_rows"
    xdt = _float(op, "x", x)
    wdt = _float(op, "w", w, WEIGHT_CODES)
    if len(w.shape) != 2 or (w.shape[0] > 1 and w.strides[1] != 1 and w.shape[1] > 1):
        raise ShapeError(op, "'w'", "a [N, K] weight with unit-stride rows",
                         f"shape {list(w.shape)}, strides {list(w.strides)}")
    n, k = w.shape
    if not x.shape or x.shape[-1] != k or k == 0:
        raise ShapeError(op, "'x' last dim (K, w's columns)", k,
                         f"{x.shape[-1] if x.shape else None} (x {list(x.shape)})")
    rows = rows_of(op, "x", x, k)
    ydt = _float(op, "out", y)
    _contiguous(op, "out", y)
    gate = (0, 0)
    if gated is not None:
        if gated not in ACT_CODES or gated == "none" or panels is None or \
                w.dtype == Dtype.INT8 or n % (2 * PANEL):
            raise InputError(op, "gated", f"an activation over float gate | up panels "
                             f"[2 I, K], I a multiple of {PANEL}",
                             f"{gated!r}, {w.dtype.value} {list(w.shape)}, panels "
                             f"{'given' if panels is not None else 'None'}")
        if scale is not None or residual is not None or accumulate:
            raise InputError(op, "gated", "no scale, residual or accumulate beside it",
                             "one of them")
        gate = (n // 2 // PANEL, ACT_CODES[gated])
    if y.shape != (*x.shape[:-1], n // 2 if gated else n):
        raise ShapeError(op, "'out' shape", [*x.shape[:-1], n // 2 if gated else n],
                         list(y.shape))
    sp = _vector(op, "scale", scale, n)[0]
    if scale is not None and scale.dtype != Dtype.FP32:
        raise DtypeError(op, "'scale' dtype", "float32", scale.dtype.value)
    if w.dtype == Dtype.INT8 and scale is None:
        raise InputError(op, "scale", "a per-output-channel fp32 [N] scale for an int8 w",
                         "None")
    bp, bdt = _vector(op, "bias", bias, n)
    if norm_eps is None and norm_weight is not None:
        raise InputError(op, "norm_eps", "a number when norm_weight is given", "None")
    nwp, nwdt = _vector(op, "norm_weight", norm_weight, k)
    res = (0, 0, 0)
    if residual is not None:
        if accumulate:
            raise InputError(op, "residual", "None with accumulate=True (one addend)",
                             "a tensor")
        _contiguous(op, "residual", residual)
        if residual.shape != y.shape:
            raise ShapeError(op, "'residual' shape", list(y.shape), list(residual.shape))
        res = (residual.address, _float(op, "residual", residual), n)
    if rows == 0 or n == 0:
        return []
    n_out = n // 2 if gated else n
    head = (x.address, w.address if panels is None else panels.address, sp, bp, y.address,
            xdt, wdt, bdt, ydt, rows, k, n_out, k, w.strides[0] if n > 1 else k, n_out)
    tail = (THREADS, int(accumulate), int(norm_eps is not None), nwp, nwdt,
            float(norm_eps or 0.0), 0.0, int(panels is not None), *res, *gate)
    return [Step("linear_rows", LINEAR, (*head, *tail))]


def activation_steps(x: NativeView, act: str, y: NativeView, *, up: NativeView | None = None,
                     split: bool = False) -> list[Step]:
    """``y = act(x) [* up]`` in x's dtype (fp32 compute, one rounding); ``split``:
    ``x`` is ``[..., 2n]`` = gate | up."""
    op = "activation"
    dt = _float(op, "x", x)
    if act not in ACT_CODES:
        raise InputError(op, "act", "one of " + ", ".join(ACT_CODES), repr(act))
    if not x.shape:
        raise ShapeError(op, "'x' rank", ">= 1", 0)
    full = x.shape[-1]
    if split and (full % 2 or up is not None):
        raise ShapeError(op, "'x' with split=True (gate | up halves, no separate up)",
                         "an even last dim and up=None", list(x.shape))
    n = full // 2 if split else full
    rows = rows_of(op, "x", x, full) if full else 0
    _contiguous(op, "out", y)
    if y.shape != (*x.shape[:-1], n) or y.dtype != x.dtype:
        raise ShapeError(op, "'out'", f"{x.dtype.value} {[*x.shape[:-1], n]}",
                         f"{y.dtype.value} {list(y.shape)}")
    u, us = 0, 0
    if split:
        u, us = x.address + n * x.dtype.itemsize, full
    elif up is not None:
        _same(op, "up", up, x)
        u, us = up.address, n
    if rows == 0 or n == 0:
        return []
    return [Step("activation", ACT, (x.address, u, y.address, 0, 0, dt, 0, ACT_CODES[act],
                                      rows, n, full, us, n, THREADS))]


_NO_LEAD = (1,) * SM_DIMS + (0,) * SM_DIMS


def softmax_steps(x: NativeView, y: NativeView, *, scale: float = 1.0) -> list[Step]:
    """Softmax over the last axis of ``x * scale`` into ``y`` (fp32 compute)."""
    op = "softmax"
    dt = _float(op, "x", x)
    if not x.shape:
        raise ShapeError(op, "'x' rank", ">= 1", 0)
    _same(op, "out", y, x)
    n = x.shape[-1]
    if x.numel == 0:
        return []
    rows = rows_of(op, "x", x, n)
    return [Step("softmax", SOFTMAX, (x.address, y.address, 0, dt, 0, rows, n, n, n, 0, 0, 0, 1,
                                      *_NO_LEAD, 0, float(scale)))]


def copy_step(dst: NativeView, src: NativeView, op: str = "copy") -> Step:
    """Copy ``src`` into ``dst`` (same shape and dtype, both contiguous)."""
    _same(op, "source", src, dst)
    _contiguous(op, "destination", dst)
    return Step("memmove", None, (dst.address, src.address, dst.numel * dst.dtype.itemsize))
