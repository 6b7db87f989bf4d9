"""Rounding an fp32 value into a kernel's output type, to nearest even.

Compiled Triton rounds fp32 -> bf16 to nearest even; its CPU interpreter truncates.
Rounding the fp32 bits first makes both give torch's result (and the reference's)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["round_to"]


@triton.jit
def round_to(x, ptr):
    """``x`` (fp32) as ``ptr``'s element type, rounded to nearest even."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty)
