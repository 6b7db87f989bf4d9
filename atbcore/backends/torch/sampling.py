"""Torch kernels for Argmax and TopkToppSampling.

Sampling follows :mod:`atbcore.ops.sampling` step for step in float64, with the
per-row uniforms drawn through NumPy from the seed, so both backends pick the
same ids."""

from __future__ import annotations

import torch

from ...ops.sampling import finite_logits, sampling_uniforms, sampling_weights
from . import kernel

__all__ = ["argmax", "topk_topp_sampling"]


@kernel("Argmax", impl="torch.argmax")
def argmax(p, ins):
    return [torch.argmax(ins["x"], dim=p.dim, keepdim=p.keepdim)]


def _sample_sorted(sl: torch.Tensor, u: torch.Tensor, p) -> torch.Tensor:
    # sl: [B, V] float64 logits / temperature, sorted descending
    e = sampling_weights(sl, torch)
    probs = e / e.sum(dim=-1, keepdim=True)
    v = probs.shape[-1]
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k:
        keep[:, min(p.top_k, v):] = False
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if p.top_p < 1.0:
        c = torch.cumsum(probs, dim=-1)
        before = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], dim=-1)
        keep &= before < p.top_p
        probs = torch.where(keep, probs, 0.0)
    c = torch.cumsum(probs, dim=-1)
    c = c / c[:, -1:]
    return (c <= u[:, None]).sum(dim=-1)


@kernel("TopkToppSampling", impl="torch sort + cumsum inverse-CDF sampling (float64)",
        launches=33)
def topk_topp_sampling(p, ins):
    x = finite_logits(ins["logits"].double(), torch)
    if p.temperature == 0.0:
        return [torch.argmax(x, dim=-1)]
    x = x / p.temperature
    sl, order = torch.sort(x, dim=-1, descending=True, stable=True)
    u = torch.from_numpy(sampling_uniforms(p.seed, x.shape[0])).to(x.device)
    pos = _sample_sorted(sl, u, p)
    return [torch.gather(order, -1, pos[:, None])[:, 0]]
