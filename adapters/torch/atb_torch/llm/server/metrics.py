"""Prometheus metrics of ``atb serve`` (``GET /metrics``), through ``prometheus_client``
on a registry of the server's own (two servers in one process do not mix counts).

    atb_requests_total{endpoint,status}     HTTP requests answered
    atb_prompt_tokens_total                 prompt tokens admitted
    atb_generation_tokens_total             tokens generated
    atb_time_to_first_token_seconds         request arrival -> first token (histogram)
    atb_inter_token_latency_seconds         between a request's tokens (histogram)
    atb_batch_size                          sequences per model step (histogram)
    atb_requests_running / _waiting         in the engine now
    atb_kv_blocks_used / atb_kv_blocks_total
    atb_prefix_cache_hit_rate               prompt tokens served by the prefix cache
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    """The server's metrics; :meth:`attach` binds the engine-side ones to an ``LLM``."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("atb_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("atb_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("atb_generation_tokens", "tokens generated",
                                         registry=r)
        self.ttft = Histogram("atb_time_to_first_token_seconds",
                              "request arrival to its first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("atb_inter_token_latency_seconds",
                             "time between two tokens of a request", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.batch_size = Histogram("atb_batch_size", "sequences in one model step",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.running = Gauge("atb_requests_running", "sequences running in the engine",
                             registry=r)
        self.waiting = Gauge("atb_requests_waiting", "sequences waiting for a batch slot",
                             registry=r)
        self.kv_used = Gauge("atb_kv_blocks_used", "KV-cache blocks held by sequences",
                             registry=r)
        self.kv_total = Gauge("atb_kv_blocks_total", "KV-cache blocks in all", registry=r)
        self.prefix_hit_rate = Gauge("atb_prefix_cache_hit_rate",
                                     "share of looked-up prompt tokens served by the prefix "
                                     "cache", registry=r)

    def attach(self, llm: Any) -> None:
        """Read the engine's state at scrape time and observe every model step."""
        loop = llm.loop
        self.running.set_function(lambda: loop.num_running)
        self.waiting.set_function(lambda: loop.num_waiting)
        if llm.cache is not None:  # a tensor-parallel LLM has no paged cache: gauges stay 0
            self._attach_cache(llm.cache.manager, llm.cache.num_blocks)

        earlier = llm.engine.on_step  # another server on the same LLM keeps its own

        def on_step(kind: str, batch_size: int, num_tokens: int) -> None:
            self.batch_size.observe(batch_size)
            if earlier is not None:
                earlier(kind, batch_size, num_tokens)

        llm.engine.on_step = on_step

    def _attach_cache(self, manager: Any, num_blocks: int) -> None:
        self.kv_used.set_function(lambda: manager.num_used_blocks)
        self.kv_total.set(num_blocks)

        def hit_rate() -> float:
            prefix = manager.prefix
            return float(prefix.stats()["hit_rate"]) if prefix is not None else 0.0

        self.prefix_hit_rate.set_function(hit_rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
