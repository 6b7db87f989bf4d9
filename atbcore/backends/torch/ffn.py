"""Torch kernel for FusedFeedForward: fp32-accumulated projections, the registry's
activation in fp32, one rounding at the end.

Separate gate and up weights are multiplied one after the other rather than
concatenated into a cached ``[2I, H]`` copy: one merged GEMM measured 1.05-1.27x
faster on the gate+up part here (2 CPU threads, H 1024-2048, 1-256 rows, median
of alternating runs), but the cached copy would double the gate/up weight memory
for the life of the weights. Callers who want the merged GEMM pass
``gate_up_merged=True`` with a ``[2I, H]`` weight (the graph fusion does that once).

On the CPU the activation (gated or not) and the gate/up biases are one C kernel
over the fp32 GEMM output (bias+GELU for BERT-style FFNs), and the residual rides
in the down projection's GEMM (``addmm``): an fp32 merged SwiGLU FFN with a
residual is three launches (GEMM, C activation, GEMM), where the torch
composite makes five; two where the C gate|up matmul applies the activation in
its epilogue (I a multiple of 32, :mod:`.ffn_cpu`).
"""

from __future__ import annotations

import torch

from ...ops.ffn import ffn_layout
from ..cpu_kernels import torch_ops as ck
from . import kernel
from .activation import c_activation
from .ffn_cpu import CpuFfn, bind_cpu_ffn, ffn_c_launches, ffn_workspace_bytes, why_not_cpu_ffn
from .linear import mm_fp32
from .linear_cpu import plain_ins

__all__: list[str] = []


def _wt(ins, lay, w: str) -> torch.Tensor:
    return ins[w] if lay.transposed[w] else ins[w].t()                     # [in, out]


@kernel("FusedFeedForward", impl="C matmuls on 32-output panels, a merged gate|up one applying "
        "the gated activation in its epilogue (else + C bias+activation), residual "
        "accumulated in the down matmul (CPU); else mm + C activation + addmm, or the registry "
        "torch activation; fp32 compute",
        launches=ck.c_launches(5, with_c=3), bind=bind_cpu_ffn,
        workspace=lambda p, shapes: ffn_workspace_bytes(p, shapes),
        launches_for=lambda p, shapes: ck.c_launches(5, with_c=ffn_c_launches(p, shapes)))
def fused_feed_forward(p, ins):
    x = ins["x"]
    shapes = {n: tuple(t.shape) for n, t in ins.items() if t is not None}
    lay = ffn_layout("FusedFeedForward", p, shapes)
    act = p.activation
    name, why = c_activation(act)
    why = why or ck.why_not(x)
    if why:
        ck.log_fallback("FusedFeedForward", why)
        return _composite(p, plain_ins(ins), lay)
    if why_not_cpu_ffn(p, ins) is None:  # the bound call's kernels, on fresh buffers
        ffn = CpuFfn(p, ins, shapes)
        y = torch.empty(x.shape, dtype=x.dtype)
        ws = torch.empty(x.numel() // lay.hidden * ffn.ws_floats, dtype=torch.float32)
        ffn.run(x, ins.get("residual"), y, ws)
        return [y]
    ins = plain_ins(ins)  # the torch GEMMs read [out, in] weights
    x2 = _normed(p, ins).reshape(-1, lay.hidden)                            # [T, H]
    b = {n: ins.get(n[:-1] + "b") for n in ("gate_up_w", "gate_w", "up_w", "down_w")}
    if p.gate_up_merged:
        gu = mm_fp32(x2, _wt(ins, lay, "gate_up_w"))                        # [T, 2I] fp32
        bgu = b["gate_up_w"]
        h = ck.activation(gu, name, split=True, bias=None if bgu is None else bgu[:lay.inter],
                          bias_up=None if bgu is None else bgu[lay.inter:])
    elif act.gated:
        g = mm_fp32(x2, _wt(ins, lay, "gate_w"))                            # [T, I] fp32
        u = mm_fp32(x2, _wt(ins, lay, "up_w"))
        h = ck.activation(g, name, up=u, bias=b["gate_w"], bias_up=b["up_w"])
    else:                                                                   # bias + act
        h = ck.activation(mm_fp32(x2, _wt(ins, lay, "up_w")), name, bias=b["up_w"])
    wd = _wt(ins, lay, "down_w").float()                                    # [I, H]
    r, bd = ins.get("residual"), b["down_w"]
    if r is not None:
        y = torch.addmm(r.reshape(-1, lay.hidden).float(), h, wd)          # y = r + h @ wd
        if bd is not None:
            y = y.add_(bd.float())
    elif bd is not None:
        y = torch.addmm(bd.float(), h, wd)
    else:
        y = torch.mm(h, wd)
    return [y.to(x.dtype).reshape(x.shape)]


fused_feed_forward.takes_packed = True  # type: ignore[attr-defined]  # unpacks where it must


def _normed(p, ins) -> torch.Tensor:
    """x, RmsNorm'd first when the op carries its norm (``norm_eps``): the RmsNorm
    kernel's values, rounded to x's dtype."""
    if p.norm_eps is None:
        return ins["x"]
    from ...ops.registry import get_op
    from . import TORCH_KERNELS

    n, = TORCH_KERNELS["RmsNorm"].fn(get_op("RmsNorm").make_params({"eps": p.norm_eps}),
                                     {"x": ins["x"], "weight": ins["norm_weight"]})
    return n


def _composite(p, ins, lay):
    """The torch path (CUDA, plugin activations, no C compiler)."""
    x = ins["x"]
    act = p.activation
    xn = _normed(p, ins)

    def proj(a: torch.Tensor, w: str) -> torch.Tensor:
        y = mm_fp32(a, _wt(ins, lay, w))                                    # fp32
        b = ins.get(w[:-1] + "b")
        return y if b is None else y.add_(b.float())

    x2 = xn.reshape(-1, lay.hidden)                                         # [T, H]
    if p.gate_up_merged or not act.gated:
        h = act.torch(proj(x2, "gate_up_w" if p.gate_up_merged else "up_w"))
    else:
        h = act.torch(proj(x2, "gate_w"), proj(x2, "up_w"))                 # [T, I]
    y = proj(h, "down_w")                                                   # [T, H]
    r = ins.get("residual")
    if r is not None:
        y = y.add_(r.reshape(-1, lay.hidden).float())
    return [y.to(x.dtype).reshape(x.shape)]
