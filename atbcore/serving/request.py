"""A request in flight through the serving engine (:mod:`.engine`), and the
speculative decoding settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from .detok import Detokenizer
from .outputs import GenerationStats
from .sampling_config import SamplingConfig, TokenLogprob

__all__ = ["Request", "SpecConfig"]


@dataclass(frozen=True)
class SpecConfig:
    """Prompt-lookup drafting: up to ``num_tokens`` drafts from n-grams of
    ``min_ngram..max_ngram`` tokens."""

    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1


@dataclass(eq=False)  # identity: two requests with equal fields are still two requests
class Request:
    """One prompt (or one of its ``n`` choices) in flight: its tokens, limits, sampling
    settings and the statistics object of the call that made it (see
    ``atbcore.serving.engine`` for the cache invariant)."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int]
    detok: Detokenizer
    output: list[int] = field(default_factory=list)
    seq_id: Hashable = None
    num_cached: int = 0
    finish_reason: str | None = None
    ctx_cached: int = 0  # context tokens served by the prefix cache at (re)admission
    key: tuple[int, int] = (0, 0)  # (seed, stream) of its sampling draws
    error: str | None = None  # why it failed (finish_reason "error")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stats: GenerationStats = field(default_factory=GenerationStats, repr=False)
    logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)
    sink: Any = field(default=None, repr=False)  # where the engine's owner sends its events
    life: int = 0  # how often it was preempted (each life has its own cache sequence)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output
