"""Paddle kernels for Linear (dense, merged QKV, weight-only int8) and MatMul.

Dense: ``paddle.matmul(x, W, transpose_y=True)`` plus the bias, in fp32 (Paddle 3.3
has no fp16/bf16 CPU matmul; on GPU half inputs also run in fp32 so the result is
rounded once). A merged QKV projection is a Linear whose weight stacks the q, k and
v rows; nothing about it differs here.

w8 (int8 weight [out, in], one fp32 scale per output channel): the int8 weight is
cast to fp32 (exact), multiplied and the per-column scale applied to the product,
``(x @ w.T) * scale`` = ``x @ (w * scale[:, None]).T``. Paddle's
``paddle.nn.quant.weight_only_linear`` is GPU-only and wants the weight in
``weight_quantize``'s architecture-specific layout, which an atb int8 weight is not,
so it is not used.
"""

from __future__ import annotations

import paddle

from atbcore.ops.linear_quant import dense_or_w8_only

from . import kernel
from .common import PATHS, f32, to_dtype

__all__ = ["linear_fp32"]


def act_q8(x):
    """fp32 ``x`` [..., K] as atb's w8 reads it (:func:`atbcore.ops.linear_quant.act_q8`):
    each row in int8 blocks of 32, ``q = rint(x * 127 / max|x|)`` (ties to even), times
    ``max|x| / 127``."""
    k = x.shape[-1]
    x2 = x.reshape([-1, k])
    m, kp = x2.shape[0], -(-k // 32) * 32
    if kp != k:
        x2 = paddle.concat([x2, paddle.zeros([m, kp - k], "float32")], axis=1)
    blk = x2.reshape([m, kp // 32, 32])
    amax = paddle.max(paddle.abs(blk), axis=-1, keepdim=True)
    c127 = paddle.full_like(amax, 127.0)
    inv = paddle.where(amax > 0, paddle.divide(c127, amax), paddle.zeros_like(amax))
    v = blk * inv
    q = paddle.floor(v)
    up = (v - q > 0.5) | ((v - q == 0.5) & (paddle.remainder(q, paddle.full_like(q, 2.0)) != 0))
    q = paddle.clip(q + paddle.cast(up, "float32"), -127.0, 127.0)
    y = (q * paddle.divide(amax, c127)).reshape([m, kp])[:, :k]
    return y.reshape(x.shape)


def linear_fp32(x, w, b, transpose_weight: bool = True, scale=None):
    """``x`` [..., in] @ W + b in fp32 (W [out, in] when ``transpose_weight``, else
    [in, out]; int8 W with per-output ``scale``, x then read as int8 blocks of 32 as
    atb's w8 reads it: :func:`act_q8`). Returns fp32 [..., out]."""
    xf = f32(x) if scale is None else act_q8(f32(x))
    y = paddle.matmul(xf, f32(w), transpose_y=transpose_weight)
    if scale is not None:
        y = y * f32(scale)                 # one scale per output column
    if b is not None:
        y = y + f32(b)
    return y


@kernel("Linear", check=dense_or_w8_only,
        impl="paddle.matmul (fp32 compute) + bias; w8: int8 -> fp32 GEMM, "
        "per-channel scale on the product")
def linear(p, ins):
    x, w, b, s = ins["x"], ins["weight"], ins.get("bias"), ins.get("scale")
    PATHS[("Linear", "w8" if p.quant == "w8" else "dense")] += 1
    y = linear_fp32(x, w, b, p.transpose_weight, s if p.quant == "w8" else None)
    if ins.get("residual") is not None:   # the fused residual, fp32 sum
        y = y + f32(ins["residual"])
    return [to_dtype(y, x.dtype)]


@kernel("MatMul", impl="paddle.matmul (fp32 compute, broadcasting batch dims)")
def matmul(p, ins):
    a, b = ins["a"], ins["b"]
    y = paddle.matmul(f32(a), f32(b), transpose_x=p.transpose_a, transpose_y=p.transpose_b)
    return [to_dtype(y, a.dtype)]
