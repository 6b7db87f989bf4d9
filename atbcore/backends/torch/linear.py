"""Torch kernels for Linear (dense and weight-only int8) and MatMul.

On the CPU the C matmul (:mod:`.linear_cpu`, panel-packed weights) takes every call it
can, at every row count: at prefill and encoder-batch shapes it matched or beat oneDNN's
GEMM, which ran here for many rows before, and one path keeps one copy of each weight.
Dense calls it cannot take: ``F.linear`` on the CPU; for one-row fp32 inputs with out >= in, a GEMV
against a cached pre-transposed contiguous copy of the weight is faster (measured
1.1-1.5x at 2k-32k outputs, 2 threads) and is used once a weight has been seen
twice (so per-call temporary weights never pay for a copy). CUDA half types use
cuBLAS with an fp32 output (:func:`mm_fp32`) so they round once.

w8: ``torch.ops.aten._weight_int8pack_mm(x [M, K], w int8 [N, K], scales [N])``
(output dtype = x dtype, scales must have x's dtype) where it applies and pays;
otherwise dequantize and GEMM in fp32. :func:`w8_plan` says which path a call
takes and why (logged at DEBUG).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F

from ...log import logger
from . import kernel
from .linear_cpu import bind_cpu_linear, cpu_linear, is_packed, plain_ins, why_not_cpu_linear
from .linear_quant import quant_linear_torch

__all__ = ["w8_plan", "mm_fp32", "transposed_weight_cache", "TransposedWeightCache"]

# Above this many rows the fp32/fp16 int8pack CPU kernel loses to dequantize + GEMM
# (measured 2048x2048: 4 rows ~ break-even, 16 rows 10x slower).
_INT8PACK_MAX_ROWS = 4


def w8_plan(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, transpose_weight: bool,
            has_bias: bool = False) -> tuple[str, str]:
    """``("int8pack", "")``, ``("int8pack_fp32", why)`` or ``("dequant", why)``."""
    rows = x.numel() // max(x.shape[-1], 1)
    k = x.shape[-1]
    if not transpose_weight:
        return "dequant", "weight given [in, out]; int8pack needs [out, in]"
    if x.device.type == "cpu":
        why = ""
        if x.dtype == torch.bfloat16:
            # torch 2.13's bf16 CPU kernel loads activation rows 32-byte aligned: with
            # K % 16 != 0 (or an unaligned x) it returns garbage or crashes (K = 8, 72,
            # 769 measured). _w8_linear re-aligns x; other K take the fp32 paths.
            if k % 16:
                why = f"bf16 int8pack needs in_features % 16 == 0, given {k}"
            elif scale.dtype != torch.bfloat16:
                # the kernel wants scales in x's dtype; rounding fp32 scales to bf16
                # would add a second rounding (2 ulp errors measured)
                why = f"bf16 int8pack needs bf16 scales, given {str(scale.dtype)[6:]}"
            elif has_bias:
                # its output is already rounded to bf16; adding the bias rounds again
                why = "bias: the bf16 int8pack output would be rounded twice"
            else:
                return "int8pack", ""
        if rows <= _INT8PACK_MAX_ROWS:
            return "int8pack_fp32", why or "fp32 compute for fp32/fp16 activations"
        return "dequant", (why + "; " if why else "") + (
            f"{rows} rows > {_INT8PACK_MAX_ROWS}: dequantize + GEMM is faster on CPU")
    if x.device.type == "cuda":
        # measured on an H200 (torch 2.11, 4096x4096): aten int8pack 127 us at 1 row,
        # 618 us at 16; dequantize + cuBLAS 68-82 us at any row count up to 256
        return "dequant", "on CUDA dequantize + cuBLAS is faster than aten int8pack"
    return "dequant", f"no int8pack kernel on {x.device.type}"


_HALF = (torch.float16, torch.bfloat16)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` [M, K] @ ``b`` [K, N] accumulated and returned in fp32, so that half
    types round once, at the caller. On CUDA half inputs go straight to cuBLAS
    with an fp32 output (no weight copy): its default bf16 GEMM may reduce split-K
    partial sums in bf16 (measured 7e-3 relative error at K = 769, 0.2 at K = 2049)."""
    if a.device.type == "cuda" and a.dtype in _HALF and b.dtype == a.dtype:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without aten::mm.dtype
            pass
    return torch.mm(a.float(), b.float())


