"""Faster equivalents of Hugging Face logits processors for atb's decoding loop.

``accelerate(processors)`` returns the list ``generate`` built with the processors
listed in :data:`FAST` swapped for a function that gives the same scores, bit for bit,
at a fraction of the cost on a large vocabulary; every other processor stays as it
is (they are cheap, or only Hugging Face knows them). A registry keyed by type, so a
processor class is either known exactly or left alone (subclasses are left alone:
they may change the behaviour).

* ``TopPLogitsWarper``: Hugging Face sorts the whole vocabulary with indices (an
  argsort: milliseconds at 32k tokens). Only the sorted *values* are needed to find
  the cut — the ascending cumulative softmax Hugging Face computes is a function of
  the sorted values alone — and a value sort is ~40x cheaper (after top-k, only the
  finite values are sorted: the -inf run before them is known). The kept tokens are then
  those at or above the first kept value; if that value ties with the last removed
  one (which index Hugging Face removes then depends on its sort's order) the
  original runs.
* ``MinLengthLogitsProcessor`` / ``MinNewTokensLengthLogitsProcessor``: Hugging Face
  rebuilds an EOS mask over the vocabulary every step; here the EOS columns are set
  to -inf directly while the length is short, and the scores pass through after.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["accelerate", "FAST"]

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _sorted_values(x: np.ndarray) -> np.ndarray:
    """``np.sort(x, axis=-1)`` (what ``torch.sort(x).values`` is), quicker when most of a
    row is -inf (after top-k or bad words): the -inf run, then the rest sorted."""
    finite = np.isfinite(x)
    n = finite.sum(axis=-1)
    if x.shape[0] != 1 or n[0] * 8 > x.shape[-1] or (x[~finite] != -np.inf).any():
        return np.sort(x, axis=-1)
    out = np.full_like(x, -np.inf)
    out[0, x.shape[-1] - n[0]:] = np.sort(x[finite])
    return out


def _top_p(proc: Any) -> Processor:
    top_p, keep, fill = float(proc.top_p), int(proc.min_tokens_to_keep), proc.filter_value
    # Hugging Face compares float32 cumulative probabilities with this, cast to float32
    limit = torch.tensor([1 - top_p], dtype=torch.float32)

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.dtype != torch.float32 or scores.device.type != "cpu":
            return proc(ids, scores)
        ordered = torch.from_numpy(_sorted_values(scores.numpy()))          # [B, V] ascending
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)                        # nondecreasing
        # removed: the prefix with cum <= limit, keeping at least `keep` at the top
        cut = torch.searchsorted(cum, limit.expand(cum.shape[0], 1), right=True)[:, 0]
        cut = cut.clamp(max=max(scores.shape[-1] - keep, 0))
        if not bool(cut.any()):
            return scores
        rows = torch.arange(scores.shape[0])
        first_kept = ordered[rows, cut.clamp(max=scores.shape[-1] - 1)]
        last_removed = ordered[rows, (cut - 1).clamp(min=0)]
        if bool(((first_kept == last_removed) & (cut > 0)).any()):
            return proc(ids, scores)                        # a tie at the cut: sort order decides
        return scores.masked_fill(scores < first_kept[:, None], fill)

    return call


def _min_length(proc: Any, short: Callable[[torch.Tensor], bool]) -> Processor:
    eos = proc.eos_token_id
    eos = torch.as_tensor(eos if eos is not None else [], dtype=torch.long).reshape(-1)

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not short(ids):
            return scores
        cols = eos[(eos >= 0) & (eos < scores.shape[-1])].to(scores.device)
        out = scores.clone()
        out[:, cols] = -math.inf
        return out

    return call


def _min_len(proc: Any) -> Processor:
    return _min_length(proc, lambda ids: ids.shape[-1] < proc.min_length)


def _min_new(proc: Any) -> Processor:
    return _min_length(proc, lambda ids: ids.shape[-1] - proc.prompt_length_to_skip
                       < proc.min_new_tokens)


def _registry() -> dict[type, Callable[[Any], Processor]]:
    from transformers.generation import logits_process as lp

    return {lp.TopPLogitsWarper: _top_p, lp.MinLengthLogitsProcessor: _min_len,
            lp.MinNewTokensLengthLogitsProcessor: _min_new}


FAST: dict[type, Callable[[Any], Processor]] = {}


def accelerate(processors: Any) -> list[Processor]:
    """``processors`` (a ``LogitsProcessorList``) with the known ones replaced by their
    faster equivalents (see the module docstring); call them in order."""
    if not FAST:
        FAST.update(_registry())
    return [FAST[type(p)](p) if type(p) in FAST else p for p in processors]
