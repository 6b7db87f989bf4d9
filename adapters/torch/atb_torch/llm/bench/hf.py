"""The baselines users run today: Hugging Face eager, and HF under ``torch.compile``
with a static cache.

Both decode greedily with a hand-written loop (prefill, then one ``forward`` per token
with the model's cache) rather than ``generate``: the loop leaves out ``generate``'s
per-step bookkeeping, so the baseline is the fastest way to run HF eager, and the
prefill and decode steps can be timed apart."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DecodeRun", "hf_greedy", "StaticCompiled"]


@dataclass
class DecodeRun:
    """One greedy generation: ``tokens`` ``[B, N]``, ``prefill_s`` (prompt to first
    token), ``decode_s`` (the other N - 1 tokens), ``logits`` (per step ``[B, V]``
    float32, when recorded)."""

    tokens: torch.Tensor
    prefill_s: float
    decode_s: float
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def hf_greedy(model: Any, ids: torch.Tensor, new_tokens: int, record: bool = False,
              forced: torch.Tensor | None = None) -> DecodeRun:
    """Greedy decoding with HF's eager forward and its dynamic cache. ``forced``
    ``[B, N]`` feeds those tokens instead of the argmax (teacher forcing, to compare
    logits along another run's path)."""
    from transformers import DynamicCache

    logits_seen: list[torch.Tensor] = []
    out_tokens = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        last = out.logits[:, -1]
        nxt = last.argmax(-1) if forced is None else forced[:, 0]
        if record:
            logits_seen.append(last.float().clone())
        out_tokens.append(nxt)
        t1 = time.perf_counter()
        for i in range(1, new_tokens):
            out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            last = out.logits[:, -1]
            nxt = last.argmax(-1) if forced is None else forced[:, i]
            if record:
                logits_seen.append(last.float().clone())
            out_tokens.append(nxt)
        t2 = time.perf_counter()
    return DecodeRun(torch.stack(out_tokens, 1), t1 - t0, t2 - t1, logits_seen)


class StaticCompiled:
    """HF's model under ``torch.compile`` with a ``StaticCache`` (HF's recommended
    recipe for compiled decoding): the prefill and the one-token step each compile
    once; ``compile_s`` is the time of the first (compiling) run."""

    def __init__(self, model: Any, batch: int, max_len: int) -> None:
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.forward = torch.compile(model.forward, dynamic=False)
        self.batch = batch
        self.compile_s: float | None = None

    def greedy(self, ids: torch.Tensor, new_tokens: int) -> DecodeRun:
        first = self.compile_s is None
        t_start = time.perf_counter()
        with torch.inference_mode():
            self.cache.reset()
            t0 = time.perf_counter()
            p = ids.shape[1]
            out = self.forward(input_ids=ids, past_key_values=self.cache, use_cache=True,
                               cache_position=torch.arange(p))
            nxt = out.logits[:, -1].argmax(-1)
            toks = [nxt]
            t1 = time.perf_counter()
            for i in range(1, new_tokens):
                pos = torch.tensor([p + i - 1])
                out = self.forward(input_ids=nxt[:, None].clone(), past_key_values=self.cache,
                                   use_cache=True, cache_position=pos)
                nxt = out.logits[:, -1].argmax(-1)
                toks.append(nxt)
            t2 = time.perf_counter()
        if first:
            self.compile_s = t2 - t_start
        return DecodeRun(torch.stack(toks, 1), t1 - t0, t2 - t1)
