"""Token choice for ``LLM.generate``: greedy or seeded top-k/top-p sampling with the
core's ``TopkToppSampling`` semantics.

Each request draws from its own stream: the token at position ``p`` uses the seed
``hash(seed, stream, p)``, where ``stream`` is the request's index in the prompt list
(or 0 with per-prompt seeds). So a request samples the same tokens whether its
batch-mates run with it or not, whenever it is admitted or preempted, and with or
without speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from atbcore.errors import ParamsError

__all__ = ["SamplingConfig", "select_tokens", "step_seed"]


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature`` 0 = greedy; ``top_k`` 0 = off; ``top_p`` in (0, 1]; ``seed``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ParamsError("LLM.generate", "temperature", ">= 0 (0 = greedy)", self.temperature)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ParamsError("LLM.generate", "top_k", "an int >= 0 (0 = off)", repr(self.top_k))
        if not 0.0 < self.top_p <= 1.0:
            raise ParamsError("LLM.generate", "top_p", "a value in (0, 1]", self.top_p)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ParamsError("LLM.generate", "seed", "a non-negative int", repr(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def step_seed(seed: int, stream: int, position: int) -> int:
    """The seed of one token draw: a hash of (seed, stream, token position)."""
    return int(np.random.SeedSequence([seed, stream, position]).generate_state(1)[0])


def select_tokens(logits: torch.Tensor, cfg: SamplingConfig, keys: list[tuple[int, int]],
                  positions: list[int]) -> list[int]:
    """Next token of each row of ``logits`` ``[R, V]``: row ``i`` belongs to the
    request with ``(seed, stream) = keys[i]`` and produces the token at
    ``positions[i]``. Greedy is the argmax (first maximum)."""
    if cfg.greedy:
        from atbcore.backends.cpu_kernels.torch_ops import why_not

        if logits.dim() == 2 and why_not(logits) is None:  # CPU: one C call, torch's rule
            from atbcore.backends.cpu_kernels.torch_decode import argmax_rows

            return argmax_rows(logits).tolist()
        return torch.argmax(logits, dim=-1).tolist()
    from atbcore.operation import Builder

    out = []
    for i in range(logits.shape[0]):
        seed = step_seed(keys[i][0], keys[i][1], positions[i])
        op = Builder().build_operation("TopkToppSampling", {
            "top_k": cfg.top_k, "top_p": cfg.top_p, "temperature": cfg.temperature,
            "seed": seed})
        ids, = op.execute([logits[i:i + 1].float()])
        out.append(int(ids[0]))
    return out