def _w8_linear(p, x, w, b, s):
    from .linear_quant import _quant_x

    path, why = w8_plan(x, w, s, p.transpose_weight, b is not None)
    if why:
        logger.debug("Linear w8: %s (%s)", path, why)
    k = x.shape[-1]
    # x as the C kernel reads it: int8 blocks of 32 per row (ops.linear_quant.act_q8), in
    # fp32 (a bf16 copy would round q * dx again), so the bf16 int8pack runs in fp32
    x2 = _quant_x(x.reshape(-1, k).float(), 32)[:, :k].contiguous()  # [M, K] fp32
    if path in ("int8pack", "int8pack_fp32"):
        y = torch.ops.aten._weight_int8pack_mm(x2.float().contiguous(), w.contiguous(), s.float())
        if b is not None:
            y = y + b.float()
        y = y.to(x.dtype)
    else:
        wt = w.t() if p.transpose_weight else w                            # [K, N]
        y = mm_fp32(x2, wt) * s.float()                                    # scale per column
        if b is not None:
            y = y + b.float()
        y = y.to(x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class TransposedWeightCache:
    """Pre-transposed contiguous copies of weights, keyed by tensor identity.

    An entry is valid while the weight object is alive and unchanged (same data
    pointer, shape and in-place version counter); it is dropped when the weight is
    freed, and the least recently used copies go when ``max_bytes`` is exceeded. A
    copy is made the second time a weight is seen, so one-off weights cost nothing.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._lock = threading.RLock()  # a weakref callback may fire inside get()
        self._entries: OrderedDict[int, list] = OrderedDict()  # id -> [ref, sig, wt | None]

    @staticmethod
    def _sig(w: torch.Tensor) -> tuple:
        return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w._version)

    def get(self, w: torch.Tensor) -> torch.Tensor | None:
        """The transposed copy ``[in, out]`` of ``w`` [out, in], or None (not yet)."""
        if w.numel() * w.element_size() > self.max_bytes or w.is_inference():
            return None  # inference tensors have no version counter to catch updates
        key, sig = id(w), self._sig(w)
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e[0]() is w and e[1] == sig:
                self._entries.move_to_end(key)
                if e[2] is None:
                    e[2] = w.t().contiguous()
                    self.bytes += e[2].numel() * e[2].element_size()
                    self._evict()
                return e[2]
            self._drop(key)
            ref = weakref.ref(w, lambda _r, k=key: self._forget(k, _r))
            self._entries[key] = [ref, sig, None]
            return None

    def _forget(self, key: int, ref: Any) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e[0] is ref:
                self._drop(key)

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key, None)
        if e is not None and e[2] is not None:
            self.bytes -= e[2].numel() * e[2].element_size()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e[2] is not None)


transposed_weight_cache = TransposedWeightCache(
    int(float(os.environ.get("ATB_LINEAR_WT_CACHE_MB", "256")) * 2**20))


def _dense_linear(p, x, w, b):
    wv = w if p.transpose_weight else w.t()                # [out, in] (a view)
    if b is not None and b.dtype != x.dtype:               # e.g. an fp32 bias for a bf16 layer:
        return F.linear(x.float(), wv.float(), b.float()).to(x.dtype)   # fp32, round once
    if (p.transpose_weight and x.device.type == "cpu" and x.dtype == torch.float32
            and x.numel() == x.shape[-1] and w.shape[0] >= w.shape[1] and w.is_contiguous()):
        wt = transposed_weight_cache.get(w)                # [in, out]
        if wt is not None:
            y = torch.matmul(x, wt)
            return y if b is None else y.add_(b)
    if x.device.type == "cuda" and x.dtype in _HALF:
        y = mm_fp32(x.reshape(-1, x.shape[-1]), wv.t())   # [M, N] fp32
        if b is not None:
            y += b.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
    # on the CPU F.linear adds the bias inside the GEMM, and half types round once
    return F.linear(x, wv, b)


def _bind_linear(p, ins, outs, ctx):
    """The C matmul at every row count (see :func:`linear`)."""
    return bind_cpu_linear(p, ins, outs, ctx)


_bind_linear.takes_packed = True  # type: ignore[attr-defined]


@kernel("Linear", impl="the C matmul on 32-output panels at every row count (CPU; "
        "fp32/bf16/fp16/w8 weights, residual in its epilogue), the C w4 / w8a8 kernels on their packed layouts; else F.linear / cached-transposed GEMV; "
        "w8: aten._weight_int8pack_mm or fp32 dequantize + GEMM; w4/w8a8: fp32 torch ops",
        writes_out=True, bind=_bind_linear)
def linear(p, ins, out=None):
    x, w, b, s = ins["x"], ins["weight"], ins.get("bias"), ins.get("scale")
    r, z = ins.get("residual"), ins.get("zeros")
    if is_packed(w):
        if why_not_cpu_linear(p, x.dtype, str(x.device), w, b, s, z) is None:
            return [cpu_linear(p, w, b, s, z=z).run(x, None if out is None else out[0], r)]
        ins = plain_ins(ins)
        w = ins["weight"]
    if why_not_cpu_linear(p, x.dtype, str(x.device), w, b, s, z) is None:
        return [cpu_linear(p, w, b, s, z=z).run(x, None if out is None else out[0], r)]
    if p.quant in ("w4", "w8a8"):
        y = quant_linear_torch(p, x, w, b, s, z)
    else:
        y = _w8_linear(p, x, w, b, s) if p.quant == "w8" else _dense_linear(p, x, w, b)
    return [y if r is None else add_residual(y, r)]


linear.takes_packed = True  # type: ignore[attr-defined]  # unpacks where it must


def add_residual(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``y + r`` of a Linear's output and its residual (fp32 sum for half types)."""
    if y.dtype in _HALF:
        return (y.float() + r.float()).to(y.dtype)
    return y + r


@kernel("MatMul", impl="torch.matmul (CUDA half: bmm with fp32 output)")
def matmul(p, ins):
    a, b = ins["a"], ins["b"]
    if p.transpose_a:
        a = a.transpose(-1, -2)
    if p.transpose_b:
        b = b.transpose(-1, -2)
    if a.device.type == "cuda" and a.dtype in _HALF:
        return [_cuda_half_matmul(a, b)]
    return [torch.matmul(a, b)]


def _cuda_half_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched half matmul with fp32 accumulation and one rounding (see mm_fp32)."""
    m, n = a.shape[-2], b.shape[-1]
    if b.dim() == 2:                                   # fold a's batch into rows
        return mm_fp32(a.reshape(-1, a.shape[-1]), b).to(a.dtype).reshape(*a.shape[:-1], n)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, m, a.shape[-1])     # [Bt, M, K]
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, b.shape[-2], n)     # [Bt, K, N]
    try:
        y = torch.bmm(a3, b3, out_dtype=torch.float32)
    except (RuntimeError, TypeError):
        y = torch.bmm(a3.float(), b3.float())
    return y.to(a.dtype).reshape(*batch, m, n)
