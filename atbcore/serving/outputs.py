"""What ``LLM`` returns: per-request outputs, streamed token events, run statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RequestOutput", "TokenEvent", "GenerationStats"]


@dataclass
class RequestOutput:
    """One prompt's result: ``text`` (stop strings cut off, special tokens skipped),
    ``token_ids`` (generated ids, an end-of-sequence id included as HF does),
    ``prompt_token_ids``, ``finish_reason`` ("length", "eos", "stop", or "error" with
    the reason in ``error``, e.g. a request that outgrew the KV cache) and
    ``num_cached_tokens`` (prompt tokens served by the prefix cache); ``logprobs``
    (a :class:`~.sampling.TokenLogprob` per generated token) when asked for."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[Any] | None = None


@dataclass
class TokenEvent:
    """A streamed step of one request: the ``token_ids`` it produced this step (several
    when speculative drafts were accepted), the new ``text`` they complete (text held
    back while it may still turn into a stop string or an incomplete character), and
    ``finish_reason`` on its last event (``"error"`` with ``error`` saying why when the
    request failed alone, ``"abort"`` when it was cancelled); ``logprobs``, a
    :class:`~.sampling.TokenLogprob` per token, when the request asked for them."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[Any] | None = None  # a TokenLogprob per token when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationStats:
    """Counters of one ``generate``/``stream`` call.

    ``prompt_tokens`` (all prompts), ``cached_prompt_tokens`` (served by the prefix
    cache), ``computed_tokens`` (tokens run through the model, prefill and decode),
    ``generated_tokens``, ``steps`` (model forwards), ``prefill_steps``,
    ``max_running`` (largest running batch), ``preemptions`` (sequences evicted
    for lack of KV blocks and recomputed later), speculative ``spec_proposed`` /
    ``spec_accepted`` / ``acceptance_rate``, and ``elapsed_s``."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    prefill_steps: int = 0
    max_running: int = 0
    preemptions: int = 0
    spec_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    elapsed_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list, repr=False)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0 when none proposed)."""
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("batch_sizes")
        d.update(acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s)
        return d
