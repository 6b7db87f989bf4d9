"""Paddle kernels for FusedFeedForward and MoE: fp32 projections (``paddle.matmul``),
the activation in fp32 (Paddle's fused ``swiglu`` where registered), one rounding.

``paddle.incubate.nn.functional.fused_feedforward`` is a different block (a
two-matmul FFN with LayerNorm and dropout, no gating, GPU-only), so it is not used.

MoE routes in fp32 (softmax over all experts, ``paddle.topk``; ties go to the lower
expert id, as the reference's stable sort), then runs only the experts that got
tokens, each on its gathered rows, and scatters the weighted results back with
``index_add``.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from atbcore.ops.ffn import ffn_layout

from . import kernel
from .activation import _check_activation, paddle_activation
from .common import f32, to_dtype

__all__: list[str] = []


class _ActName:
    """Adapts FFN/MoE params to the activation check (which reads activation_name())."""

    def __init__(self, p) -> None:
        self.name = p.activation_type

    def activation_name(self) -> str:
        return self.name


def _check_ffn(p, ins) -> list[str]:
    if getattr(p, "quant", None):  # quantized MoE experts: the torch kernel's
        return [f"quant={p.quant!r} experts: float experts only"]
    return _check_activation(_ActName(p), ins)


@kernel("FusedFeedForward", check=_check_ffn, impl="paddle.matmul (gate/up) + activation "
        "(swiglu fused) + paddle.matmul (down), fp32 compute", launches=4)
def fused_feed_forward(p, ins):
    x = ins["x"]
    lay = ffn_layout("FusedFeedForward", p, {n: t.shape for n, t in ins.items() if t is not None})

    def proj(a, w: str):
        y = paddle.matmul(a, f32(ins[w]), transpose_y=not lay.transposed[w])    # fp32 [T, out]
        b = ins.get(w[:-1] + "b")
        return y if b is None else y + f32(b)

    xn = x
    if p.norm_eps is not None:  # the fused RmsNorm of x (the norm_ffn fusion)
        from atbcore.ops.registry import get_op

        from . import PADDLE_KERNELS

        xn, = PADDLE_KERNELS["RmsNorm"].fn(get_op("RmsNorm").make_params({"eps": p.norm_eps}),
                                           {"x": x, "weight": ins["norm_weight"]})
    x2 = f32(xn).reshape([-1, lay.hidden])                                      # [T, H]
    name = p.activation_type
    if p.gate_up_merged or not p.activation.gated:
        h = paddle_activation(name, proj(x2, "gate_up_w" if p.gate_up_merged else "up_w"))
    else:
        h = paddle_activation(name, proj(x2, "gate_w"), proj(x2, "up_w"))       # [T, I]
    y = proj(h, "down_w")                                                       # [T, H]
    r = ins.get("residual")
    if r is not None:
        y = y + f32(r).reshape([-1, lay.hidden])
    return [to_dtype(y, x.dtype).reshape(x.shape)]


@kernel("MoE", check=_check_ffn, impl="fp32 top-k routing + per-expert paddle.matmul "
        "(experts hit only) + index_add", launches=8)
def moe(p, ins):
    x, gu, dn = ins["x"], ins["w_gate_up"], ins["w_down"]
    k, e_num = p.top_k, ins["router_w"].shape[0]
    x2 = f32(x).reshape([-1, x.shape[-1]])                                      # [T, H]
    logits = paddle.matmul(x2, f32(ins["router_w"]), transpose_y=True)          # [T, E]
    probs = F.softmax(logits, axis=-1)
    w, ids = paddle.topk(probs, k, axis=-1)                                     # [T, k]
    if p.norm_topk_prob:
        w = w / w.sum(axis=-1, keepdim=True)
    flat = ids.reshape([-1])                                                    # expert per pair
    order = paddle.argsort(flat, stable=True)                                   # pairs by expert
    tok = order // k                                                            # token of each pair
    pair_w = paddle.gather(w.reshape([-1]), order)
    counts = paddle.bincount(flat, minlength=e_num).numpy().tolist()
    xs = paddle.gather(x2, tok)                                                 # [T*k, H] grouped
    out = paddle.zeros(x2.shape, dtype="float32")
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue                                                            # expert not hit
        sl = slice(start, start + n)
        start += n
        h = paddle_activation(p.activation_type,
                              paddle.matmul(xs[sl], f32(gu[e]), transpose_y=True))   # [n, I]
        y = paddle.matmul(h, f32(dn[e]), transpose_y=True) * pair_w[sl].unsqueeze(1)  # [n, H]
        out = paddle.index_add(out, tok[sl], 0, y)
    return [to_dtype(out, x.dtype).reshape(x.shape)]
