"""Group-wise 4-bit weights (w4) for the C matmul ``atb_linear_w4`` (csrc/linear_w4.c).

A weight ``W`` [N, K] is stored as 4-bit codes ``q`` in [0, 15] with an fp16 scale ``s``
and a zero point ``z`` per output and group of ``group`` inputs: ``W[n, k] = s (q - z)``.
Symmetric weights (:func:`quantize_w4` default, Q4_0's rule: the group's largest
magnitude maps to -8) have no stored zero points (z = 8); asymmetric ones (min/max per
group, and GPTQ/AWQ checkpoints) carry one per group. :func:`pack_w4` lays the codes
out in 32-output panels for the kernel, :func:`linear_w4` runs it::

    w4 = pack_w4(*quantize_w4(w))          # w: [N, K] float
    y = linear_w4(x, w4)                   # x: [..., K] -> [..., N]

The kernel quantizes activations per row and block of 32 to int8 (as llama.cpp does
for Q4_0), sums codes against them in int32 (VNNI) and scales in fp32.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

import torch

from atbcore.errors import InputError, ShapeError

from . import torch_checks as chk
from .threads import pool_threads
from .torch_ops import DTYPE_CODES, _check, _deliver, _fn, _rows

__all__ = ["W4Weight", "quantize_w4", "pack_w4", "linear_w4", "linear_w4_bound",
           "linear_w4_bound_io", "W4_BLOCK", "W4_PANEL"]

W4_PANEL = 32   # outputs per panel (linear_w4.c)
W4_BLOCK = 32   # inputs per activation block; a group is a multiple of it
_ARGS = struct.Struct("<20qd3q")  # W4Args (linear_w4.c)
_Q = struct.Struct("<q").pack


@dataclass(frozen=True, eq=False)
class W4Weight:
    """A packed w4 weight of ``n`` outputs and ``k`` inputs: ``codes`` uint8
    [P, K'/32, 512] (P = ceil(n / 32), K' = k rounded up to ``group``), ``scales``
    fp16 [P, K'/group, 32], ``zeros`` uint8 like scales or None (symmetric, z = 8)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    n: int
    k: int
    group: int

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: codes, scales and zero points."""
        ts = (self.codes, self.scales, self.zeros)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[n, k]`` these codes stand for, ``s (q - z)`` in ``dtype``."""
        p, nblk, _ = self.codes.shape
        v = self.codes.view(p, nblk, 8, 16, 4)                  # [P, blk, kk, j, t]
        lo, hi = v & 15, v >> 4
        q = torch.cat([lo, hi], dim=3)                          # [P, blk, kk, 32, t]
        q = q.permute(0, 3, 1, 2, 4).reshape(p * W4_PANEL, nblk * W4_BLOCK)
        s = self.scales.float().transpose(1, 2).reshape(p * W4_PANEL, -1)
        z = (self.zeros.float().transpose(1, 2).reshape(p * W4_PANEL, -1)
             if self.zeros is not None else torch.full_like(s, 8.0))
        rep = self.group
        w = (q.float() - z.repeat_interleave(rep, 1)) * s.repeat_interleave(rep, 1)
        return w[:self.n, :self.k].to(dtype)


def quantize_w4(w: torch.Tensor, group: int = 32, symmetric: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """``w`` [N, K] as ``(codes uint8 [N, K'], scales fp16 [N, K'/group], zeros uint8
    or None, group)``, K' = K rounded up to ``group`` (a multiple of 32; padding codes
    are z, i.e. zero weights). Symmetric: Q4_0's rule, ``s = m / -8`` for the group's
    value ``m`` of largest magnitude, ``q = clamp(round(w / s) + 8, 0, 15)``;
    asymmetric: ``s = (max - min) / 15``, ``z = clamp(round(-min / s), 0, 15)``,
    ``q = clamp(round(w / s) + z, 0, 15)``. Scales are rounded to fp16 before the codes
    are chosen."""
    chk.tensor("quantize_w4", "w", w, None, dims=(2,))
    if not isinstance(group, int) or group < W4_BLOCK or group % W4_BLOCK:
        raise InputError("quantize_w4", "group", f"a multiple of {W4_BLOCK}", repr(group))
    n, k = w.shape
    kg = -(-k // group) * group
    wf = torch.zeros(n, kg, dtype=torch.float32)
    wf[:, :k] = w.detach().float()
    g = wf.view(n, kg // group, group)                           # [N, G, group]
    if symmetric:
        idx = g.abs().argmax(dim=-1, keepdim=True)
        m = torch.gather(g, -1, idx).squeeze(-1)
        s = (m / -8.0).half()
        sf = s.float().unsqueeze(-1)
        inv = torch.where(sf != 0, 1.0 / sf, torch.zeros_like(sf))
        q = torch.clamp(torch.round(g * inv) + 8, 0, 15)
        zeros = None
    else:
        lo = g.amin(dim=-1).clamp(max=0.0)
        hi = g.amax(dim=-1).clamp(min=0.0)
        s = ((hi - lo) / 15.0).half()
        sf = s.float()
        inv = torch.where(sf != 0, 1.0 / sf, torch.zeros_like(sf))
        z = torch.clamp(torch.round(-lo * inv), 0, 15)
        q = torch.clamp(torch.round(g * inv.unsqueeze(-1)) + z.unsqueeze(-1), 0, 15)
        zeros = z.to(torch.uint8)
    return q.reshape(n, kg).to(torch.uint8), s, zeros, group


def pack_w4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            group: int, k: int | None = None) -> W4Weight:
    """Codes ``[N, K']`` (uint8 in [0, 15]), fp16 ``scales`` ``[N, K'/group]`` and
    optional uint8 ``zeros`` (same shape) in the kernel's panel layout; ``k`` (default
    K') is the weight's true input count (the rest is padding)."""
    n, kg = codes.shape
    if (codes.dtype != torch.uint8 or kg % group or group % W4_BLOCK
            or scales.shape != (n, kg // group)
            or (zeros is not None and zeros.shape != scales.shape)):
        raise ShapeError("pack_w4", "codes/scales/zeros", f"uint8 [N, K'] codes with K' a "
                         f"multiple of group ({group}, itself a multiple of 32) and [N, K'/group] "
                         "scales (and zeros)", f"{codes.dtype} {tuple(codes.shape)}, scales "
                         f"{tuple(scales.shape)}, zeros "
                         f"{None if zeros is None else tuple(zeros.shape)}")
    k = kg if k is None else k
    p = -(-n // W4_PANEL)
    nblk = kg // W4_BLOCK
    q = torch.zeros(p * W4_PANEL, kg, dtype=torch.uint8)
    q[:n] = codes
    q = q.view(p, 2, 16, nblk, 8, 4)                   # [P, half, j, blk, kk, t]
    packed = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 3, 1, 4)   # [P, blk, kk, j, t]
    packed = packed.reshape(p, nblk, 8 * 16 * 4).contiguous()

    def panel(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        full = torch.zeros(p * W4_PANEL, t.shape[1], dtype=dtype)
        full[:n] = t.to(dtype)
        return full.view(p, W4_PANEL, -1).transpose(1, 2).contiguous()

    sc = panel(scales, torch.float16)
    zs = None if zeros is None else panel(zeros, torch.uint8)
    return W4Weight(packed, sc, zs, n, k, group)


def _check_args(op: str, x, w4, bias, out, accumulate, eps, nw, residual=None) -> None:
    chk.tensor(op, "x", x, DTYPE_CODES, dims=tuple(range(1, 65)))
    if not isinstance(w4, W4Weight):
        raise InputError(op, "w4", "a W4Weight (pack_w4)", type(w4).__name__)
    if x.shape[-1] != w4.k:
        raise ShapeError(op, "'x' last dim (K, the weight's inputs)", w4.k, x.shape[-1])
    chk.vector(op, "bias", bias, w4.n)
    chk.output(op, "out", out, (*x.shape[:-1], w4.n))
    if accumulate and out is None:
        raise InputError(op, "out", "a tensor to accumulate into (accumulate=True)", "None")
    if residual is not None:
        chk.tensor(op, "residual", residual, DTYPE_CODES, dims=(residual.dim(),))
        if residual.shape != (*x.shape[:-1], w4.n):
            raise ShapeError(op, "residual", list((*x.shape[:-1], w4.n)), list(residual.shape))
        if accumulate:
            raise InputError(op, "residual", "None with accumulate=True (one addend)",
                             "a tensor")
    if eps is not None:
        chk.real(op, "rms_norm_eps", eps)
    elif nw is not None:
        raise InputError(op, "rms_norm_eps", "a number when rms_norm_weight is given", "None")
    chk.vector(op, "rms_norm_weight", nw, w4.k)


def _pack(x2, rows, xs, w4, bias, y, accumulate, eps, nw, threads, res=None) -> bytes:
    return _ARGS.pack(
        x2.data_ptr(), DTYPE_CODES[x2.dtype], xs, rows, w4.k, w4.n,
        w4.codes.data_ptr(), w4.scales.data_ptr(),
        0 if w4.zeros is None else w4.zeros.data_ptr(), w4.group,
        0 if bias is None else bias.data_ptr(), 0 if bias is None else DTYPE_CODES[bias.dtype],
        y.data_ptr(), DTYPE_CODES[y.dtype], w4.n, int(accumulate),
        int(eps is not None), 0 if nw is None else nw.data_ptr(),
        0 if nw is None else DTYPE_CODES[nw.dtype], threads, float(eps or 0.0),
        0 if res is None else res.data_ptr(), 0 if res is None else DTYPE_CODES[res.dtype],
        w4.n)


def linear_w4(x: torch.Tensor, w4: W4Weight, *, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None, accumulate: bool = False,
              threads: int | None = None, rms_norm_eps: float | None = None,
              rms_norm_weight: torch.Tensor | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias (+ residual)`` for ``x`` [..., K] (fp32/bf16/fp16) and a packed w4
    weight, at any row count; ``accumulate`` adds into ``out``; ``residual`` (shaped like
    the result, may be ``out`` itself) is added in the epilogue, in fp32 before the one
    rounding; ``rms_norm_eps`` RmsNorms x first (as the separate kernel would store it).
    ``threads`` defaults to the pool's count."""
    _check_args("linear_w4", x, w4, bias, out, accumulate, rms_norm_eps, rms_norm_weight,
                residual)
    if threads is not None:
        chk.integer("linear_w4", "threads", threads, 1, 1 << 16)
    shape = (*x.shape[:-1], w4.n)
    if x.numel() == 0:
        return out if out is not None else torch.empty(shape, dtype=x.dtype)
    x2, rows, xs = _rows(x, w4.k)
    y = out if (out is not None and out.dtype in DTYPE_CODES and out.is_contiguous()) else None
    if y is None:
        y = out.contiguous() if accumulate else torch.empty(shape, dtype=x.dtype)
    res = None if residual is None else residual.contiguous()
    bias = None if bias is None else bias.contiguous()
    nw = None if rms_norm_weight is None else rms_norm_weight.contiguous()
    _check(_fn("linear_w4")(_pack(x2, rows, xs, w4, bias, y, accumulate, rms_norm_eps, nw,
                                  threads or pool_threads(), res)), "linear_w4")
    return _deliver(out, y)


def _bindable(x, w4, out, bias, nw, residual) -> bool:
    """Whether the kernel reads these buffers in place (contiguous, kernel dtypes)."""
    return not (x.numel() == 0 or not x.is_contiguous() or not out.is_contiguous()
                or out.dtype not in DTYPE_CODES
                or (residual is not None and not residual.is_contiguous())
                or (bias is not None and not bias.is_contiguous())
                or (nw is not None and not nw.is_contiguous()))


def linear_w4_bound(x: torch.Tensor, w4: W4Weight, out: torch.Tensor, *,
                    bias: torch.Tensor | None = None, accumulate: bool = False,
                    rms_norm_eps: float | None = None,
                    rms_norm_weight: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None
                    ) -> Callable[[], None] | None:
    """:func:`linear_w4` of these fixed buffers with its arguments packed once (a
    prebuilt decode plan's call; the pool's thread count is read per call). None when
    x, out or residual are not contiguous kernel dtypes."""
    _check_args("linear_w4_bound", x, w4, bias, out, accumulate, rms_norm_eps,
                rms_norm_weight, residual)
    if not _bindable(x, w4, out, bias, rms_norm_weight, residual):
        return None
    rows = x.numel() // w4.k
    head = _pack(x, rows, w4.k, w4, bias, out, accumulate, rms_norm_eps, rms_norm_weight, 0,
                 residual)
    cut = _ARGS.size - 40           # threads, norm_eps, res, res_dt, res_stride
    pre, post = head[:cut], head[cut + 8:]
    fn = _fn("linear_w4")
    packed: dict[int, bytes] = {}  # per thread count: the whole argument block

    def call() -> None:
        n = pool_threads()
        args = packed.get(n)
        if args is None:
            args = packed[n] = pre + _Q(n) + post
        _check(fn(args), "linear_w4")
    call.keep = (x, w4, out, bias, rms_norm_weight, residual)  # type: ignore[attr-defined]
    call.native = True  # type: ignore[attr-defined]  # one C call (runtime/native_run.py)
    return call


def linear_w4_bound_io(x_like: torch.Tensor, w4: W4Weight, out_like: torch.Tensor, *,
                       bias: torch.Tensor | None = None,
                       rms_norm_eps: float | None = None,
                       rms_norm_weight: torch.Tensor | None = None,
                       residual_like: torch.Tensor | None = None
                       ) -> Callable[..., None] | None:
    """:func:`linear_w4_bound` for an input, output (and residual) that change per call
    (a plan's input or fresh output): ``call(x, out)`` or ``call(x, out, residual)``
    checks only that each is a contiguous CPU tensor shaped and typed like its
    ``*_like`` (checked fully now) and packs the addresses. None where
    :func:`linear_w4_bound` would be None."""
    if linear_w4_bound(x_like, w4, out_like, bias=bias, rms_norm_eps=rms_norm_eps,
                       rms_norm_weight=rms_norm_weight, residual=residual_like) is None:
        return None
    rows = x_like.numel() // w4.k
    fields = list(_ARGS.unpack(_pack(x_like, rows, w4.k, w4, bias, out_like, False,
                                     rms_norm_eps, rms_norm_weight, 0, residual_like)))
    want = [("x", x_like.shape, x_like.dtype, 0), ("out", out_like.shape, out_like.dtype, 12)]
    if residual_like is not None:
        want.append(("residual", residual_like.shape, residual_like.dtype, 21))
    fn = _fn("linear_w4")

    def call(*ts: torch.Tensor) -> None:
        if len(ts) != len(want):
            raise InputError("linear_w4", "tensors of the bound call",
                             ", ".join(w[0] for w in want), len(ts))
        for (name, sh, dt, at), t in zip(want, ts):
            if t.shape != sh or t.dtype != dt or not t.is_contiguous() or t.device.type != "cpu":
                raise ShapeError("linear_w4", name, f"a contiguous CPU {dt} {list(sh)}",
                                 f"{t.dtype} {list(t.shape)} on {t.device}")
            fields[at] = t.data_ptr()
        fields[19] = pool_threads()
        _check(fn(_ARGS.pack(*fields)), "linear_w4")
    call.keep = (w4, bias, rms_norm_weight)  # type: ignore[attr-defined]
    call.native = True  # type: ignore[attr-defined]  # one C call (runtime/native_run.py)
    return call
