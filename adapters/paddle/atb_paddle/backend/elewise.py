"""Paddle kernels for Elewise and ResidualAdd.

Floats: half types in fp32, rounded once. Integers wrap around in their own dtype,
as NumPy and torch do; Paddle 3.3's CPU lacks int8/uint8 ``multiply``/``subtract``
(and fp16 ``add``), so small integers are computed in int32 and cast back, which
keeps the two's-complement wrap (the low bits are the same).
"""

from __future__ import annotations

import paddle

from atbcore.dtypes import Dtype

from . import kernel
from .common import HALF, f32, to_dtype

__all__: list[str] = []

_BINARY = {"add": paddle.add, "sub": paddle.subtract, "mul": paddle.multiply, "div": paddle.divide}
_UNARY = {"neg": paddle.neg, "cos": paddle.cos, "sin": paddle.sin, "tanh": paddle.tanh,
          "exp": paddle.exp, "rsqrt": paddle.rsqrt}
_SMALL_INTS = (paddle.int8, paddle.uint8)


def _paddle_dtype(d: Dtype):
    return getattr(paddle, d.value)


def _up(t):
    if t.dtype in HALF:
        return f32(t)
    if t.dtype in _SMALL_INTS:
        return t.astype(paddle.int32)
    return t


def _wrap(z, like):
    """Back to ``like``'s dtype; int32 -> int8/uint8 keeps the low bits (wrap-around)."""
    if like.dtype in _SMALL_INTS and z.dtype != like.dtype:
        bits = 8
        z = paddle.bitwise_and(z, paddle.full([], (1 << bits) - 1, dtype=z.dtype))
        if like.dtype == paddle.int8:                 # 0..255 -> -128..127
            z = paddle.where(z > 127, z - 256, z)
    return to_dtype(z, like.dtype)


@kernel("Elewise", impl="paddle elementwise (fp32 compute for fp16/bf16, int32 for int8/uint8)")
def elewise(p, ins):
    x, y = ins["x"], ins.get("y")
    t = p.elewise_type
    if t == "cast":
        if x.dtype == _paddle_dtype(p.out_dtype):
            return [x.clone()]                        # a cast must not hand back its input
        if p.out_dtype.is_integer and x.dtype in (paddle.float16, paddle.bfloat16):
            x = f32(x)                                # half -> int casts go through fp32
        return [x.astype(_paddle_dtype(p.out_dtype))]
    if t in _BINARY:
        z = _BINARY[t](_up(x), _up(y))
    elif t == "muls":
        z = paddle.scale(f32(x), scale=float(p.scalar))
    else:
        z = _UNARY[t](_up(x))
    return [_wrap(z, x)]


@kernel("ResidualAdd", impl="paddle.add (fp32 compute for fp16/bf16)")
def residual_add(p, ins):
    x = ins["x"]
    return [to_dtype(paddle.add(f32(x), f32(ins["residual"])), x.dtype)]
