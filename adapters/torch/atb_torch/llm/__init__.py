"""Serving text generation with atb: :class:`LLM` (continuous batching over a paged KV
cache, prefix caching, prompt-lookup speculative decoding, streaming) as a client of
one engine thread (:mod:`.loop`), sharded over ranks with ``tensor_parallel_size``
(:mod:`.tp`), the OpenAI-compatible server (:mod:`.server`) and
the ``atb bench`` harness (:mod:`.bench`)."""

from .llm import LLM
from .loop import EngineClosedError, EngineLoop, RequestHandle
from .outputs import GenerationStats, RequestOutput, TokenEvent
from .sampling import SamplingConfig, TokenLogprob

__all__ = ["LLM", "GenerationStats", "RequestOutput", "TokenEvent", "SamplingConfig",
           "TokenLogprob", "EngineLoop", "RequestHandle", "EngineClosedError"]
