"""Paddle kernels for the norms.

RmsNorm / AddRmsNorm: ``paddle.incubate.nn.functional.fused_rms_norm`` (the residual
form returns the sum as its second output); LayerNorm: ``F.layer_norm``;
AddLayerNorm: ``fused_layer_norm`` with the residual. All in fp32. For half inputs
the Add forms first round the sum to the input dtype and normalise the rounded sum,
as the op defines (the fused residual forms would normalise the unrounded fp32 sum).
"""

from __future__ import annotations

import paddle
import paddle.incubate.nn.functional as IF
import paddle.nn.functional as F

from . import kernel
from .common import f32, fused_or, to_dtype

__all__: list[str] = []


def _ndims(p, x, w) -> int:
    """How many trailing dims are normalised."""
    if p.normalized_shape:
        return len(p.normalized_shape)
    return w.ndim if w is not None and 0 < w.ndim <= x.ndim else 1


def _rms(p, x32, w, op: str):
    """RmsNorm of fp32 ``x32`` over its trailing dims; returns fp32."""
    n = _ndims(p, x32, w)
    wf = f32(w)
    if wf is not None and p.weight_offset:
        wf = wf + p.weight_offset
    axes = list(range(x32.ndim - n, x32.ndim))

    def composed():
        y = x32 * paddle.rsqrt(paddle.mean(x32 * x32, axis=axes, keepdim=True) + p.eps)
        return y if wf is None else y * wf

    def fused():
        # the fused op wants a flat weight over the normalised dims
        return IF.fused_rms_norm(x32, wf.reshape([-1]), None, p.eps, begin_norm_axis=x32.ndim - n)[0]

    if wf is None:
        return composed()
    return fused_or(op, "fused_rms_norm", x32, fused, composed)


def _ln(p, x32, w, b):
    n = _ndims(p, x32, w)
    return F.layer_norm(x32, list(x32.shape[x32.ndim - n:]), f32(w), f32(b), p.eps)


@kernel("RmsNorm", impl="paddle fused_rms_norm (fp32; composition where not registered)")
def rms_norm(p, ins):
    x = ins["x"]
    return [to_dtype(_rms(p, f32(x), ins["weight"], "RmsNorm"), x.dtype)]


@kernel("LayerNorm", impl="paddle.nn.functional.layer_norm (fp32 compute)")
def layer_norm(p, ins):
    x = ins["x"]
    return [to_dtype(_ln(p, f32(x), ins["weight"], ins["bias"]), x.dtype)]


@kernel("AddRmsNorm", impl="paddle fused_rms_norm with residual (fp32)", launches=1)
def add_rms_norm(p, ins):
    x, r, w = ins["x"], ins["residual"], ins["weight"]
    if x.dtype == paddle.float32 and not p.weight_offset:
        n = _ndims(p, x, w)

        def fused():
            y, s = IF.fused_rms_norm(x, f32(w).reshape([-1]), None, p.eps,
                                     begin_norm_axis=x.ndim - n, residual=r)
            return [y, s]

        def composed():
            s = paddle.add(x, r)
            return [_rms(p, s, w, "AddRmsNorm"), s]

        return fused_or("AddRmsNorm", "fused_rms_norm", x, fused, composed)
    s = to_dtype(paddle.add(f32(x), f32(r)), x.dtype)      # the sum, rounded once
    return [to_dtype(_rms(p, f32(s), w, "AddRmsNorm"), x.dtype), s]


@kernel("AddLayerNorm", impl="paddle fused_layer_norm with residual (fp32)", launches=1)
def add_layer_norm(p, ins):
    x, r, w, b = ins["x"], ins["residual"], ins["weight"], ins["bias"]
    if x.dtype == paddle.float32 and w is not None and b is not None:
        n = _ndims(p, x, w)

        def fused():
            out = IF.fused_layer_norm(x, f32(w).reshape([-1]), f32(b).reshape([-1]), p.eps,
                                      begin_norm_axis=x.ndim - n, residual=r)
            return [out[0], out[1]]

        def composed():
            s = paddle.add(x, r)
            return [_ln(p, s, w, b), s]

        return fused_or("AddLayerNorm", "fused_layer_norm", x, fused, composed)
    s = to_dtype(paddle.add(f32(x), f32(r)), x.dtype)
    return [to_dtype(_ln(p, f32(s), w, b), x.dtype), s]
