"""Serving text generation with atb: :class:`LLM` (continuous batching over a paged KV
cache, prefix caching, prompt-lookup speculative decoding, streaming) and the
``atb bench`` harness (:mod:`.bench`)."""

from .llm import LLM
from .outputs import GenerationStats, RequestOutput, TokenEvent
from .sampling import SamplingConfig

__all__ = ["LLM", "GenerationStats", "RequestOutput", "TokenEvent", "SamplingConfig"]
