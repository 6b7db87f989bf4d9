"""Torch kernel of RmsNormLinear: on the CPU one C matmul that RmsNorms its rows as it
reads them (rounded to x's dtype as the RmsNorm kernel stores them, so the values are
the unfused pair's); elsewhere the RmsNorm kernel then the Linear kernel."""

from __future__ import annotations

from ..cpu_kernels import torch_ops as ck
from . import TORCH_KERNELS, kernel
from . import linear as _linear, norm as _norm  # noqa: F401  (registered before this kernel)
from .linear_cpu import (bind_cpu_linear, cpu_linear, is_packed, plain_ins, why_not_cpu_linear,
                         why_not_norm_weight)

__all__: list[str] = []


@kernel("RmsNormLinear", impl="C matmul on 32-output panels with the RmsNorm of its rows "
        "inside (CPU); else the RmsNorm kernel + the Linear kernel", writes_out=True,
        launches=ck.c_launches(TORCH_KERNELS["RmsNorm"].launches
                               + TORCH_KERNELS["Linear"].launches, with_c=1),
        bind=bind_cpu_linear)
def rms_norm_linear(p, ins, out=None):
    x, nw, w, b, s = ins["x"], ins["norm_weight"], ins["weight"], ins.get("bias"), \
        ins.get("scale")
    r, z = ins.get("residual"), ins.get("zeros")
    why = why_not_cpu_linear(p, x.dtype, str(x.device), w, b, s, z) or \
        why_not_norm_weight(nw, x.shape[-1])
    if why is None:
        lin = cpu_linear(p, w, b, s, (float(p.eps), nw), z)
        return [lin.run(x, None if out is None else out[0], r)]
    ck.log_fallback("RmsNormLinear", why)
    if any(is_packed(t) for t in (w, s, z)):
        w, s, z = (plain_ins({"weight": w, "scale": s, "zeros": z})[k]
                   for k in ("weight", "scale", "zeros"))
    norm_p = _rms_params(p)
    n, = TORCH_KERNELS["RmsNorm"].fn(norm_p, {"x": x, "weight": nw})
    y, = TORCH_KERNELS["Linear"].fn(p.linear(), {"x": n, "weight": w, "bias": b, "scale": s,
                                                 "residual": r, "zeros": z})
    return [ck.into(out, 0, y)]


rms_norm_linear.takes_packed = True  # type: ignore[attr-defined]  # unpacks where it must


def _rms_params(p):
    from ...ops.registry import get_op

    return get_op("RmsNorm").make_params({"eps": p.eps})
