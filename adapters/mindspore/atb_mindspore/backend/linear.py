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


def act_q8(x: Any) -> Any:
    """fp32 ``x`` [..., K] as atb's w8 reads it (:func:`atbcore.ops.linear_quant.act_q8`):
    each row in int8 blocks of 32, ``q = rint(x * 127 / max|x|)`` (ties to even), times
    ``max|x| / 127``."""
    mt = mint()
    k = x.shape[-1]
    x2 = x.reshape((-1, k))
    m, kp = x2.shape[0], -(-k // 32) * 32
    if kp != k:
        x2 = mt.cat((x2, mt.zeros((m, kp - k), dtype=x2.dtype)), 1)
    blk = x2.reshape((m, kp // 32, 32))
    amax = mt.amax(mt.abs(blk), -1, True)
    zero = mt.mul(amax, 0.0)                               # (full_like: no CPU kernel)
    c127 = mt.add(zero, 127.0)
    inv = mt.where(amax > 0, mt.div(c127, amax), zero)
    v = mt.mul(blk, inv)
    q = mt.floor(v)
    f = mt.sub(v, q)
    odd = mt.ne(mt.remainder(q, 2.0), 0)
    up = mt.logical_or(mt.gt(f, 0.5), mt.logical_and(mt.eq(f, 0.5), odd))
    q = mt.clamp(mt.add(q, cast(up, q.dtype)), -127.0, 127.0)
    y = mt.mul(q, mt.div(amax, c127)).reshape((m, kp))[:, :k]
    return y.reshape(x.shape)


def linear_fp32(p: Any, x: Any, w: Any, b: Any, s: Any) -> Any:
    """``x @ W.T (* scale) + b`` in fp32, shape ``[..., out]`` (not rounded); with a
    w8 ``scale`` x is read as int8 blocks of 32, as atb's w8 reads it (:func:`act_q8`)."""
    mt = mint()
    xf = f32(x) if s is None else act_q8(f32(x))
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
