"""The framework-neutral request loop behind ``atb_mindspore.LLM`` and
``atb_paddle.LLM``: continuous batching over the rows of a contiguous
``atbcore.memory.KVCache`` (one row per running request), on a lowered decoder run
through :class:`~.row_feeder.RowFeeder` by the front-end's backend.

Each step first admits waiting requests into free rows (each prompt prefilled alone,
``B = 1``, its first token chosen), then runs one decode step of every running row
together (``S = 1``, each row at its own length). A finished request frees its row at
once, so a waiting one joins the next step. Tokens are chosen on host logits by
:func:`~.select.select_tokens` (the same rules as ``atb_torch.LLM``).

Not here (``atb_torch.LLM`` has them): a paged cache with prefix caching, chunked
prefill, preemption, prompt-lookup speculation, an engine thread shared by callers.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Sequence

import numpy as np

from ..tensor import convert
from .outputs import TokenEvent
from .request import Request
from .row_feeder import RowFeeder
from .sampling_config import TokenLogprob
from .select import select_tokens

__all__ = ["DecodeLoop"]


def _host_logits(out: Any) -> np.ndarray:
    a = convert(out, "numpy")
    return a if a.dtype == np.float32 else np.asarray(a, dtype=np.float32)


class DecodeLoop:
    """Serves :class:`~.request.Request` s on ``feeder`` (see the module docstring);
    ``max_model_len``: a request stops ("length") when it holds that many tokens."""

    def __init__(self, feeder: RowFeeder, max_model_len: int) -> None:
        self.feeder = feeder
        self.cache = feeder.cache
        self.max_model_len = max_model_len

    def run(self, reqs: Sequence[Request]) -> Iterator[tuple[Request, TokenEvent]]:
        """Yield ``(request, event)`` as tokens come; closing the generator early
        frees the rows of the requests still running."""
        waiting = deque(reqs)
        running: dict[int, Request] = {}
        free = list(range(self.cache.max_batch))
        try:
            while waiting or running:
                while waiting and free:
                    r, row = waiting.popleft(), free.pop(0)
                    ev = self._prefill(r, row)
                    if r.finish_reason is None:
                        running[row] = r
                    else:
                        free.append(row)
                    yield r, ev
                if not running:
                    continue
                for row, r, ev in self._decode(running):
                    if r.finish_reason is not None:
                        del running[row]
                        free.append(row)
                    yield r, ev
        finally:
            if running:
                self.cache.reset(sorted(running))

    def _prefill(self, r: Request, row: int) -> TokenEvent:
        self.cache.reset([row])
        out = self.feeder.run(np.asarray([r.prompt]), [row], [0])
        logits = _host_logits(out)[-1:]
        st = r.stats
        st.steps += 1
        st.prefill_steps += 1
        st.computed_tokens += len(r.prompt)
        st.max_running = max(st.max_running, 1)
        toks, lps = self._select(logits, [r])
        return self._emit(r, toks[0], lps[0])

    def _decode(self, running: dict[int, Request]) -> list[tuple[int, Request, TokenEvent]]:
        rows = sorted(running)
        reqs = [running[row] for row in rows]
        ids = np.asarray([[r.tokens[-1]] for r in reqs], dtype=np.int64)
        out = self.feeder.run(ids, rows, [len(r.tokens) - 1 for r in reqs])
        toks, lps = self._select(_host_logits(out), reqs)
        for st in {id(r.stats): r.stats for r in reqs}.values():
            st.steps += 1
            st.max_running = max(st.max_running, len(reqs))
            st.batch_sizes.append(len(reqs))
        for r in reqs:
            r.stats.computed_tokens += 1
        return [(row, r, self._emit(r, t, lp)) for row, r, t, lp in zip(rows, reqs, toks, lps)]

    @staticmethod
    def _select(logits: np.ndarray, reqs: list[Request]
                ) -> tuple[list[int], list[TokenLogprob | None]]:
        return select_tokens(logits, [r.sampling for r in reqs], [r.key for r in reqs],
                             [len(r.tokens) for r in reqs], [(r.prompt, r.output) for r in reqs])

    def _emit(self, r: Request, tok: int, lp: TokenLogprob | None) -> TokenEvent:
        """Append the token, stop at end-of-sequence / length / a stop string;
        detokenize; the request's event."""
        tok = int(tok)
        r.output.append(tok)
        r.stats.generated_tokens += 1
        if lp is not None:
            r.logprobs.append(lp)
        if tok in r.eos:
            r.finish_reason = "eos"
        elif len(r.output) >= r.max_new_tokens or len(r.tokens) >= self.max_model_len:
            r.finish_reason = "length"
        text, hit = r.detok.push(r.output, final=r.finish_reason is not None)
        if hit:
            r.finish_reason = "stop"
        return TokenEvent(r.index, [tok], text, r.finish_reason,
                          logprobs=[lp] if lp is not None else None)
