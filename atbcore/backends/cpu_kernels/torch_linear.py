"""The few-row matmul C kernel on torch CPU tensors (decode GEMV and small-batch
GEMM, optionally RmsNorm'd rows and a residual add; 32-output weight panels at any
row count), with its bound form for prebuilt decode plans. Re-exported by
:mod:`.torch_decode`, where its callers import it.
"""

from __future__ import annotations

import struct
from typing import Callable

import torch

from atbcore.errors import InputError, ShapeError

from . import native
from . import torch_checks as chk
from .threads import pool_threads
from .torch_ops import DTYPE_CODES, _check, _deliver, _fn, _rows

__all__ = ["linear_rows", "linear_rows_bound", "linear_rows_bound_out", "linear_rows_bound_io",
           "pack_panels", "PANEL",
           "LINEAR_WEIGHT_DTYPES"]

# weight dtypes of the few-row matmul (int8 takes a per-output-channel fp32 scale)
LINEAR_WEIGHT_DTYPES = {d.torch: c for d, c in native.WEIGHT_CODES.items()}

PANEL = native.PANEL  # outputs per panel of a packed weight


def pack_panels(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` [N, K] (fp32/bf16/fp16/int8) as ceil(N / 32) panels ``[P, K, 32]`` of its
    dtype (``p[i, k, j] = w[32 i + j, k]``, zeros past N): the layout
    :func:`linear_rows` streams with ``panels=``. ``out`` (that shape and dtype,
    contiguous) receives it, e.g. an arena's huge pages."""
    chk.tensor("pack_panels", "w", w, None)
    if out is not None:
        chk.tensor("pack_panels", "out", out, None)
    if w.dim() != 2 or w.dtype not in LINEAR_WEIGHT_DTYPES:
        raise ShapeError("pack_panels", "w", "an fp32/bf16/fp16/int8 [N, K] weight",
                         f"{w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    p = -(-n // PANEL)
    if out is None:
        out = torch.empty(p, k, PANEL, dtype=w.dtype)
    if out.shape != (p, k, PANEL) or out.dtype != w.dtype or not out.is_contiguous():
        raise ShapeError("pack_panels", "out", f"contiguous {w.dtype} {(p, k, PANEL)}",
                         f"{out.dtype} {tuple(out.shape)}")
    if n % PANEL:
        out[-1].zero_()
    full = n // PANEL
    out[:full].copy_(w[:full * PANEL].view(full, PANEL, k).transpose(1, 2))
    if n % PANEL:
        out[full, :, :n % PANEL].copy_(w[full * PANEL:].t())
    return out


def empty_result(x: torch.Tensor, out: torch.Tensor | None, shape: tuple, accumulate: bool,
                 residual: torch.Tensor | None) -> torch.Tensor:
    """A matmul's result when there is nothing to multiply (no rows or no outputs):
    ``out`` as it is when accumulating, else the residual (or an empty result)."""
    if accumulate:
        return out
    y = out if out is not None else torch.empty(shape, dtype=x.dtype)
    return y.copy_(residual) if residual is not None else y


def result_buffer(x: torch.Tensor, out: torch.Tensor | None, shape: tuple,
                  accumulate: bool) -> torch.Tensor:
    """Where the C matmul writes: ``out`` itself when it is a contiguous result of a
    C dtype, else a contiguous copy to accumulate into, else a new tensor (handed to
    ``out`` afterwards by ``_deliver``)."""
    if (out is not None and out.shape == shape and out.dtype in DTYPE_CODES
            and out.is_contiguous()):
        return out
    return out.contiguous() if accumulate else torch.empty(shape, dtype=x.dtype)


def linear_rows(x: torch.Tensor, w: torch.Tensor, *, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                accumulate: bool = False, threads: int | None = None,
                rms_norm_eps: float | None = None,
                rms_norm_weight: torch.Tensor | None = None,
                panels: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, gated: str | None = None) -> torch.Tensor:
    """``x @ w.T * scale + bias`` for few rows of ``x`` [..., K] (``w`` [N, K]); with
    ``accumulate`` the result is added into ``out``, with ``residual`` (shaped as the
    output, contiguous; not with ``accumulate``) that tensor is added (it may be
    ``out`` itself). fp32 sums, one rounding. ``threads``
    (default torch's intra-op count) is the most pool threads the weight rows split over.
    With ``rms_norm_eps``, ``x`` is RmsNorm'd first (``rms_norm_weight`` optional), rounded
    to x's dtype exactly as the separate RmsNorm kernel would store it. ``panels``:
    ``w`` packed by :func:`pack_panels`, which the kernel then reads instead of ``w``
    (x broadcast against 32-output panel rows, K summed in blocks of 128), at any
    row count: more than 64 rows run in 64-row blocks on torch's OpenMP team.
    An int8 ``w`` needs ``scale`` (fp32 [N]) and reads each row of ``x`` as int8 blocks of
    32 inputs (one fp32 scale each, :func:`atbcore.ops.linear_quant.act_q8`: integer dot
    products, as llama.cpp's Q8_0); ``bias`` is [N].

    ``gated`` (an activation of the C activation kernel, e.g. ``"silu"``): ``w`` is
    gate | up ``[2 I, K]`` given as ``panels``, I a multiple of 32, and the result is
    ``act(x @ gate.T + b_gate) * (x @ up.T + b_up)`` ``[..., I]`` -- a gated FFN's first
    projection and its activation in one pass, the bits of the plain call into an fp32
    buffer followed by the activation kernel (no scale, accumulate or residual)."""
    _linear_check("linear_rows", x, w, scale, bias, out, accumulate, rms_norm_eps,
                  rms_norm_weight, panels, residual, gated)
    if threads is not None:
        chk.integer("linear_rows", "threads", threads, 1, 1 << 16)
    k, n = x.shape[-1], _out_features(w, gated)
    shape = (*x.shape[:-1], n)
    if x.numel() == 0 or n == 0:  # no rows or no outputs: the C kernel has nothing to do
        return empty_result(x, out, shape, accumulate, residual)
    x2, rows, xs = _rows(x, k)
    y = result_buffer(x, out, shape, accumulate)
    if not w.is_contiguous():
        w = w.contiguous()
    if rms_norm_weight is not None and not rms_norm_weight.is_contiguous():
        rms_norm_weight = rms_norm_weight.contiguous()
    if scale is not None and not scale.is_contiguous():
        scale = scale.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    head, tail = _linear_fields(x2, rows, xs, w, scale, bias, y, accumulate, rms_norm_eps,
                                rms_norm_weight, panels, residual, gated)
    _check(_fn("linear_rows")(head + _Q.pack(threads or pool_threads()) + tail), "linear_rows")
    return _deliver(out, y)


def check_epilogue(op: str, shape: tuple, k: int, out, accumulate, residual, eps, nw) -> None:
    """A C matmul's output side: ``out`` (``shape``; required to accumulate into), the
    ``residual`` added in the epilogue (not with ``accumulate``), and the RmsNorm of the
    rows read first (``eps``, optional weight ``nw`` [K])."""
    chk.output(op, "out", out, shape)
    if accumulate and out is None:
        raise InputError(op, "out", "a tensor to accumulate into (accumulate=True)", "None")
    if residual is not None:
        if accumulate:
            raise InputError(op, "residual", "None with accumulate=True (one addend)",
                             "a tensor")
        chk.tensor(op, "residual", residual, DTYPE_CODES)
        if residual.shape != shape or not residual.is_contiguous():
            raise ShapeError(op, "'residual'", f"a contiguous {list(shape)} tensor",
                             f"{list(residual.shape)}, strides {list(residual.stride())}")
    if eps is not None:
        chk.real(op, "rms_norm_eps", eps)
    elif nw is not None:
        raise InputError(op, "rms_norm_eps", "a number when rms_norm_weight is given", "None")
    chk.vector(op, "rms_norm_weight", nw, k)


def _out_features(w: torch.Tensor, gated: str | None) -> int:
    """The outputs of a matmul on ``w`` [N, K]: N, or N / 2 for a gated one."""
    return w.shape[0] // 2 if gated is not None else w.shape[0]


def _check_gated(op: str, w, scale, accumulate, panels, residual, gated) -> None:
    """A gated call (see :func:`linear_rows`): float panels of gate | up, I = N / 2 a
    multiple of 32, an activation the C kernel has, nothing else in the epilogue."""
    if gated not in native.ACT_CODES or gated == "none":
        raise InputError(op, "gated", "None or one of " + ", ".join(
            a for a in native.ACT_CODES if a != "none"), repr(gated))
    if panels is None or w.dtype == torch.int8:
        raise InputError(op, "gated", "float weights given as panels", f"{w.dtype} weights"
                         + ("" if panels is not None else " without panels"))
    if w.shape[0] % (2 * PANEL):
        raise ShapeError(op, "w (gated: gate | up)", f"[2 I, K] with I a multiple of {PANEL}",
                         list(w.shape))
    for name, v in (("scale", scale), ("residual", residual)):
        if v is not None:
            raise InputError(op, name, "None in a gated call", "a tensor")
    if accumulate:
        raise InputError(op, "accumulate", "False in a gated call", "True")


def _linear_check(op: str, x, w, scale, bias, out, accumulate, eps, nw, panels,
                  residual=None, gated=None) -> None:
    """Every tensor of a few-row matmul against ``x`` [..., K] and ``w`` [N, K]."""
    chk.tensor(op, "x", x, dims=tuple(range(1, 65)))
    # with panels, w only gives the shape and dtype (it may be a meta tensor)
    chk.tensor(op, "w", w, LINEAR_WEIGHT_DTYPES, dims=(2,), cpu=panels is None)
    if gated is not None:
        _check_gated(op, w, scale, accumulate, panels, residual, gated)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ShapeError(op, "'x' last dim (K, w's columns)", k,
                         f"{x.shape[-1]} (x {list(x.shape)}, w {list(w.shape)})")
    if k == 0:
        raise ShapeError(op, "K (the summed dim)", ">= 1", 0)
    chk.vector(op, "scale", scale, n, (torch.float32,))
    if w.dtype == torch.int8 and scale is None:
        raise InputError(op, "scale", "a per-output-channel fp32 [N] scale for an int8 w",
                         "None")
    chk.vector(op, "bias", bias, n)
    check_epilogue(op, (*x.shape[:-1], _out_features(w, gated)), k, out, accumulate, residual,
                   eps, nw)
    if panels is not None:
        chk.tensor(op, "panels", panels, LINEAR_WEIGHT_DTYPES)
        if not _panels_fit(panels, w):
            raise ShapeError(op, "panels", f"pack_panels of the {w.dtype} [{n}, {k}] "
                             "weight", f"{panels.dtype} {tuple(panels.shape)}")


def _panels_fit(panels: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``panels`` is :func:`pack_panels`' layout of a weight shaped like ``w``."""
    n, k = w.shape
    return (panels.dtype == w.dtype and panels.is_contiguous()
            and panels.shape == (-(-n // PANEL), k, PANEL))


_Q = native.Q
_LINEAR_HEAD = native.LINEAR_HEAD  # LinArgs up to threads
_LINEAR_TAIL = native.LINEAR_TAIL  # after threads


def _linear_fields(x2, rows, xs, w, scale, bias, y, accumulate, eps, nw, panels,
                   residual=None, gated=None) -> tuple:
    """LinArgs packed around its threads field: (before, after)."""
    k, n = x2.shape[-1], _out_features(w, gated)
    head = _LINEAR_HEAD.pack(
        x2.data_ptr(), w.data_ptr() if panels is None else panels.data_ptr(),
        0 if scale is None else scale.data_ptr(),
        0 if bias is None else bias.data_ptr(), y.data_ptr(), DTYPE_CODES[x2.dtype],
        LINEAR_WEIGHT_DTYPES[w.dtype], 0 if bias is None else DTYPE_CODES[bias.dtype],
        DTYPE_CODES[y.dtype], rows, k, n, xs, w.stride(0), n)
    tail = _LINEAR_TAIL.pack(
        int(accumulate), int(eps is not None), 0 if nw is None else nw.data_ptr(),
        0 if nw is None else DTYPE_CODES[nw.dtype], float(eps or 0.0), 0.0,
        int(panels is not None), *_residual_fields(residual, n),
        *((0, 0) if gated is None else (n // PANEL, native.ACT_CODES[gated])))
    return head, tail


def _residual_fields(residual: torch.Tensor | None, n: int) -> tuple[int, int, int]:
    """LinArgs' res, res_dt, res_stride (rows ``n`` apart, checked contiguous)."""
    if residual is None:
        return 0, 0, 0
    return residual.data_ptr(), DTYPE_CODES[residual.dtype], n


def linear_rows_bound(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *,
                      scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                      accumulate: bool = False, rms_norm_eps: float | None = None,
                      rms_norm_weight: torch.Tensor | None = None,
                      panels: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None,
                      gated: str | None = None) -> Callable[[], None] | None:
    """:func:`linear_rows` of these very buffers, its arguments packed once: the
    returned ``call()`` reruns it (the pool's thread count read per call), for a
    prebuilt decode plan whose ``x`` and ``out`` are fixed. None when the buffers are
    not as the kernel reads them in place (x and out contiguous, out [..., N] in a
    kernel dtype, w contiguous or given as panels): then call :func:`linear_rows`.
    Bad arguments raise as in :func:`linear_rows`, here at bind time."""
    _linear_check("linear_rows_bound", x, w, scale, bias, out, accumulate, rms_norm_eps,
                  rms_norm_weight, panels, residual, gated)
    k, n = x.shape[-1], _out_features(w, gated)
    if x.numel() == 0 or n == 0:
        return None
    if (not x.is_contiguous() or (scale is not None and not scale.is_contiguous())
            or (bias is not None and not bias.is_contiguous()) or out.shape != (*x.shape[:-1], n) or not out.is_contiguous()
            or out.dtype not in DTYPE_CODES or x.dtype not in DTYPE_CODES
            or (panels is None and not w.is_contiguous())
            or (rms_norm_weight is not None and (not rms_norm_weight.is_contiguous()
                                                 or rms_norm_weight.numel() != k))
            or (panels is not None and not _panels_fit(panels, w))):
        return None
    head, tail = _linear_fields(x, x.numel() // k, k, w, scale, bias, out, accumulate,
                                rms_norm_eps, rms_norm_weight, panels, residual, gated)
    fn, keep = _fn("linear_rows"), (x, w, out, scale, bias, rms_norm_weight, panels, residual)

    def call() -> None:
        _check(fn(head + _Q.pack(pool_threads()) + tail), "linear_rows")
    call.keep = keep  # type: ignore[attr-defined]  # the buffers live as long as the call
    call.native = True  # type: ignore[attr-defined]  # one C call (runtime/native_run.py)
    return call


_LINEAR_REST = struct.Struct("<10q")  # after it, up to threads


def linear_rows_bound_out(x: torch.Tensor, w: torch.Tensor, out_like: torch.Tensor, *,
                          scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                          accumulate: bool = False, rms_norm_eps: float | None = None,
                          rms_norm_weight: torch.Tensor | None = None,
                          panels: torch.Tensor | None = None
                          ) -> Callable[[torch.Tensor], None] | None:
    """:func:`linear_rows_bound` for a fixed ``x`` and an output that changes per call
    (a plan's fresh output tensor): ``call(out)`` checks only that ``out`` is shaped,
    typed and laid out like ``out_like`` (checked fully now) and packs its address.
    None where :func:`linear_rows_bound` would be None."""
    io = linear_rows_bound_io(x, w, out_like, scale=scale, bias=bias, accumulate=accumulate,
                              rms_norm_eps=rms_norm_eps, rms_norm_weight=rms_norm_weight,
                              panels=panels)
    if io is None:
        return None

    def call(out: torch.Tensor) -> None:
        io(x, out)
    call.keep = (x, io)  # type: ignore[attr-defined]
    return call


def linear_rows_bound_io(x_like: torch.Tensor, w: torch.Tensor, out_like: torch.Tensor, *,
                         scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         accumulate: bool = False, rms_norm_eps: float | None = None,
                         rms_norm_weight: torch.Tensor | None = None,
                         panels: torch.Tensor | None = None,
                         residual_like: torch.Tensor | None = None, gated: str | None = None
                         ) -> Callable[..., None] | None:
    """:func:`linear_rows_bound` for an input and an output that change per call (a
    plan's input and fresh output): ``call(x, out)`` checks only that each is a
    contiguous CPU tensor shaped and typed like ``x_like`` / ``out_like`` (checked
    fully now) and packs their addresses. With ``residual_like`` the call is
    ``call(x, out, residual)``, the residual checked and packed the same way. None
    where :func:`linear_rows_bound` would be None."""
    if linear_rows_bound(x_like, w, out_like, scale=scale, bias=bias, accumulate=accumulate,
                         rms_norm_eps=rms_norm_eps, rms_norm_weight=rms_norm_weight,
                         panels=panels, residual=residual_like, gated=gated) is None:
        return None
    k = x_like.shape[-1]
    head, tail = _linear_fields(x_like, x_like.numel() // k, k, w, scale, bias, out_like,
                                accumulate, rms_norm_eps, rms_norm_weight, panels,
                                residual_like, gated)
    fields = _LINEAR_HEAD.unpack(head)
    mid, after = _LINEAR_W.pack(*fields[1:4]), _LINEAR_REST.pack(*fields[5:])
    tail_pre, tail_res = tail[:_TAIL_RES], tail[_TAIL_RES + 8:]  # the residual's address cut out
    want = [("x", x_like.shape, x_like.dtype), ("out", out_like.shape, out_like.dtype)]
    if residual_like is not None:
        want.append(("residual", residual_like.shape, residual_like.dtype))
    fn, q = _fn("linear_rows"), _Q.pack
    keep = (w, scale, bias, rms_norm_weight, panels)

    def check(ts: tuple) -> None:
        for (name, sh, dt), t in zip(want, ts):
            if t.shape != sh or t.dtype != dt or not t.is_contiguous() or t.device.type != "cpu":
                raise ShapeError("linear_rows", name, f"a contiguous CPU {dt} {list(sh)}",
                                 f"{t.dtype} {list(t.shape)} on {t.device}")

    if residual_like is None:
        def call(x: torch.Tensor, out: torch.Tensor) -> None:
            check((x, out))
            _check(fn(q(x.data_ptr()) + mid + q(out.data_ptr()) + after + q(pool_threads())
                      + tail), "linear_rows")
    else:
        def call(x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> None:
            check((x, out, residual))
            _check(fn(q(x.data_ptr()) + mid + q(out.data_ptr()) + after + q(pool_threads())
                      + tail_pre + q(residual.data_ptr()) + tail_res), "linear_rows")
    call.keep = keep  # type: ignore[attr-defined]
    call.native = True  # type: ignore[attr-defined]  # one C call (runtime/native_run.py)
    return call


# byte offset of LinArgs.res in the tail (after threads): 4 int64, 2 doubles, packed
_TAIL_RES = struct.calcsize("<4q2dq")


_LINEAR_W = struct.Struct("<3q")  # LinArgs between the input and output addresses
