"""Serving pieces every front-end shares: sampling settings, requests, incremental
detokenization, the outputs ``LLM`` returns, and the framework-neutral decode loop
that ``atb_mindspore.LLM`` / ``atb_paddle.LLM`` run on (:mod:`.decode_loop`).

Importing this package imports no framework."""

from .detok import Detokenizer
from .outputs import GenerationStats, RequestOutput, TokenEvent
from .request import Request, SpecConfig
from .sampling_config import SamplingConfig, TokenLogprob, step_seed

__all__ = ["Detokenizer", "GenerationStats", "RequestOutput", "TokenEvent", "Request",
           "SpecConfig", "SamplingConfig", "TokenLogprob", "step_seed"]
