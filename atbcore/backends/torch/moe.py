"""Torch kernel for MoE: fp32 routing, tokens grouped per expert, and only the
experts that received tokens run (one gate_up GEMM, the activation and one down
GEMM each); results are weighted and added back per expert with ``index_add_``.

The token grouping is a stable sort of the T*k (token, expert) pairs by expert,
so each expert reads one contiguous slice of the gathered rows. Quantized experts
(``quant``) run each projection through the Linear kernel (on the CPU the C w8 / w8a8 /
w4 matmuls over layouts packed once per expert) in x's dtype, as a quantized Linear.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from . import TORCH_KERNELS, kernel
from . import linear as _linear  # noqa: F401  (the Linear kernel, registered first)
from .linear import mm_fp32

__all__ = ["route", "expert_views"]

_LOCK = threading.Lock()
_VIEWS: dict[int, tuple[Any, list]] = {}  # id(stacked tensor) -> (weakref, per-expert views)


def expert_views(t: Any) -> list:
    """``[t[0], t[1], ...]`` as views made once per stacked tensor ``t``, so the
    layouts packed per weight tensor are packed once per expert."""
    key = id(t)
    with _LOCK:
        hit = _VIEWS.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
    views = list(t.unbind(0))

    def drop(_ref: Any) -> None:
        with _LOCK:
            _VIEWS.pop(key, None)
    with _LOCK:
        _VIEWS[key] = (weakref.ref(t, drop), views)
    return views


def _expert_linear(p: Any, ins: dict, part: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s quantized projection ``part`` of rows ``x`` (x's dtype)."""
    z = ins.get(f"{part}_zeros")
    w = expert_views(ins["w_gate_up" if part == "gate_up" else "w_down"])[e]
    s = expert_views(ins[f"{part}_scale"])[e]
    z = None if z is None else expert_views(z)[e]
    lp = p.expert_linear(w.shape[0])
    return TORCH_KERNELS["Linear"].fn(lp, {"x": x, "weight": w, "scale": s, "zeros": z})[0]


def route(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from router logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


@kernel("MoE", impl="fp32 top-k routing + per-expert grouped GEMMs (experts hit only: "
        "11 + 6 launches per expert hit; declared for one top-2 token)",
        launches=23)
def moe(p, ins):
    x, gu, dn = ins["x"], ins["w_gate_up"], ins["w_down"]
    k, e_num = p.top_k, ins["router_w"].shape[0]
    x2 = x.reshape(-1, x.shape[-1])                                      # [T, H]
    w, ids = route(mm_fp32(x2, ins["router_w"].t()), k, p.norm_topk_prob)
    flat = ids.reshape(-1)                                               # [T*k] expert per pair
    order = torch.argsort(flat, stable=True)                             # pairs grouped by expert
    tok = order // k                                                     # token of each pair
    pair_w = w.reshape(-1)[order]                                        # [T*k]
    counts = torch.bincount(flat, minlength=e_num).tolist()
    xs = x2[tok]                                                         # [T*k, H] grouped rows
    out = torch.zeros(x2.shape, dtype=torch.float32, device=x.device)
    act = p.activation
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue                                                     # expert not hit: skipped
        sl = slice(start, start + n)
        start += n
        if p.quant:
            h = act.torch(_expert_linear(p, ins, "gate_up", e, xs[sl]).float())   # [n, I]
            y = _expert_linear(p, ins, "down", e, h.to(x.dtype)).float().mul_(pair_w[sl, None])
            out.index_add_(0, tok[sl], y)
            continue
        h = act.torch(mm_fp32(xs[sl], gu[e].t()))                        # [n, I]
        y = mm_fp32(h, dn[e].t()).mul_(pair_w[sl, None])                 # [n, H]
        out.index_add_(0, tok[sl], y)
    return [out.to(x.dtype).reshape(x.shape)]
