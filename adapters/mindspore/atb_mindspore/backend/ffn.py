"""MindSpore kernel for FusedFeedForward: fp32 projections, the activation in fp32,
one rounding at the end. Weights come ``[out, in]`` (nn.Linear) or, when the op's
layout says so, ``[in, out]``; neither is copied."""

from __future__ import annotations

from typing import Any

from atbcore.ops.ffn import ffn_layout

from . import kernel
from .activation import activation_reasons, ms_activation
from .common import cast, f32, mint, swap_last

__all__: list[str] = []


def _check(p: Any, ins: Any) -> list[str]:
    return activation_reasons(p.activation_type)


@kernel("FusedFeedForward", check=_check,
        impl="mindspore matmul (gate/up) + activation + matmul (down), fp32 compute", launches=5)
def fused_feed_forward(p, ins):
    mt = mint()
    x = ins["x"]
    lay = ffn_layout("FusedFeedForward", p, {n: tuple(t.shape) for n, t in ins.items()
                                             if t is not None})
    gated = p.activation.gated

    def proj(a: Any, w: str) -> Any:
        wf = f32(ins[w])
        y = mt.matmul(a, wf if lay.transposed[w] else swap_last(wf))     # [T, out] fp32
        b = ins.get(w[:-1] + "b")
        return y if b is None else mt.add(y, f32(b))

    xn = x
    if p.norm_eps is not None:  # the fused RmsNorm of x (the norm_ffn fusion)
        from atbcore.ops.registry import get_op

        from . import MS_KERNELS

        xn, = MS_KERNELS["RmsNorm"].fn(get_op("RmsNorm").make_params({"eps": p.norm_eps}),
                                       {"x": x, "weight": ins["norm_weight"]})
    x2 = f32(xn).reshape((-1, lay.hidden))                                 # [T, H]
    if p.gate_up_merged or not gated:
        h = ms_activation(p.activation_type, proj(x2, "gate_up_w" if p.gate_up_merged else "up_w"))
    else:
        h = ms_activation(p.activation_type, proj(x2, "gate_w"), proj(x2, "up_w"))  # [T, I]
    y = proj(h, "down_w")                                                  # [T, H]
    r = ins.get("residual")
    if r is not None:
        y = mt.add(y, f32(r).reshape((-1, lay.hidden)))
    return [cast(y, x.dtype).reshape(x.shape)]
