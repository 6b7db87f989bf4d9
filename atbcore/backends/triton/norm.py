"""Triton RmsNorm and Add+RmsNorm: one program per row, fp32 statistics, one rounding.

``rms_norm(x, w, n, eps, offset)`` normalises the last ``n`` elements of each row;
with ``residual`` it first writes ``s = x + residual`` (rounded to x's dtype, as the
torch composite does) and normalises ``s``. Rows are read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_to

__all__ = ["rms_norm", "MAX_COLS"]

MAX_COLS = 65536  # one row in one program's registers


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_cols, eps, offset,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), s_ptr)
        tl.store(s_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
    tl.store(y_ptr + row * n_cols + cols, round_to(xf * rstd * w, y_ptr), mask=mask)


def _buffer(o: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if o is not None and o.shape == like.shape and o.dtype == like.dtype and o.is_contiguous() \
            and o.device == like.device:
        return o
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def rms_norm(x: torch.Tensor, w: torch.Tensor, n: int, eps: float, offset: float = 0.0,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             sum_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, s)``: RmsNorm over the last ``n`` elements (``s``: the residual sum, or
    None). ``out``/``sum_out`` are used when they fit (contiguous, x's shape and dtype)."""
    xc = x.contiguous()
    rows = xc.numel() // n if n else 0
    y = _buffer(out, xc)
    s = None if residual is None else _buffer(sum_out, xc)
    if rows:
        block = triton.next_power_of_2(n)
        r = residual.contiguous() if residual is not None else xc
        _rms_norm_kernel[(rows,)](xc, r, w.contiguous(), y, s if s is not None else y, n,
                                  float(eps), float(offset), HAS_RESIDUAL=residual is not None,
                                  BLOCK=block, num_warps=8 if block >= 4096 else 4)
    if out is not None and y is not out:
        y = out.copy_(y)
    if s is not None and sum_out is not None and s is not sum_out:
        s = sum_out.copy_(s)
    return y, s
