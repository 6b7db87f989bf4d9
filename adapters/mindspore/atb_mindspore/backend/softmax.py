"""MindSpore kernels for Softmax and ScaledMaskedSoftmax, computed in fp32.

One axis: ``ops.softmax``; several axes: amax / exp / sum over all of them. Rows
that a mask removed entirely come out as zeros (the reference's rule), not NaN.
"""

from __future__ import annotations

from typing import Any

from atbcore.ops.softmax import softmax_axes
from atbcore.tensor import describe

from . import kernel
from .common import NEG_INF, arange, cast, f32, mint, ms, ops

__all__ = ["softmax_fp32"]


def softmax_fp32(z: Any, axes: tuple[int, ...], empty_rows_zero: bool) -> Any:
    """Softmax of fp32 ``z`` over ``axes`` (returns fp32)."""
    mt = mint()
    if len(axes) == 1 and not empty_rows_zero:
        return ops().softmax(z, axes[0])
    m = mt.amax(z, axes, True)
    empty = mt.isinf(m)                                   # only -inf can be the max here
    if empty_rows_zero:
        m = ops().masked_fill(m, empty, 0.0)              # exp(-inf - 0) = 0: the row sums to 0
    e = mt.exp(mt.sub(z, m))
    s = mt.sum(e, axes, True)
    if empty_rows_zero:
        s = ops().masked_fill(s, empty, 1.0)
    return mt.div(e, s)


@kernel("Softmax", impl="mindspore ops.softmax (fp32 compute)")
def softmax(p, ins):
    x = ins["x"]
    axes = softmax_axes("Softmax", p, describe(x))
    return [cast(softmax_fp32(f32(x), axes, empty_rows_zero=False), x.dtype)]


@kernel("ScaledMaskedSoftmax", impl="mindspore scale + mask + softmax (fp32 compute)",
        launches=4)
def scaled_masked_softmax(p, ins):
    x, mask = ins["x"], ins.get("mask")
    mt, m = mint(), ms()
    axes = softmax_axes("ScaledMaskedSoftmax", p, describe(x))
    z = f32(x)
    if p.scale != 1.0:
        z = mt.mul(z, float(p.scale))
    if mask is not None:
        if mask.dtype == m.bool_:
            z = ops().masked_fill(z, mt.logical_not(mask), NEG_INF)
        else:
            z = mt.add(z, f32(mask))
    if p.causal:
        sq, sk = z.shape[-2:]
        # keep key j for query i when j <= i + sk - sq: [Sq, Sk]
        keep = mt.le(arange(sk).reshape((1, sk)), mt.add(arange(sq).reshape((sq, 1)), sk - sq))
        z = ops().masked_fill(z, mt.logical_not(keep), NEG_INF)
    masked = mask is not None or p.causal
    return [cast(softmax_fp32(z, axes, empty_rows_zero=masked), x.dtype)]
