"""The ``LLM`` API every front-end shares: ``generate`` / ``generate_outputs`` /
``stream`` with the same arguments, checks and outputs, whatever engine serves them
(``atb_torch.LLM``'s paged engine thread, the MindSpore/Paddle
:class:`~.host_llm.HostLLM` loop).

A front-end class derives from :class:`LLMFront` and provides ``tokenizer`` (or None:
prompts are then token ids), ``eos_ids``, ``vocab_size``, ``max_model_len`` (None =
no limit) and ``_drain(requests) -> Iterator[TokenEvent]``, which runs the requests on
its engine (stopping early must free what they hold).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from ..errors import InputError, ParamsError
from .detok import Detokenizer
from .outputs import GenerationStats, RequestOutput, TokenEvent
from .request import Request
from .sampling_config import SamplingConfig

__all__ = ["LLMFront", "check_max_tokens", "stop_strings"]


def check_max_tokens(max_new_tokens: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            max_new_tokens < 1:
        raise ParamsError("LLM.generate", "max_new_tokens", "an int >= 1", repr(max_new_tokens))


def stop_strings(stop: Any) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise ParamsError("LLM.generate", "stop", "a string or a list of strings", repr(stop))
    return stops


def _single(prompts: Any) -> bool:
    return isinstance(prompts, str) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int))


class LLMFront:
    """See the module docstring."""

    tokenizer: Any = None
    eos_ids: frozenset[int] = frozenset()
    vocab_size: int = 0
    max_model_len: int | None = None
    last_stats: GenerationStats

    def _drain(self, reqs: list[Request]) -> Iterator[TokenEvent]:
        raise NotImplementedError

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids (a string through the tokenizer; ids checked against
        the vocabulary): what :meth:`generate` feeds the model."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("LLM.generate", "prompt", "token ids (no tokenizer loaded)", "str")
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("LLM.generate", "prompt", "at least one token", "an empty prompt")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InputError("LLM.generate", "prompt token ids", f"in [0, {vocab})", bad[:5])
        return list(ids)

    def _check_len(self, ids: list[int], who: str) -> None:
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            raise InputError("LLM.generate", f"{who} length",
                             f"< max_model_len {self.max_model_len}", len(ids))

    def _requests(self, prompts: Any, max_new_tokens: int, stop: Any, ignore_eos: bool,
                  sampling: SamplingConfig, stats: GenerationStats) -> list[Request]:
        items = [prompts] if _single(prompts) else list(prompts)
        if not items:
            raise InputError("LLM.generate", "prompts", "a prompt or a non-empty list", "[]")
        check_max_tokens(max_new_tokens)
        stops = stop_strings(stop)
        eos = frozenset() if ignore_eos else self.eos_ids
        reqs = []
        for i, p in enumerate(items):
            ids = self.encode(p)
            self._check_len(ids, f"prompt {i}")
            reqs.append(Request(i, ids, max_new_tokens, eos, Detokenizer(self.tokenizer, stops),
                                sampling=sampling, stats=stats))
        return reqs

    def _prepare(self, prompts: Any, max_new_tokens: int, temperature: float, top_k: int,
                 top_p: float, seed: Any, stop: Any, ignore_eos: bool,
                 sampling: dict[str, Any]) -> list[Request]:
        seeds = None if isinstance(seed, int) and not isinstance(seed, bool) else list(seed)
        cfg = SamplingConfig(temperature, top_k, top_p, seed if seeds is None else 0, **sampling)
        stats = GenerationStats()
        reqs = self._requests(prompts, max_new_tokens, stop, ignore_eos, cfg, stats)
        if seeds is not None and (len(seeds) != len(reqs) or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds)):
            raise ParamsError("LLM.generate", "seed", f"an int or {len(reqs)} ints >= 0 "
                              "(one per prompt)", seeds)
        for r in reqs:  # a list's prompts draw from streams 0, 1, ... of one seed
            r.key = (seed, r.index) if seeds is None else (seeds[r.index], 0)
        stats.requests = len(reqs)
        stats.prompt_tokens = sum(len(r.prompt) for r in reqs)
        self.last_stats = stats
        return reqs

    # ------------------------------------------------------------------ API
    def stream(self, prompts: Any, max_new_tokens: int = 64, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: Any = 0, stop: Any = None,
               ignore_eos: bool = False, **sampling: Any) -> Iterator[TokenEvent]:
        """Yield :class:`TokenEvent` s as tokens are produced (``event.index`` says
        which prompt of a list); the same tokens :meth:`generate` returns. Stopping
        early (closing the iterator) cancels the rest and frees what they hold."""
        reqs = self._prepare(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop,
                             ignore_eos, sampling)
        yield from self._drain(reqs)

    def generate_outputs(self, prompts: Any, max_new_tokens: int = 64, temperature: float = 0.0,
                         top_k: int = 0, top_p: float = 1.0, seed: Any = 0, stop: Any = None,
                         ignore_eos: bool = False, **sampling: Any) -> list[RequestOutput]:
        """Like :meth:`generate`, returning a :class:`RequestOutput` per prompt (token
        ids, finish reason, prefix-cache hits, log-probabilities when asked for) in
        prompt order."""
        reqs = self._prepare(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop,
                             ignore_eos, sampling)
        for _ in self._drain(reqs):
            pass
        return [RequestOutput(r.index, r.prompt, list(r.output), r.detok.text, r.finish_reason,
                              r.num_cached, r.error,
                              list(r.logprobs) if r.sampling.logprobs is not None else None)
                for r in reqs]

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: Any = 0, stop: str | Sequence[str] | None = None,
                 ignore_eos: bool = False, **sampling: Any) -> str | list[str]:
        """Generated text for one prompt (a ``str`` back) or a list (a list back).

        ``temperature`` 0 = greedy; otherwise seeded top-k/top-p sampling with the
        ``TopkToppSampling`` op's semantics: with one ``seed``, prompt ``i`` of a list
        draws from stream ``i`` of it; a list of seeds gives each prompt its own
        (prompt ``i`` with ``seed=[.., s_i, ..]`` samples what it samples alone with
        ``seed=s_i``). ``stop``: strings that end a request (cut from its text).
        ``ignore_eos`` keeps going past end-of-sequence ids. Further keywords are
        :class:`SamplingConfig` fields (``repetition_penalty``, ``presence_penalty``,
        ``frequency_penalty``, ``logprobs``)."""
        outs = self.generate_outputs(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                     stop, ignore_eos, **sampling)
        texts = [o.text for o in outs]
        return texts[0] if _single(prompts) else texts

    @property
    def stats(self) -> GenerationStats:
        """Statistics of the last ``generate`` / ``stream`` call (of any thread)."""
        return self.last_stats

    def __enter__(self) -> "LLMFront":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError
