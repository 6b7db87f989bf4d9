"""Faster equivalents of Hugging Face logits processors for atb's decoding loop.

``accelerate(processors)`` returns the list ``generate`` built with the processors
listed in :data:`FAST` swapped for a function that gives the same scores, bit for bit,
at a fraction of the cost on a large vocabulary; every other processor stays as it
is (only Hugging Face knows them). A registry keyed by type, so a processor class is
either known exactly or left alone (subclasses are left alone: they may change the
behaviour).

Hugging Face's processors return a new row each (a 32k-entry row is a copy of
128 KiB, tens of microseconds when cold, as it is after a decode step has streamed
the weights through the caches). The decoding loop hands the list a private copy of
the logits, so the simple processors here write into it in place:

* ``TemperatureLogitsWarper``: ``scores.div_(t)``, the same division.
* ``MinLengthLogitsProcessor`` / ``MinNewTokensLengthLogitsProcessor``: Hugging Face
  builds an EOS mask over the vocabulary every step; here the EOS columns are set to
  -inf while the length is short, and the scores pass through after.
* ``RepetitionPenaltyLogitsProcessor``: one C call over the seen tokens' scores
  (:func:`atbcore.backends.cpu_kernels.torch_sampling.repetition_penalty_`), or
  one gather and one in-place scatter (Hugging Face also pads and copies the row).

An in-place processor placed after one that is not from this module clones first:
a foreign processor may return a tensor it still holds. Top-k and top-p are in
:mod:`.top_p`; the sampling step that fuses them with the draw is :mod:`.sample_step`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

from atbcore.backends.cpu_kernels.torch_sampling import repetition_penalty_

from .top_p import Processor, plain, top_k, top_k_top_p, top_p

__all__ = ["accelerate", "accelerate_tracked", "FAST", "Processor", "thread_invariant"]


def _in_place(call: Processor) -> Processor:
    call.in_place = True  # type: ignore[attr-defined]
    return call


def _temperature(proc: Any) -> Processor:
    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.div_(proc.temperature) if plain(scores) else proc(ids, scores)

    return _in_place(call)


def _min_length(proc: Any, short: Callable[[torch.Tensor], bool]) -> Processor:
    eos = proc.eos_token_id
    eos = torch.as_tensor(eos if eos is not None else [], dtype=torch.long).reshape(-1)
    columns: dict[int, torch.Tensor] = {}  # vocabulary size -> the EOS ids inside it

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.dim() != 2:
            return proc(ids, scores)
        if not short(ids):
            return scores
        v = scores.shape[-1]
        if v not in columns:
            columns[v] = eos[(eos >= 0) & (eos < v)]  # Hugging Face masks isin(arange(v), eos)
        return scores.index_fill_(1, columns[v].to(scores.device), -math.inf)

    return _in_place(call)


def _min_len(proc: Any) -> Processor:
    return _min_length(proc, lambda ids: ids.shape[-1] < proc.min_length)


def _min_new(proc: Any) -> Processor:
    return _min_length(proc, lambda ids: ids.shape[-1] - proc.prompt_length_to_skip
                       < proc.min_new_tokens)


def _same_ops_as_torch(penalty: float) -> bool:
    """Whether torch's ``s * penalty`` and ``s / penalty`` (a Python float) are the
    float32 ops with ``float32(penalty)`` the C penalty uses, on a probe row."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 20
    p = np.float32(penalty)
    return np.array_equal((x * penalty).numpy(), x.numpy() * p) and \
        np.array_equal((x / penalty).numpy(), x.numpy() / p)


def _repetition(proc: Any) -> Processor:
    in_c = isinstance(proc.penalty, float) and _same_ops_as_torch(proc.penalty)

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        skip = getattr(proc, "prompt_ignore_length", None)
        if not plain(scores) or ids.dim() != 2 or ids.shape[0] != scores.shape[0] \
                or not (skip is None or isinstance(skip, int)) \
                or getattr(proc, "logits_indices", None) is not None:
            return proc(ids, scores)
        seen = ids[:, skip:] if skip else ids
        if in_c and repetition_penalty_(scores, seen, proc.penalty):
            return scores  # one C call (ids outside the vocabulary: False, untouched)
        if seen.numel() == 0 or int(seen.min()) < 0 or int(seen.max()) >= scores.shape[-1]:
            return proc(ids, scores)  # ids past the vocabulary: each release has its rule
        score = torch.gather(scores, 1, seen)
        score = torch.where(score < 0, score * proc.penalty, score / proc.penalty)
        return scores.scatter_(1, seen, score)  # duplicates write the same value

    return _in_place(call)


def _registry() -> dict[type, Callable[[Any], Processor]]:
    from transformers.generation import logits_process as lp

    return {lp.TopPLogitsWarper: top_p, lp.TopKLogitsWarper: top_k,
            lp.TemperatureLogitsWarper: _temperature,
            lp.MinLengthLogitsProcessor: _min_len,
            lp.MinNewTokensLengthLogitsProcessor: _min_new,
            lp.RepetitionPenaltyLogitsProcessor: _repetition}


FAST: dict[type, Callable[[Any], Processor]] = {}

# Hugging Face processors whose scores do not depend on torch's intra-op thread count:
# elementwise work, gathers and scatters, sorts, top-k, row-wise softmax, max and
# cumulative sums (no reduction over the vocabulary that torch splits between
# threads, as the typical and entropy warpers' sums are past 32k columns)
_THREAD_INVARIANT_NAMES = (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor",
    "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
    "InfNanRemoveLogitsProcessor")
THREAD_INVARIANT: set[type] = set()


def thread_invariant(processors: Any) -> bool:
    """True when every processor in ``processors`` is one whose scores are the same
    bits at any torch thread count (so the decoding loop may run them on one thread)."""
    if not THREAD_INVARIANT:
        from transformers.generation import logits_process as lp

        THREAD_INVARIANT.update(getattr(lp, n) for n in _THREAD_INVARIANT_NAMES if hasattr(lp, n))
    return all(type(p) in THREAD_INVARIANT for p in processors)


def _cloned(call: Processor) -> Processor:
    def first_clone(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return call(ids, scores.clone())

    return first_clone


def accelerate(processors: Any, private: bool = True) -> list[Processor]:
    """``processors`` (a ``LogitsProcessorList``) with the known ones replaced by their
    faster equivalents (see the module docstring); call them in order.

    ``private``: whether the scores given to the first one are the caller's own copy,
    which in-place processors may write into (``generate``'s loop passes one)."""
    return accelerate_tracked(processors, private)[0]


def accelerate_tracked(processors: Any, private: bool = True) -> tuple[list[Processor], bool]:
    """:func:`accelerate`, and whether the scores the last one returns are private
    (what ``private`` says for a list that runs after these)."""
    if not FAST:
        FAST.update(_registry())
    from transformers.generation import logits_process as lp

    out: list[Processor] = []
    procs = list(processors)
    i = 0
    while i < len(procs):
        p = procs[i]
        nxt = procs[i + 1] if i + 1 < len(procs) else None
        if (type(p) is lp.TopKLogitsWarper and type(nxt) is lp.TopPLogitsWarper
                and p.filter_value == -math.inf):
            out.append(top_k_top_p(p, nxt))  # the sampling default's pair, fused
            i += 2
            continue
        if type(p) not in FAST:
            out.append(p)
            private = False  # it may return a tensor it holds
        else:
            fast = FAST[type(p)](p)
            if getattr(fast, "in_place", False) and not private:
                fast, private = _cloned(fast), True
            out.append(fast)
        i += 1
    return out, private
