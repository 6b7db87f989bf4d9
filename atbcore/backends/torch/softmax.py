"""Torch kernels for Softmax and ScaledMaskedSoftmax, computed in fp32.

One axis: ``torch.softmax(..., dtype=float32)`` (max-subtracting, fused). Several
axes: amax / exp / sum over all of them. Masked rows (every element ``-inf``)
come out as zeros, matching the reference, instead of torch's NaN.
"""

from __future__ import annotations

import torch

from ...ops.softmax import softmax_axes
from ...tensor import describe
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


@kernel("Softmax", impl="torch.softmax (fp32 compute)")
def softmax(p, ins):
    x = ins["x"]
    axes = softmax_axes("Softmax", p, describe(x))
    return [softmax_fp32(x, axes, empty_rows_zero=False).to(x.dtype)]


@kernel("ScaledMaskedSoftmax", impl="scale+mask, torch.softmax (fp32 compute)", launches=4)
def scaled_masked_softmax(p, ins):
    x, mask = ins["x"], ins.get("mask")
    axes = softmax_axes("ScaledMaskedSoftmax", p, describe(x))
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
    return [softmax_fp32(z, axes, empty_rows_zero=masked).to(x.dtype)]
