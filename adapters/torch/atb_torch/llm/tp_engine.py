"""The request engine of a tensor-parallel ``LLM``: rank 0 schedules, every rank runs
the same forward of its shard, step by step.

Rank 0 owns the requests (the :class:`~.loop.EngineLoop` thread drives
:class:`TensorParallelEngine` exactly as it drives the single-device
:class:`~.engine.Engine`: add, abort, step). Before each forward it broadcasts the
step's inputs -- ``("prefill", ids [B, S])``, ``("decode", ids [B, 1])`` or
``("stop", None)`` -- and the other ranks, in :func:`follow`, run that same forward
of their :class:`~atb_torch.models.compile_tp.ShardedDecoder` (whose all-reduces
pair up with rank 0's). Only rank 0 samples: the followers never decide anything, so
nothing depends on every rank drawing the same token.

Batching is static: the first waiting request and the waiting ones with the same
prompt length (up to ``max_batch_size``) are prefilled together into the decoder's
contiguous KV cache and decoded until the last of them finishes; a request that
finishes (or is aborted) earlier leaves at once and its row runs on as padding.
Tokens are chosen by the single-device engine's :func:`~.sampling.select_tokens`
with each request's own sampling settings and seed stream, and cut at
end-of-sequence, length and stop strings by its ``_emit``: greedy and seeded
sampling give what ``LLM`` gives on one process.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable

import torch

from .engine import Engine
from .outputs import TokenEvent
from .request import Request

__all__ = ["TensorParallelEngine", "broadcast_step", "follow", "run_step"]


def broadcast_step(kind: str, ids: torch.Tensor | None, group: Any = None) -> tuple[str, Any]:
    """Rank 0: send ``(kind, ids)`` to every rank; the others: receive it."""
    import torch.distributed as dist

    box = [(kind, None if ids is None else ids.tolist())]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def run_step(decoder: Any, kind: str, ids: Any) -> torch.Tensor:
    """One forward of this rank's shard: the logits of the last position ``[B, V]``."""
    if kind == "prefill":
        decoder.reset()
    with torch.no_grad():
        return decoder(torch.as_tensor(ids, dtype=torch.long))[:, -1]


def follow(decoder: Any, group: Any = None) -> int:
    """A follower rank's loop: run every step rank 0 broadcasts until ``"stop"``;
    returns the number of forwards run."""
    steps = 0
    while True:
        kind, ids = broadcast_step("", None, group)
        if kind == "stop":
            return steps
        run_step(decoder, kind, ids)
        steps += 1


class TensorParallelEngine(Engine):
    """Rank 0's engine over ``decoder`` (this rank's ShardedDecoder): the request
    interface of :class:`~.engine.Engine` (``add``, ``abort``, ``step``,
    ``waiting``, ``running``, ``on_step``); see the module docstring."""

    def __init__(self, decoder: Any, max_batch_size: int = 32,
                 max_model_len: int | None = None, group: Any = None,
                 on_step: Callable[[str, int, int], None] | None = None) -> None:
        self.decoder, self.group = decoder, group
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.spec, self.on_step = None, on_step
        self.device = torch.device("cpu")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._rows: list[Request] = []  # the batch in the cache, finished rows included
        self._failed: list[tuple[Request, TokenEvent]] = []

    def add(self, requests: Iterable[Request]) -> None:
        self.waiting.extend(requests)

    def abort(self, r: Request) -> bool:
        if r in self.running:
            self.running.remove(r)   # its row runs on as padding until the batch ends
        elif r in self.waiting:
            self.waiting.remove(r)
        else:
            return False
        r.finish_reason = "abort"
        return True

    def step(self) -> list[tuple[Request, TokenEvent]]:
        """One forward on every rank: prefill the next batch when none is running,
        else decode the running one. Finished requests have left on return."""
        if not self.running and self.waiting:
            events = self._prefill_next()
        elif self.running:
            events = self._decode_rows()
        else:
            events = []
        self.running = [r for r in self.running if r.finish_reason is None]
        return events

    def _run_step(self, kind: str, ids: torch.Tensor) -> torch.Tensor:
        broadcast_step(kind, ids, self.group)
        if self.on_step is not None:
            self.on_step(kind, ids.shape[0], ids.numel())
        return run_step(self.decoder, kind, ids)

    def _prefill_next(self) -> list[tuple[Request, TokenEvent]]:
        first = self.waiting[0]
        rows = [r for r in self.waiting if len(r.prompt) == len(first.prompt)]
        rows = rows[:self.max_batch_size]
        for r in rows:
            self.waiting.remove(r)
        self._rows, self.running = rows, list(rows)
        logits = self._run_step("prefill", torch.tensor([r.prompt for r in rows]))
        return self._sample(logits, rows)

    def _decode_rows(self) -> list[tuple[Request, TokenEvent]]:
        live = set(map(id, self.running))
        ids = torch.tensor([[r.output[-1] if id(r) in live else 0] for r in self._rows])
        logits = self._run_step("decode", ids)
        return self._sample(logits, self._rows)

    def _sample(self, logits: torch.Tensor, rows: list[Request]
                ) -> list[tuple[Request, TokenEvent]]:
        live = set(map(id, self.running))
        pick = [i for i, r in enumerate(rows) if id(r) in live]
        reqs = [rows[i] for i in pick]
        for st in {id(r.stats): r.stats for r in reqs}.values():
            st.max_running = max(st.max_running, len(reqs))
        toks, lps = self._select(logits[pick], reqs, [len(r.tokens) for r in reqs])
        return [self._emit(r, [t], [lp]) for r, t, lp in zip(reqs, toks, lps)]
