"""Torch kernels for the norms.

On the CPU each call is one C kernel (:mod:`atbcore.backends.cpu_kernels`):
RmsNorm / LayerNorm and their residual-add forms read x (and the residual)
once per pass, compute in fp32 and round once, writing into planned ``out``
buffers when given. Elsewhere (CUDA, or no C compiler) the torch composite
runs: ``F.layer_norm`` / ``F.rms_norm`` in fp32 (``F.rms_norm`` alone is six
aten ops on the CPU), plus an add for the residual forms; the fallback is
logged with its reason. Declared launches are the CPU counts (see
``tests/core/backends/test_launch_counts.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from ...runtime.binding import Slot
from ...runtime.native_run import native_call, slots_of
from ...tensor import describe
from ..cpu_kernels import torch_ops as ck
from . import kernel

__all__: list[str] = []


def _shape(p, x, w):
    if p.normalized_shape:
        return list(p.normalized_shape)
    return list(w.shape) if w is not None else [x.shape[-1]]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _f32(t):
    return None if t is None else t.float()


def _layer_norm(p, x, w, b):
    return F.layer_norm(_f32(x), _shape(p, x, w), _f32(w), _f32(b), p.eps).to(x.dtype)


def _rms_norm(p, x, w):
    wf = _f32(w)
    if wf is not None and p.weight_offset:
        wf = wf + p.weight_offset
    return F.rms_norm(_f32(x), _shape(p, x, w), wf, p.eps).to(x.dtype)


def _bind_norm(name: str) -> Callable[..., Any]:
    """A binder for LayerNorm / RmsNorm (and their Add forms) writing planned buffers:
    the C call with the weights and outputs packed once (x and the residual read per
    run); None (the generic call) for anything else."""

    def bind(p: Any, ins: Mapping[str, Any], outs: list, ctx: Any) -> Any:
        x, r, w, b = ins["x"], ins.get("residual"), ins["weight"], ins.get("bias")
        if type(w) is Slot or type(b) is Slot or any(type(o) is Slot for o in outs):
            return None
        o, s = outs[0], (outs[1] if len(outs) > 1 else None)
        for t in (x, r):
            if t is None:
                continue
            d = t.desc if type(t) is Slot else describe(t)
            if d.dtype.torch != o.dtype or tuple(d.shape) != o.shape or \
                    not str(d.device).startswith("cpu"):
                return None
        if ck.why_not(w, b, o, s) or o.numel() == 0:
            return None
        n = _numel(_shape(p, o, w))
        run = ck.norm_bound(name, w, b, n, p.eps, getattr(p, "weight_offset", 0.0), o, s)
        gx = (lambda env, i=x.index: env[i]) if type(x) is Slot else (lambda env: x)
        by_address = slots_of([x, r])  # its C call reads them by address alone
        if r is None:
            return native_call(lambda env: run(gx(env)), addresses=by_address)
        gr = (lambda env, i=r.index: env[i]) if type(r) is Slot else (lambda env: r)
        return native_call(lambda env: run(gx(env), gr(env)), addresses=by_address)
    return bind


@kernel("LayerNorm", impl="C layer_norm, one pass (CPU); else F.layer_norm (fp32 compute)",
        launches=ck.c_launches(1), writes_out=True, bind=_bind_norm("layer_norm"))
def layer_norm(p, ins, out=None):
    x, w, b = ins["x"], ins["weight"], ins["bias"]
    why = ck.why_not(x, w, b)
    if why is None:
        y, _ = ck.layer_norm(x, w, b, _numel(_shape(p, x, w)), p.eps, out=ck.out_at(out, 0))
        return [y]
    ck.log_fallback("LayerNorm", why)
    return [ck.into(out, 0, _layer_norm(p, x, w, b))]


@kernel("RmsNorm", impl="C rms_norm, one pass (CPU); else F.rms_norm (fp32 compute)",
        launches=ck.c_launches(6), writes_out=True, bind=_bind_norm("rms_norm"))
def rms_norm(p, ins, out=None):
    x, w = ins["x"], ins["weight"]
    why = ck.why_not(x, w)
    if why is None:
        y, _ = ck.rms_norm(x, w, _numel(_shape(p, x, w)), p.eps, p.weight_offset,
                           out=ck.out_at(out, 0))
        return [y]
    ck.log_fallback("RmsNorm", why)
    return [ck.into(out, 0, _rms_norm(p, x, w))]


@kernel("AddLayerNorm", impl="C add + layer_norm, one kernel (CPU); else add + F.layer_norm",
        launches=ck.c_launches(2), writes_out=True, bind=_bind_norm("layer_norm"))
def add_layer_norm(p, ins, out=None):
    x, r, w, b = ins["x"], ins["residual"], ins["weight"], ins["bias"]
    why = ck.why_not(x, r, w, b)
    if why is None:
        y, s = ck.layer_norm(x, w, b, _numel(_shape(p, x, w)), p.eps, residual=r,
                             out=ck.out_at(out, 0), sum_out=ck.out_at(out, 1))
        return [y, s]
    ck.log_fallback("AddLayerNorm", why)
    s = torch.add(x, r)
    return [ck.into(out, 0, _layer_norm(p, s, w, b)), ck.into(out, 1, s)]


@kernel("AddRmsNorm", impl="C add + rms_norm, one kernel (CPU); else add + F.rms_norm",
        launches=ck.c_launches(7), writes_out=True, bind=_bind_norm("rms_norm"))
def add_rms_norm(p, ins, out=None):
    x, r, w = ins["x"], ins["residual"], ins["weight"]
    why = ck.why_not(x, r, w)
    if why is None:
        y, s = ck.rms_norm(x, w, _numel(_shape(p, x, w)), p.eps, p.weight_offset, residual=r,
                           out=ck.out_at(out, 0), sum_out=ck.out_at(out, 1))
        return [y, s]
    ck.log_fallback("AddRmsNorm", why)
    s = torch.add(x, r)
    return [ck.into(out, 0, _rms_norm(p, s, w)), ck.into(out, 1, s)]
