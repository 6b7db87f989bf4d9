"""Torch kernels for Softmax and ScaledMaskedSoftmax, computed in fp32.

On the CPU a softmax over the last axis is one C kernel: scale, the additive or
boolean mask (read through its broadcast strides, never expanded in memory)
and the bottom-right causal mask are applied row by row, then max / exp / sum
in fp32 and one rounding; planned ``out`` buffers are written in place.
Otherwise (other axes, several axes, CUDA, no C compiler) torch runs: one axis
``torch.softmax(..., dtype=float32)``; several axes amax / exp / sum over all
of them. Masked rows (every element ``-inf``) come out as zeros, matching the
reference, instead of torch's NaN.
"""

from __future__ import annotations

import torch

from ...ops.softmax import softmax_axes
from ...tensor import describe
from ..cpu_kernels import torch_ops as ck
from . import kernel

__all__ = ["softmax_fp32"]


def softmax_fp32(z: torch.Tensor, axes: tuple[int, ...], empty_rows_zero: bool) -> torch.Tensor:
    """Softmax of ``z`` over ``axes`` in fp32 (returns fp32)."""
    if len(axes) == 1:
        y = torch.softmax(z, dim=axes[0], dtype=torch.float32)
        if empty_rows_zero:
            empty = torch.isneginf(z.amax(dim=axes[0], keepdim=True))
            y = y.masked_fill(empty, 0.0)
        return y
    z = z.float()
    m = z.amax(dim=axes, keepdim=True)
    empty = torch.isneginf(m)
    if empty_rows_zero:
        m = m.masked_fill(empty, 0.0)  # exp(-inf - 0) = 0: the row sums to 0
    e = torch.exp(z - m)
    s = e.sum(dim=axes, keepdim=True)
    if empty_rows_zero:
        s = s.masked_fill(empty, 1.0)
    return e.div_(s)


_AXES: dict[tuple, tuple[int, ...]] = {}


def _axes(op: str, p, x) -> tuple[int, ...]:
    """``softmax_axes`` memoised per (op, dim, rank): it only depends on those."""
    key = (op, p.dim, x.dim())
    axes = _AXES.get(key)
    if axes is None:
        axes = _AXES[key] = softmax_axes(op, p, describe(x))
    return axes


def _c_why(x, axes, mask=None) -> str | None:
    if axes != (x.dim() - 1,):
        return f"softmax over axes {list(axes)}, not the last one"
    if x.dim() - 1 > 8:
        return f"rank {x.dim()} > 9"
    if mask is not None and mask.dtype == torch.bool:
        return ck.why_not(x) or (None if mask.device.type == "cpu" else "mask not on the CPU")
    return ck.why_not(x, mask)


@kernel("Softmax", impl="C softmax over the last axis, one kernel (CPU); else torch.softmax "
        "(fp32 compute)", launches=ck.c_launches(1), writes_out=True)
def softmax(p, ins, out=None):
    x = ins["x"]
    axes = _axes("Softmax", p, x)
    why = _c_why(x, axes)
    if why is None:
        return [ck.softmax(x, out=ck.out_at(out, 0))]
    ck.log_fallback("Softmax", why)
    return [ck.into(out, 0, softmax_fp32(x, axes, empty_rows_zero=False).to(x.dtype))]


@kernel("ScaledMaskedSoftmax", impl="C scale + mask + causal + softmax, one kernel (CPU); else "
        "scale+mask, torch.softmax (fp32 compute)", launches=ck.c_launches(9), writes_out=True)
def scaled_masked_softmax(p, ins, out=None):
    x, mask = ins["x"], ins.get("mask")
    axes = _axes("ScaledMaskedSoftmax", p, x)
    masked = mask is not None or p.causal
    why = _c_why(x, axes, mask)
    if why is None:
        return [ck.softmax(x, scale=p.scale, mask=mask, causal=p.causal, empty_rows_zero=masked,
                           out=ck.out_at(out, 0))]
    ck.log_fallback("ScaledMaskedSoftmax", why)
    return [ck.into(out, 0, _composite(p, x, mask, axes))]


def _composite(p, x, mask, axes):
    z = x.float()
    if mask is not None and mask.dtype != torch.bool:
        z = torch.add(mask.float(), z, alpha=p.scale)      # one pass: x * scale + mask
    elif p.scale != 1.0:
        z = z * p.scale
    if mask is not None and mask.dtype == torch.bool:
        z = z.masked_fill(~mask, float("-inf"))            # mask broadcasts to x
    if p.causal:
        sq, sk = z.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=z.device).tril_(sk - sq)
        z = z.masked_fill(~keep, float("-inf"))            # keep: [Sq, Sk] broadcasts
    masked = mask is not None or p.causal
    return softmax_fp32(z, axes, empty_rows_zero=masked).to(x.dtype)
