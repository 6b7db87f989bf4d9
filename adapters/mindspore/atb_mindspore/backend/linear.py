"""MindSpore kernels for Linear (dense, merged-QKV weights, weight-only int8) and
MatMul, accumulated in fp32 and rounded once.

A merged QKV projection is a Linear whose weight is ``[Hq*D + 2*Hkv*D, in]`` (the
qkv fusion builds it); nothing about it is special here. w8: the int8 weight is
widened to fp32 inside the GEMM's operand (``|int8| <= 127`` is exact) and the
per-output-channel scale multiplies the fp32 product's columns, which equals
``x @ (w * scale[:, None]).T`` without materialising a scaled weight.
"""

from __future__ import annotations

from typing import Any

from atbcore.ops.linear_quant import dense_or_w8_only

from . import kernel
from .common import cast, f32, mint, swap_last

__all__ = ["linear_fp32"]


def linear_fp32(p: Any, x: Any, w: Any, b: Any, s: Any) -> Any:
    """``x @ W.T (* scale) + b`` in fp32, shape ``[..., out]`` (not rounded)."""
    mt = mint()
    xf = f32(x)
    wf = f32(w)                                            # int8 -> fp32 is exact
    wt = swap_last(wf) if p.transpose_weight else wf       # [in, out]
    y = mt.matmul(xf.reshape((-1, x.shape[-1])), wt)       # [M, out]
    if s is not None:
        y = mt.mul(y, f32(s))                              # one scale per output column
    if b is not None:
        y = mt.add(y, f32(b))
    return y.reshape((*x.shape[:-1], y.shape[-1]))


@kernel("Linear", check=dense_or_w8_only,
        impl="mindspore mint.matmul (fp32 compute; w8: int8 widened, column scale)")
def linear(p, ins):
    x, r = ins["x"], ins.get("residual")
    y = linear_fp32(p, x, ins["weight"], ins.get("bias"), ins.get("scale"))
    if r is not None:                                      # the fused residual, fp32 sum
        y = mint().add(y, f32(r))
    return [cast(y, x.dtype)]


@kernel("MatMul", impl="mindspore mint.matmul (fp32 compute, broadcasting batch dims)")
def matmul(p, ins):
    a, b = ins["a"], ins["b"]
    af, bf = f32(a), f32(b)
    if p.transpose_a:
        af = swap_last(af)
    if p.transpose_b:
        bf = swap_last(bf)
    return [cast(mint().matmul(af, bf), a.dtype)]
