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
  the sorted values alone — and NumPy's value sort is ~20x cheaper. The cumulative
  sum skips the leading zero probabilities (after top-k: all but tens of columns),
  which add nothing. The kept tokens are then those at or above the first kept
  value; if that value ties with the last removed one (which index Hugging Face
  removes then depends on its sort's order) the original runs.
* ``TopKLogitsWarper``: the same ``topk`` threshold, the fill done by NumPy.
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


def _fill_below(scores: torch.Tensor, threshold: np.ndarray, fill: float) -> torch.Tensor:
    """``scores.masked_fill(scores < threshold, fill)`` (``threshold`` [B, 1]) through
    NumPy: the same comparison (NaN is never below) and the same float32 fill,
    several times cheaper on a 32k row than torch's compare-and-fill here."""
    x = scores.numpy()
    y = x.copy()
    y[x < threshold] = fill
    return torch.from_numpy(y)


def _ascending_cumsum(probs: torch.Tensor) -> torch.Tensor:
    """``probs.cumsum(-1)`` of an ascending softmax row set, from the first column any
    row has a nonzero probability in: the zeros before it add nothing (torch's
    cumsum runs each row in order), so the sums are the same bits while the scan
    covers only the kept tail (after top-k: tens of columns, not the vocabulary)."""
    p = probs.numpy()
    nonzero = p != 0
    if np.isnan(p).any() or not nonzero.any(axis=-1).all():
        return probs.cumsum(dim=-1)
    start = int(nonzero.argmax(axis=-1).min())
    cum = torch.zeros_like(probs)
    cum[:, start:] = probs[:, start:].cumsum(dim=-1)
    return cum


def _top_p(proc: Any) -> Processor:
    top_p, keep, fill = float(proc.top_p), int(proc.min_tokens_to_keep), proc.filter_value
    # Hugging Face compares float32 cumulative probabilities with this, cast to float32
    limit = np.float32(1 - top_p)

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if (scores.dtype != torch.float32 or scores.device.type != "cpu" or scores.dim() != 2
                or scores.requires_grad):
            return proc(ids, scores)
        ordered = np.sort(scores.numpy(), axis=-1)                        # [B, V] ascending
        cum = _ascending_cumsum(torch.from_numpy(ordered).softmax(dim=-1)).numpy()
        if np.isnan(cum[:, -1]).any():
            return proc(ids, scores)                        # NaN scores: Hugging Face's own
        # removed: the prefix with cum <= limit, keeping at least `keep` at the top
        # (cum is nondecreasing: NumPy's right-side search finds torch.searchsorted's cut)
        v = scores.shape[-1]
        cut = np.array([np.searchsorted(row, limit, side="right") for row in cum])
        cut = np.minimum(cut, max(v - keep, 0))
        if not cut.any():
            return scores
        rows = np.arange(ordered.shape[0])
        first_kept = ordered[rows, np.minimum(cut, v - 1)]
        last_removed = ordered[rows, np.maximum(cut - 1, 0)]
        if ((first_kept == last_removed) & (cut > 0)).any():
            return proc(ids, scores)                        # a tie at the cut: sort order decides
        return _fill_below(scores, first_kept[:, None], fill)

    return call


def _top_k(proc: Any) -> Processor:
    top_k, fill = int(proc.top_k), proc.filter_value

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if (scores.dtype != torch.float32 or scores.device.type != "cpu" or scores.dim() != 2
                or scores.requires_grad):
            return proc(ids, scores)
        kth = torch.topk(scores, min(top_k, scores.shape[-1]))[0][..., -1:]  # [B, 1]
        return _fill_below(scores, kth.numpy(), fill)

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

    return {lp.TopPLogitsWarper: _top_p, lp.TopKLogitsWarper: _top_k,
            lp.MinLengthLogitsProcessor: _min_len,
            lp.MinNewTokensLengthLogitsProcessor: _min_new}


FAST: dict[type, Callable[[Any], Processor]] = {}


def accelerate(processors: Any) -> list[Processor]:
    """``processors`` (a ``LogitsProcessorList``) with the known ones replaced by their
    faster equivalents (see the module docstring); call them in order."""
    if not FAST:
        FAST.update(_registry())
    return [FAST[type(p)](p) if type(p) in FAST else p for p in processors]
