"""``sample(probs)``: ``torch.multinomial(probs, 1)``'s exact draw, cheaper on a large
vocabulary.

Hugging Face samples with ``torch.multinomial(probs, 1)``. On the CPU torch draws one
Exp(1) variable per vocabulary entry — ``q = -log1p(-u)`` in float64, cast to float32,
where ``u`` is the default generator's next 53-bit uniform — and returns
``argmax(probs / q)``: at 32k entries that is ~0.8 ms a step, mostly the logarithms.
Only entries with ``probs > 0`` (what top-k/top-p kept) can win the argmax, so here the
same uniforms are drawn with ``uniform_`` on a float64 buffer (the same generator
calls, so the same numbers and the same generator state afterwards) and the
logarithm is taken only where ``probs > 0``: the same token, ~0.25 ms.

It relies on how torch's CPU ``exponential_`` uses its generator, so it is checked
against ``torch.multinomial`` the first time it runs (generator state saved and
restored); on a mismatch — or off the CPU, for non-float32 input, or for
probabilities ``torch.multinomial`` would refuse — ``torch.multinomial`` runs.
"""

from __future__ import annotations

import numpy as np
import torch

from .hf_compat import log_once

__all__ = ["sample"]

_verified: list[bool] = []  # [] not checked yet, [True] same draws as torch, [False] not


def _draw(probs: torch.Tensor) -> torch.Tensor | None:
    p = probs.numpy()
    total = p.sum(axis=-1)  # NaN/inf anywhere shows here (probs come from a softmax: >= 0)
    if not np.isfinite(total).all() or (total <= 0).any():
        return None  # torch.multinomial raises on these: let it
    u = torch.empty(p.shape, dtype=torch.float64).uniform_().numpy()   # the draws, in order
    out = []
    for row_p, row_u in zip(p, u):
        kept = np.flatnonzero(row_p > 0)
        q = (-np.log1p(-row_u[kept])).astype(np.float32)               # Exp(1), as torch
        out.append(int(kept[np.argmax(row_p[kept] / q)]))              # first max, as argmax
    return torch.tensor(out, dtype=torch.long)


def _verify() -> bool:
    saved = torch.get_rng_state()
    try:
        g = torch.Generator().manual_seed(0)
        probs = torch.rand(3, 700, generator=g)
        probs[probs < 0.6] = 0
        probs /= probs.sum(-1, keepdim=True)
        for seed in (0, 1, 12345):
            torch.manual_seed(seed)
            ref = torch.multinomial(probs, 1).squeeze(1), torch.rand(4)
            torch.manual_seed(seed)
            ours = _draw(probs), torch.rand(4)
            if ours[0] is None or not (torch.equal(ref[0], ours[0]) and torch.equal(ref[1], ours[1])):
                return False
        return True
    except Exception:  # noqa: BLE001 - any surprise means: use torch's own sampler
        return False
    finally:
        torch.set_rng_state(saved)


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]`` (non-negative, as a softmax gives):
    ``torch.multinomial(probs, 1)[:, 0]`` exactly (the same token, the same
    generator state after)."""
    if not _verified:
        _verified.append(_verify())
        if not _verified[0]:
            log_once("sampling: torch's CPU multinomial draws differently from what atb "
                     "reproduces -> torch.multinomial")
    out = None
    if _verified[0] and probs.device.type == "cpu" and probs.dtype == torch.float32 \
            and probs.dim() == 2:
        out = _draw(probs.contiguous())
    return out if out is not None else torch.multinomial(probs, num_samples=1).squeeze(1)
