"""``sample(probs)``: ``torch.multinomial(probs, 1)``'s exact draw, cheaper on a large
vocabulary.

Hugging Face samples with ``torch.multinomial(probs, 1)``. On the CPU torch draws one
Exp(1) variable per vocabulary entry — ``q = -log1p(-u)`` in float64, cast to float32,
where ``u`` is the default generator's next 53-bit uniform — and returns
``argmax(probs / q)``: at 32k entries that is ~0.8 ms a step, mostly the logarithms.
Only entries with ``probs > 0`` (what top-k/top-p kept) can win the argmax, so here the
same uniforms are drawn (the same numbers, the same generator state afterwards) and
the logarithm is taken only where ``probs > 0``: the same token. The uniforms come
from the C kernels' MT19937 stepped over torch's generator state
(:func:`atbcore.backends.cpu_kernels.torch_sampling.mt19937_uniforms`: only the kept
draws are tempered, the state twist is vectorised), or without the C kernels from
``uniform_`` on a float64 buffer a cache-sized chunk at a time (the same generator
calls in the same order).

It relies on how torch's CPU ``exponential_`` uses its generator, so it is checked
against ``torch.multinomial`` the first time it runs (generator state saved and
restored); on a mismatch — or off the CPU, for non-float32 input, or for
probabilities ``torch.multinomial`` would refuse — ``torch.multinomial`` runs.
"""

from __future__ import annotations

import numpy as np
import torch

from atbcore.backends.cpu_kernels.torch_sampling import mt19937_uniforms

from .hf_compat import log_once

__all__ = ["draw_at", "sample", "verified"]

_verified: list[bool] = []  # [] not checked yet, [True] same draws as torch, [False] not


# uniforms drawn per call of uniform_: a 128 KiB buffer that stays in the L2 cache, where one
# of the whole [B, V] shape would be a cold 256 KiB write per step
CHUNK = 16384


def _kept_uniforms(flat_kept: np.ndarray, n: int) -> np.ndarray:
    """The generator's next ``n`` float64 uniforms (all drawn, in order, as one
    ``uniform_`` over ``n`` entries draws them), keeping those at ``flat_kept``
    (ascending): the C kernels' MT19937 when they load, else torch's ``uniform_``."""
    out = mt19937_uniforms(n, flat_kept)
    if out is not None:
        return out
    buf = torch.empty(min(CHUNK, n), dtype=torch.float64)
    view = buf.numpy()
    out = np.empty(len(flat_kept))
    for c0 in range(0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        buf[:c1 - c0].uniform_()
        lo, hi = np.searchsorted(flat_kept, (c0, c1))
        out[lo:hi] = view[flat_kept[lo:hi] - c0]
    return out


def _draw(probs: torch.Tensor) -> torch.Tensor | None:
    p = probs.numpy()
    flat = p.reshape(-1)
    kept = np.flatnonzero(flat)                        # probabilities > 0 (and NaN), in order
    v = p.shape[-1]
    bounds = np.searchsorted(kept, np.arange(p.shape[0] + 1) * v)
    if (np.diff(bounds) == 0).any():
        return None  # a row of zeros: torch.multinomial raises on it, let it
    # NaN/inf anywhere shows in its row's sum of nonzero entries (a softmax gives >= 0)
    total = np.add.reduceat(flat[kept], bounds[:-1])
    if not np.isfinite(total).all() or (total <= 0).any():
        return None  # torch.multinomial raises on these: let it
    return draw_at(kept, flat[kept], bounds, flat.size)


def draw_at(kept: np.ndarray, probs: np.ndarray, bounds: np.ndarray, size: int) -> torch.Tensor:
    """``torch.multinomial(full, 1)[:, 0]`` for a ``[B, V]`` row set ``full`` of ``size``
    entries that is 0 but at the flat positions ``kept`` (ascending), where it holds
    ``probs`` (float32, finite, each row's sum > 0; row r's entries are
    ``kept[bounds[r]:bounds[r + 1]]``). The generator moves as that call moves it."""
    u = _kept_uniforms(kept, size)                     # the draws, in order
    q = (-np.log1p(-u)).astype(np.float32)             # Exp(1), as torch
    ratio = probs / q
    v = size // (len(bounds) - 1)
    out = []
    for r in range(len(bounds) - 1):
        lo, hi = bounds[r], bounds[r + 1]
        out.append(int(kept[lo + np.argmax(ratio[lo:hi])] - r * v))  # first max, as argmax
    return torch.tensor(out, dtype=torch.long)


def verified() -> bool:
    """Whether atb's draw gives ``torch.multinomial``'s tokens here (checked once)."""
    if not _verified:
        _verified.append(_verify())
        if not _verified[0]:
            log_once("sampling: torch's CPU multinomial draws differently from what atb "
                     "reproduces -> torch.multinomial")
    return _verified[0]


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
    out = None
    if verified() and probs.device.type == "cpu" and probs.dtype == torch.float32 \
            and probs.dim() == 2:
        out = _draw(probs.contiguous())
    return out if out is not None else torch.multinomial(probs, num_samples=1).squeeze(1)
