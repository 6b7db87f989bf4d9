"""``sample(probs)``: ``torch.multinomial(probs, 1)``'s exact draws, cheaper on a
large vocabulary.

Hugging Face samples with ``torch.multinomial(probs, 1)``. On the CPU torch draws one
Exp(1) variable per vocabulary entry (``q = -log1p(-u)``, ``u`` from 53 bits of two
mt19937 outputs of the default generator) and returns ``argmax(probs / q)``; that is
~1 ms per step at 32k entries, mostly the logarithms. Only the entries with
``probs > 0`` (the tokens top-k/top-p kept) can win the argmax, so here the raw
mt19937 outputs are produced in bulk (NumPy's MT19937, started from torch's generator
state), the logarithms are taken only where ``probs > 0``, and torch's generator is
moved on by exactly as many outputs as torch would have used: the same token and the
same generator state afterwards, so a seeded ``generate`` gives Hugging Face's tokens
and later draws are unaffected.

This follows torch's CPU generator layout and formula, so it is checked against
``torch.multinomial`` the first time it runs (generator state saved and restored);
on a mismatch, or off the CPU, or with non-finite probabilities, ``torch.multinomial``
itself runs (logged once).
"""

from __future__ import annotations

import numpy as np
import torch

from .hf_compat import log_once

__all__ = ["sample"]

_MASK53 = np.uint64((1 << 53) - 1)
_STATE_OFFSET, _LEFT_OFFSET, _NEXT_OFFSET, _N = 24, 8, 16, 624
_checked: list[bool] = []  # [] unknown, [True] verified, [False] torch.multinomial only


def _exp_draws(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices with probs > 0, their Exp(1) draws as float32) consuming the
    default generator as ``exponential_`` over all of ``probs`` would."""
    state = bytearray(torch.get_rng_state().numpy().tobytes())
    left = int(np.frombuffer(state, np.int32, 1, _LEFT_OFFSET)[0])
    nxt = int(np.frombuffer(state, np.uint64, 1, _NEXT_OFFSET)[0])
    key = np.frombuffer(state, np.uint64, _N, _STATE_OFFSET).astype(np.uint32)
    bits = np.random.MT19937()
    # torch regenerates its block when `left` runs out; NumPy when pos reaches 624
    bits.state = {"bit_generator": "MT19937",
                  "state": {"key": key, "pos": _N if left <= 1 else nxt}}
    raw = bits.random_raw(2 * probs.size)                   # 32-bit outputs, as uint64
    idx = np.flatnonzero(probs.reshape(-1) > 0)
    hi, lo = raw[2 * idx], raw[2 * idx + 1]
    u = ((hi << np.uint64(32)) | lo) & _MASK53
    q = (-np.log1p(-(u.astype(np.float64) * 2.0 ** -53))).astype(np.float32)
    after = bits.state["state"]
    pos = int(after["pos"])
    np.ndarray((_N,), np.uint64, buffer=state, offset=_STATE_OFFSET)[:] = after["key"]
    np.ndarray((1,), np.int32, buffer=state, offset=_LEFT_OFFSET)[0] = _N + 1 - pos
    np.ndarray((1,), np.uint64, buffer=state, offset=_NEXT_OFFSET)[0] = pos
    torch.set_rng_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    return idx, q


def _fast(probs: torch.Tensor) -> torch.Tensor | None:
    p = probs.contiguous().numpy()
    if not np.isfinite(p).all():
        return None  # torch.multinomial raises on these: let it
    idx, q = _exp_draws(p)
    b, v = p.shape
    ratio = p.reshape(-1)[idx] / q                  # float32 division, as torch's div_
    bounds = np.searchsorted(idx, np.arange(b + 1) * v)   # idx is sorted: rows are runs
    # argmax per row over its kept entries (the first on ties, as torch.argmax)
    out = [int(idx[lo + int(np.argmax(ratio[lo:hi]))] - r * v)
           for r, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return torch.tensor(out, dtype=torch.long)


def _verify() -> bool:
    saved = torch.get_rng_state()
    try:
        g = torch.Generator().manual_seed(0)
        probs = torch.rand(3, 700, generator=g)
        probs[probs < 0.6] = 0                               # kept entries only, as after top-p
        probs /= probs.sum(-1, keepdim=True)
        for seed in (0, 1, 12345):
            torch.manual_seed(seed)
            torch.rand(5)                                    # a generator mid-block
            ref = torch.multinomial(probs, 1).squeeze(1), torch.rand(4)
            torch.manual_seed(seed)
            torch.rand(5)
            ours = _fast(probs), torch.rand(4)
            if ours[0] is None:
                return False
            if not (torch.equal(ref[0], ours[0]) and torch.equal(ref[1], ours[1])):
                return False
        return True
    except Exception:  # noqa: BLE001 - any surprise means: use torch's own sampler
        return False
    finally:
        torch.set_rng_state(saved)


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]``: ``torch.multinomial(probs, 1)[:, 0]``
    exactly (same token, same generator state after)."""
    if not _checked:
        _checked.append(_verify())
        if not _checked[0]:
            log_once("sampling: this torch's CPU generator differs from what atb's sampler "
                     "reproduces -> torch.multinomial")
    out = None
    if _checked[0] and probs.device.type == "cpu" and probs.dtype == torch.float32 \
            and probs.dim() == 2:
        out = _fast(probs)
    return out if out is not None else torch.multinomial(probs, num_samples=1).squeeze(1)
