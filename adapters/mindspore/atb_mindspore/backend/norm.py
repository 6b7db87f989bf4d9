"""MindSpore kernels for LayerNorm, RmsNorm, AddLayerNorm and AddRmsNorm.

LayerNorm runs MindSpore's ``LayerNorm`` primitive (the ``mint`` form,
``LayerNormExt``, has no CPU kernel in 2.10). RmsNorm uses the fused
``ops.rms_norm`` / ``ops.add_rms_norm`` on Ascend; on other devices (they are
not registered there) it is ``x * rsqrt(mean(x^2) + eps) * w`` in fp32.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from . import kernel
from .common import cast, f32, mint, ms, note, on_ascend, ops

__all__: list[str] = []


def _naxes(p: Any, x: Any, w: Any) -> int:
    if p.normalized_shape:
        return len(p.normalized_shape)
    return w.ndim if w is not None else 1


@lru_cache(maxsize=64)
def _layer_norm_prim(axis: int, eps: float) -> Any:
    return ops().LayerNorm(begin_norm_axis=axis, begin_params_axis=axis, epsilon=eps)


def _layer_norm(p: Any, x: Any, w: Any, b: Any) -> Any:
    m = ms()
    n = _naxes(p, x, w)
    shape = tuple(x.shape[x.ndim - n:])
    xf = f32(x)
    wf = f32(w) if w is not None else m.ops.ones(shape, m.float32)
    bf = f32(b) if b is not None else m.ops.zeros(shape, m.float32)
    y, _, _ = _layer_norm_prim(x.ndim - n, float(p.eps))(xf, wf, bf)
    return cast(y, x.dtype)


def _rms_norm(p: Any, x: Any, w: Any, op: str) -> Any:
    n = _naxes(p, x, w)
    if on_ascend(x) and n == 1 and not p.weight_offset and x.dtype == w.dtype:
        note(op, "ops.rms_norm (Ascend fused)")
        return ops().rms_norm(x, w, float(p.eps))[0]
    note(op, "composed rsqrt(mean(x^2)+eps)*w, fp32",
         "ops.rms_norm is Ascend-only" if not on_ascend(x) else
         "ops.rms_norm needs one normalised axis, no weight offset, same dtypes")
    mt = mint()
    xf = f32(x)
    axes = tuple(range(x.ndim - n, x.ndim))
    ms2 = mt.mean(mt.square(xf), axes, True)
    y = mt.mul(xf, mt.rsqrt(mt.add(ms2, float(p.eps))))
    if w is not None:
        wf = f32(w)
        if p.weight_offset:
            wf = mt.add(wf, float(p.weight_offset))
        y = mt.mul(y, wf)
    return cast(y, x.dtype)


def _add(x: Any, r: Any) -> Any:
    # the sum is materialised in x's dtype, computed in fp32 (one rounding)
    return cast(mint().add(f32(x), f32(r)), x.dtype)


@kernel("LayerNorm", impl="mindspore ops.LayerNorm (fp32 compute)")
def layer_norm(p, ins):
    return [_layer_norm(p, ins["x"], ins.get("weight"), ins.get("bias"))]


@kernel("RmsNorm", impl="mindspore ops.rms_norm on Ascend, else composed (fp32 compute)")
def rms_norm(p, ins):
    return [_rms_norm(p, ins["x"], ins["weight"], "RmsNorm")]


@kernel("AddLayerNorm", impl="mindspore add + ops.LayerNorm", launches=2)
def add_layer_norm(p, ins):
    s = _add(ins["x"], ins["residual"])
    return [_layer_norm(p, s, ins.get("weight"), ins.get("bias")), s]


@kernel("AddRmsNorm", impl="mindspore ops.add_rms_norm on Ascend, else add + composed rms_norm",
        launches=2)
def add_rms_norm(p, ins):
    x, r, w = ins["x"], ins["residual"], ins["weight"]
    if (on_ascend(x) and not p.weight_offset and x.dtype == w.dtype
            and _naxes(p, x, w) == 1):
        note("AddRmsNorm", "ops.add_rms_norm (Ascend fused)")
        y, _, s = ops().add_rms_norm(x, r, w, float(p.eps))
        return [y, s]
    s = _add(x, r)
    return [_rms_norm(p, s, w, "AddRmsNorm"), s]
