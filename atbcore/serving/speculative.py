"""Prompt-lookup speculative decoding: drafts copied from the sequence itself.

When the last ``n`` tokens of a sequence appeared earlier in it (prompt or output),
the tokens that followed that earlier occurrence are proposed as the next ones; the
model checks all of them in one multi-token step. Acceptance is exact: draft token
``i`` is kept only when it equals the token the model itself picks at that position
(argmax, or the seeded sample of that position), so the output is identical to plain
decoding; each step also yields one token of the model's own (the first mismatch, or
the one after the last draft)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["propose_draft", "accept_draft", "SpecStats"]


def propose_draft(tokens: Sequence[int], num_draft: int = 4, max_ngram: int = 3,
                  min_ngram: int = 1) -> list[int]:
    """Up to ``num_draft`` tokens that followed an earlier occurrence of the longest
    suffix n-gram (``max_ngram`` down to ``min_ngram``): the most recent occurrence
    with a full ``num_draft`` continuation, else the longest continuation; ``[]``
    if the suffix never occurred before."""
    n_tok = len(tokens)
    if num_draft < 1:
        return []
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tok - n:])
        best: list[int] = []
        # most recent first: recent context predicts best (repeated code, lists)
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + num_draft])
                if len(follow) == num_draft:
                    return follow
                if len(follow) > len(best):
                    best = follow
        if best:
            return best
    return []


def accept_draft(draft: Sequence[int], chosen: Sequence[int]) -> list[int]:
    """The tokens a verify step emits. ``chosen[i]`` is the model's own token after the
    context plus ``draft[:i]`` (``len(chosen) == len(draft) + 1``): drafts are kept
    while they equal the model's choice, then the model's token at the first mismatch
    (or after the last draft) is appended."""
    out: list[int] = []
    for d, c in zip(draft, chosen):
        if d != c:
            break
        out.append(d)
    out.append(chosen[len(out)])
    return out


@dataclass
class SpecStats:
    """Counters of speculative decoding: ``proposed`` draft tokens checked,
    ``accepted`` of them kept, ``steps`` verify steps run."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0
