"""Torch kernel for MoE: fp32 routing, tokens grouped per expert, and only the
experts that received tokens run (one gate_up GEMM, the activation and one down
GEMM each); results are weighted and added back per expert with ``index_add_``.

The token grouping is a stable sort of the T*k (token, expert) pairs by expert,
so each expert reads one contiguous slice of the gathered rows.
"""

from __future__ import annotations

import torch

from . import kernel
from .linear import mm_fp32

__all__ = ["route"]


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
        h = act.torch(mm_fp32(xs[sl], gu[e].t()))                        # [n, I]
        y = mm_fp32(h, dn[e].t()).mul_(pair_w[sl, None])                 # [n, H]
        out.index_add_(0, tok[sl], y)
    return [out.to(x.dtype).reshape(x.shape)]
