"""Serving pieces every front-end shares: sampling settings, requests, incremental
detokenization, the outputs ``LLM`` returns, and the serving engine every ``LLM``
runs on (:mod:`.engine`: continuous batching over a paged KV cache, prefix caching,
preemption, prompt-lookup speculation; :mod:`.paged_model` runs the core lowered
decoder for it).

Importing this package imports no framework."""

from .detok import Detokenizer
from .outputs import GenerationStats, RequestOutput, TokenEvent
from .request import Request, SpecConfig
from .sampling_config import SamplingConfig, TokenLogprob, step_seed

__all__ = ["Detokenizer", "GenerationStats", "RequestOutput", "TokenEvent", "Request",
           "SpecConfig", "SamplingConfig", "TokenLogprob", "step_seed"]
