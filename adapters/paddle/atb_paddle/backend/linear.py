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


def linear_fp32(x, w, b, transpose_weight: bool = True, scale=None):
    """``x`` [..., in] @ W + b in fp32 (W [out, in] when ``transpose_weight``, else
    [in, out]; int8 W with per-output ``scale``). Returns fp32 [..., out]."""
    y = paddle.matmul(f32(x), f32(w), transpose_y=transpose_weight)
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
