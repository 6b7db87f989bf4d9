"""The w8a8 matmul C kernel on torch CPU tensors (``csrc/gemm_i8.c``): activations
quantized to 8 bits per row on the fly (the row's range over 255 codes, a zero point:
:func:`atbcore.ops.linear_quant.quantize_w8a8_rows`), int8 weights
with a per-output-channel fp32 scale, int32 sums (VNNI ``VPDPBUSD`` where the CPU
has it; on AVX2 ``VPMADDUBSW``/``VPMADDWD`` straight when the weights lie in
[-64, 64], as :func:`~atbcore.ops.linear_quant.quantize_w8a8` makes them, else with
``VPSIGNB`` first; an exact plain loop elsewhere: the same bits, with no int16
saturation at the int8 extremes), one rounding to the output.

    wq, s = atbcore.ops.linear_quant.quantize_w8a8(w)      # int8 [N, K], scale [N]
    packed = pack_w8a8(torch.from_numpy(wq))                # the kernel's layout
    y = linear_w8a8(x, packed, torch.from_numpy(s), bias=b) # x [..., K] -> [..., N]
"""

from __future__ import annotations

import torch

from atbcore.errors import ShapeError

from . import torch_checks as chk
from .threads import pool_threads
from .torch_linear import _Q, _linear_fields, check_epilogue, empty_result, result_buffer
from .torch_ops import DTYPE_CODES, _check, _deliver, _fn, _rows

__all__ = ["pack_w8a8", "w8a8_shape", "linear_w8a8", "linear_w8a8_bound",
           "quantize_rows_reference"]

PANEL = 32  # outputs per panel (ATB_GEMM_PANEL)
QUAD = 4    # k per VPDPBUSD lane


def w8a8_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """The packed layout of an int8 ``[n, k]`` weight: ``[P, K4 + 1, 32, 4]`` bytes,
    ``P = ceil(n / 32)`` panels, ``K4 = ceil(k / 4)`` rows of 4 k per output, and a
    last row holding the 32 outputs' int32 column sums."""
    return (-(-n // PANEL), -(-k // QUAD) + 1, PANEL, QUAD)


def pack_w8a8(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` int8 ``[N, K]`` in :func:`w8a8_shape`'s layout: ``p[i, q, j, t] =
    w[32 i + j, 4 q + t]`` (zeros past N and K), then per panel the int32 sums
    ``sum_k w[32 i + j, k]`` as the last row's bytes. ``out`` (that shape, int8,
    contiguous) receives it, e.g. an arena's huge pages."""
    chk.tensor("pack_w8a8", "w", w, (torch.int8,), dims=(2,))
    n, k = w.shape
    shape = w8a8_shape(n, k)
    if out is None:
        out = torch.empty(shape, dtype=torch.int8)
    if out.shape != shape or out.dtype != torch.int8 or not out.is_contiguous():
        raise ShapeError("pack_w8a8", "out", f"contiguous int8 {shape}",
                         f"{out.dtype} {tuple(out.shape)}")
    p, k4 = shape[0], shape[1] - 1
    padded = torch.zeros(p * PANEL, k4 * QUAD, dtype=torch.int8)
    padded[:n, :k] = w
    # [P*32, K4*4] -> [P, 32, K4, 4] -> [P, K4, 32, 4]
    out[:, :k4].copy_(padded.view(p, PANEL, k4, QUAD).transpose(1, 2))
    sums = padded.sum(dim=1, dtype=torch.int32).view(p, PANEL)         # [P, 32]
    out[:, k4].copy_(sums.contiguous().view(torch.int8).view(p, PANEL, QUAD))
    return out


def linear_w8a8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, accumulate: bool = False,
                threads: int | None = None, rms_norm_eps: float | None = None,
                rms_norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``quant(x) @ w.T * scale + bias`` for ``x`` [..., K] (fp32/bf16/fp16) and the
    int8 ``[N, K]`` weight packed by :func:`pack_w8a8` (``scale`` fp32 [N], the
    weight's per-channel scale). Each row of ``x`` (RmsNorm'd first with
    ``rms_norm_eps``) is quantized over its range (:func:`quantize_rows_reference`);
    ``residual`` (shaped
    as the output) is added, or with ``accumulate`` the result is added into ``out``.
    The result is in x's dtype unless ``out`` says otherwise."""
    op = "linear_w8a8"
    _check_args(op, x, packed, scale, bias, out, residual, accumulate, threads, rms_norm_eps,
                rms_norm_weight)
    k, n = x.shape[-1], scale.numel()
    shape = (*x.shape[:-1], n)
    if x.numel() == 0:
        return empty_result(x, out, shape, accumulate, residual)
    x2, rows, xs = _rows(x, k)
    y = result_buffer(x, out, shape, accumulate)
    scale, bias, nw = (None if t is None else t.contiguous()
                       for t in (scale, bias, rms_norm_weight))
    head, tail = _fields(x2, rows, xs, packed, scale, bias, y, accumulate, rms_norm_eps, nw,
                         residual)
    _check(_fn("linear_w8a8")(head + _Q.pack(threads or pool_threads()) + tail), op)
    return _deliver(out, y)


def linear_w8a8_bound(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                      out: torch.Tensor, *, bias: torch.Tensor | None = None,
                      accumulate: bool = False, rms_norm_eps: float | None = None,
                      rms_norm_weight: torch.Tensor | None = None):
    """:func:`linear_w8a8` of these very buffers, its arguments packed once: the
    returned ``call()`` reruns it (the pool's thread count read per call), for a
    prebuilt decode plan whose ``x`` and ``out`` are fixed. None when the buffers are
    not as the kernel reads them in place (x and out contiguous, out in a kernel
    dtype): then call :func:`linear_w8a8`. Bad arguments raise at bind time."""
    op = "linear_w8a8_bound"
    _check_args(op, x, packed, scale, bias, out, None, accumulate, None, rms_norm_eps,
                rms_norm_weight)
    k, n = x.shape[-1], scale.numel()
    if (x.numel() == 0 or not x.is_contiguous() or not out.is_contiguous()
            or out.shape != (*x.shape[:-1], n) or out.dtype not in DTYPE_CODES
            or not scale.is_contiguous() or (bias is not None and not bias.is_contiguous())
            or (rms_norm_weight is not None and not rms_norm_weight.is_contiguous())):
        return None
    head, tail = _fields(x, x.numel() // k, k, packed, scale, bias, out, accumulate,
                         rms_norm_eps, rms_norm_weight, None)
    fn = _fn("linear_w8a8")

    def call() -> None:
        _check(fn(head + _Q.pack(pool_threads()) + tail), "linear_w8a8")
    call.native = True  # type: ignore[attr-defined]  # one C call (runtime/native_run.py)
    call.keep = (x, packed, scale, out, bias, rms_norm_weight)  # type: ignore[attr-defined]
    return call


def _fields(x2, rows, xs, packed, scale, bias, y, accumulate, eps, nw, residual) -> tuple:
    """LinArgs around its threads field, the weight given by its packed panels."""
    w = torch.empty(scale.numel(), x2.shape[-1], dtype=torch.int8, device="meta")  # shape, dtype
    return _linear_fields(x2, rows, xs, w, scale, bias, y, accumulate, eps, nw, packed, residual)


def _check_args(op, x, packed, scale, bias, out, residual, accumulate, threads, rms_norm_eps,
                rms_norm_weight) -> None:
    chk.tensor(op, "x", x, dims=tuple(range(1, 65)))
    chk.tensor(op, "packed", packed, (torch.int8,), dims=(4,))
    chk.tensor(op, "scale", scale, (torch.float32,), dims=(1,))
    k, n = x.shape[-1], scale.numel()
    if k == 0 or n == 0:
        raise ShapeError(op, "K and N", ">= 1", f"K {k}, N {n}")
    if packed.shape != w8a8_shape(n, k) or not packed.is_contiguous():
        raise ShapeError(op, "packed", f"pack_w8a8 of an int8 [{n}, {k}] weight "
                         f"{w8a8_shape(n, k)}", tuple(packed.shape))
    chk.vector(op, "bias", bias, n)
    check_epilogue(op, (*x.shape[:-1], n), k, out, accumulate, residual, rms_norm_eps,
                   rms_norm_weight)
    if threads is not None:
        chk.integer(op, "threads", threads, 1, 1 << 16)


def quantize_rows_reference(x: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch (fp32, as the kernel computes it):
    ``(u uint8 [..., K], sx fp32 [...], z int32 [...])`` with ``x ~= (u - z[..., None]) *
    sx[..., None]``: the row's range ``[min(0, min x), max(0, max x)]`` over the codes
    1..255 (:func:`atbcore.ops.linear_quant.quantize_w8a8_rows`). For tests and for
    callers that want the quantization error of a layer."""
    xf = x.float()
    lo = xf.amin(dim=-1).clamp(max=0)
    rng = xf.amax(dim=-1).clamp(min=0) - lo
    inv = torch.where(rng > 0, torch.tensor(254.0) / rng, torch.zeros_like(rng))
    z = torch.where(rng > 0, 1 - torch.round(lo * inv), torch.full_like(rng, 128.0))
    u = (torch.round(xf * inv[..., None]) + z[..., None]).clamp_(1, 255).to(torch.uint8)
    return u, rng / 254.0, z.to(torch.int32)
