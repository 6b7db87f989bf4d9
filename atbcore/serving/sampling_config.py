"""Sampling settings of one request: greedy or seeded top-k/top-p sampling with the
core's ``TopkToppSampling`` semantics, per-request penalties and log-probabilities
(the token choice itself: :mod:`.select` on host arrays, ``atb_torch.llm.sampling``
on torch tensors).

Each request carries its own :class:`SamplingConfig` and draws from its own stream:
the token at position ``p`` uses the seed ``hash(seed, stream, p)``, where ``stream``
is the request's index in the prompt list (or its choice index with ``n`` choices,
or 0 with per-prompt seeds). So a request samples the same tokens whether its
batch-mates run with it or not, whenever it is admitted or preempted, and with or
without speculative decoding.

Penalties follow the definitions people know them by: ``repetition_penalty`` as in
Hugging Face (over prompt and output: a positive logit of a seen token is divided by
it, a negative one multiplied), ``presence_penalty`` / ``frequency_penalty`` as in
OpenAI's API (over the output: ``logit -= presence * (count > 0) + frequency * count``).
Log-probabilities are those of the model's distribution after the penalties and
before temperature, top-k and top-p (what the model says about each token)."""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from ..errors import ParamsError

__all__ = ["SamplingConfig", "step_seed", "TokenLogprob"]

_WHO = "LLM.generate"


def _number(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ParamsError(_WHO, name, "a number", repr(v))
    return float(v)


@dataclass(frozen=True)
class SamplingConfig:
    """One request's sampling settings.

    ``temperature`` 0 = greedy; ``top_k`` 0 = off; ``top_p`` in (0, 1]; ``seed``;
    ``repetition_penalty`` > 0 (1 = off); ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] (0 = off); ``logprobs``: None, or how many of
    the most likely alternatives to report with each token (0 = the chosen token's
    log-probability only, at most 20)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _number("temperature", self.temperature) >= 0:
            raise ParamsError(_WHO, "temperature", ">= 0 (0 = greedy)", self.temperature)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ParamsError(_WHO, "top_k", "an int >= 0 (0 = off)", repr(self.top_k))
        if not 0.0 < _number("top_p", self.top_p) <= 1.0:
            raise ParamsError(_WHO, "top_p", "a value in (0, 1]", self.top_p)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ParamsError(_WHO, "seed", "a non-negative int", repr(self.seed))
        if not _number("repetition_penalty", self.repetition_penalty) > 0:
            raise ParamsError(_WHO, "repetition_penalty", "> 0 (1 = off)",
                              self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _number(name, getattr(self, name)) <= 2.0:
                raise ParamsError(_WHO, name, "a value in [-2, 2] (0 = off)", getattr(self, name))
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 20):
            raise ParamsError(_WHO, "logprobs", "None or an int in [0, 20]", repr(lp))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens seen so far."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to adjust or report: a batched argmax."""
        return self.greedy and not self.penalized and self.logprobs is None


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen ``token``'s ``logprob`` and the ``top`` alternatives
    (``(token, logprob)`` pairs, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def step_seed(seed: int, stream: int, position: int) -> int:
    """The seed of one token draw: a hash of (seed, stream, token position)."""
    return int(np.random.SeedSequence([seed, stream, position]).generate_state(1)[0])
