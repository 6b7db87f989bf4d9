"""Continuous batching over the paged KV cache.

Each iteration of :meth:`Engine.run` is one model forward over packed tokens (no
padding): either a **prefill** of newly admitted prompts (their tokens past the
prefix-cache hit) or a **decode** step of every running sequence (one token each,
or a prompt-lookup draft to verify). Sequences join when a batch slot and KV blocks
are free and leave the moment they finish, freeing their blocks. When a decode step
finds no free block, the most recently admitted sequence is preempted (blocks freed,
request requeued at the front) and later recomputed from its prompt and output so
far; its tokens do not change, since sampling is keyed by token position.

A request that outgrows the whole KV cache (its prompt cannot be admitted even
alone, or it needs a block when it is the only sequence left, or its context alone
fills the cache) fails alone: its blocks are freed, it finishes with
``finish_reason="error"`` and the reason in ``error`` (on the request and on its
last event), and the other requests go on to complete with the tokens they would
have produced without it.

The cache invariant: a running sequence's cache holds every token but its last
sampled one, which is the next step's input.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator, Sequence

import torch

from atbcore.errors import InputError
from atbcore.memory.block_manager import NoFreeBlocksError
from atbcore.memory.paged import PagedBatch
from atbcore.memory.prefix import block_hash

from .detok import Detokenizer
from .outputs import GenerationStats, TokenEvent
from .sampling import SamplingConfig, select_tokens
from .speculative import accept_draft, propose_draft

__all__ = ["Request", "Engine", "SpecConfig"]


@dataclass(frozen=True)
class SpecConfig:
    """Prompt-lookup drafting: up to ``num_tokens`` drafts from n-grams of
    ``min_ngram..max_ngram`` tokens."""

    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1


@dataclass
class Request:
    """One prompt in flight (see the module docstring for the cache invariant)."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int]
    detok: Detokenizer
    output: list[int] = field(default_factory=list)
    seq_id: Hashable = None
    num_cached: int = 0
    finish_reason: str | None = None
    ctx_cached: int = 0  # context tokens served by the prefix cache at (re)admission
    key: tuple[int, int] = (0, 0)  # (seed, stream) of its sampling draws
    error: str | None = None  # why it failed (finish_reason "error")

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Engine:
    """Runs requests through ``runner.forward_paged`` over ``cache`` (a
    :class:`atbcore.memory.PagedKVCache`); see the module docstring."""

    def __init__(self, runner: Any, cache: Any, max_batch_size: int = 32,
                 max_prefill_tokens: int = 4096, max_model_len: int | None = None,
                 spec: SpecConfig | None = None) -> None:
        self.runner, self.cache = runner, cache
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.max_model_len = max_model_len
        self.spec = spec
        self.device = runner.device
        self._calls = 0
        self._failed: list[TokenEvent] = []  # events of requests failed alone this step

    # ------------------------------------------------------------------ the loop
    def run(self, requests: Sequence[Request], sampling: SamplingConfig,
            stats: GenerationStats) -> Iterator[TokenEvent]:
        """Serve ``requests`` to completion, yielding a :class:`TokenEvent` for each
        request whenever it produced tokens; ``stats`` is updated as it goes."""
        self._calls += 1
        t0 = time.perf_counter()
        for r in requests:
            # str ids: the cache reads a tuple as a list of ids
            r.seq_id = f"{self._calls}:{r.index}:0"
            stats.prompt_tokens += len(r.prompt)
            if self.max_model_len is not None and len(r.prompt) >= self.max_model_len:
                raise InputError("LLM.generate", f"prompt {r.index} length",
                                 f"< max_model_len {self.max_model_len}", len(r.prompt))
        waiting: deque[Request] = deque(requests)
        running: list[Request] = []
        try:
            while waiting or running:
                admitted = self._admit(waiting, running)
                if admitted:
                    running.extend(admitted)  # first: a failing step must free them too
                    events = self._prefill(admitted, sampling, stats)
                else:  # forward and sampling with torch's pool parked for C matmuls
                    with self._parked(len(running)):
                        events = self._decode(running, waiting, sampling, stats)
                stats.max_running = max(stats.max_running, len(running))
                for r in [r for r in running if r.finish_reason is not None]:
                    running.remove(r)
                    self.cache.free_sequence(r.seq_id)
                stats.elapsed_s = time.perf_counter() - t0
                failed, self._failed = self._failed, []
                yield from failed
                yield from events
        finally:  # a consumer that stops early must not leak KV blocks
            for r in running:
                if r.seq_id in self.cache.manager:
                    self.cache.free_sequence(r.seq_id)

    def _parked(self, rows: int) -> Any:
        parked = getattr(self.runner, "parked", None)
        return parked(rows) if parked is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ admission
    def _admit(self, waiting: deque, running: list) -> list[Request]:
        """Requests to prefill now: FIFO, within the batch and token budgets and the
        free blocks. With prefix caching, a request whose first block matches one
        admitted in this step but not cached yet waits one step, so a shared prefix
        is computed once and then served from the cache."""
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        first_keys: set[bytes] = set()
        prefix = self.cache.manager.prefix
        bs = self.cache.block_size
        while waiting and len(running) + len(admitted) < self.max_batch_size:
            r = waiting[0]
            ctx = r.tokens[:-1] if r.output else r.prompt  # resumed: last token is pending
            if admitted and len(ctx) > budget:
                break
            if prefix is not None and len(ctx) > bs:
                key = block_hash(None, ctx[:bs])
                if key in first_keys and prefix.lookup(key) is None:
                    break
                first_keys.add(key)
            try:
                cached = self.cache.add_sequence(r.seq_id, token_ids=ctx)
            except NoFreeBlocksError:
                if not admitted and not running:  # alone and still too long: it fails alone
                    waiting.popleft()
                    self._fail(r, f"prompt {r.index} does not fit the KV cache: {len(ctx)} "
                               f"tokens, the cache holds {self.cache.num_blocks * bs} (raise "
                               "num_blocks or kv_cache_memory)")
                    continue
                break
            waiting.popleft()
            if not r.output:
                r.num_cached = cached
            r.ctx_cached = cached
            budget -= len(ctx) - cached
            admitted.append(r)
        return admitted

    # ------------------------------------------------------------------ steps
    def _forward(self, ids: list[int], batch: PagedBatch, stats: GenerationStats,
                 all_logits: bool = False) -> torch.Tensor:
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        logits = self.runner.forward_paged(x, batch, self.cache, all_logits=all_logits)
        stats.steps += 1
        stats.computed_tokens += len(ids)
        stats.batch_sizes.append(len(batch.seq_ids))
        return logits

    def _batch(self, seq_ids: list, starts: list[int], cached: list[int]) -> PagedBatch:
        """Step metadata for new tokens at positions ``starts[i]..`` of each sequence
        (the layout ``PagedKVCache.prepare_*`` returns, built for any mix of lengths)."""
        c, m = self.cache, self.cache.manager
        dev = c.key_cache(0).device
        ends = [m.num_tokens(s) for s in seq_ids]
        slots = [x for s, a, e in zip(seq_ids, starts, ends) for x in m.slots(s, a, e)]
        pos = [p for a, e in zip(starts, ends) for p in range(a, e)]

        def ints(v: list[int], dt: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(v, dtype=dt, device=dev)

        return PagedBatch(list(seq_ids), ints(slots), c.block_tables(seq_ids), ints(ends),
                          ints([e - a for a, e in zip(starts, ends)]), ints(pos, torch.int64),
                          list(cached))

    def _prefill(self, admitted: list[Request], sampling: SamplingConfig,
                 stats: GenerationStats) -> list[TokenEvent]:
        ids, starts, cached = [], [], []
        for r in admitted:
            c = r.ctx_cached
            ctx = r.tokens[:-1] if r.output else r.prompt
            ids.extend(ctx[c:])
            starts.append(c)
            cached.append(c)
            if not r.output:
                stats.cached_prompt_tokens += c
        batch = self._batch([r.seq_id for r in admitted], starts, cached)
        logits = self._forward(ids, batch, stats)
        stats.prefill_steps += 1
        self.cache.mark_computed([r.seq_id for r in admitted])
        fresh = [i for i, r in enumerate(admitted) if not r.output]
        if not fresh:  # resumed requests: their next token is already known
            return []
        rows = logits[fresh]
        toks = select_tokens(rows, sampling, [admitted[i].key for i in fresh],
                             [len(admitted[i].prompt) for i in fresh])
        return [self._emit(admitted[i], [t], stats) for i, t in zip(fresh, toks)]

    def _decode(self, running: list[Request], waiting: deque, sampling: SamplingConfig,
                stats: GenerationStats) -> list[TokenEvent]:
        drafts = {}
        if self.spec is not None:
            for r in running:
                d = self._draft(r)
                if d:
                    drafts[r.index] = d
        if drafts and self._can_verify(running, drafts):
            return self._verify(running, drafts, sampling, stats)
        while True:
            if not running:  # every one of them failed for lack of cache
                return []
            try:
                batch = self.cache.prepare_decode([r.seq_id for r in running],
                                                  [[r.output[-1]] for r in running], 1)
                break
            except NoFreeBlocksError:
                self._make_room(running, waiting, stats)
        logits = self._forward([r.output[-1] for r in running], batch, stats)
        self.cache.mark_computed([r.seq_id for r in running])
        toks = select_tokens(logits, sampling, [r.key for r in running],
                             [len(r.tokens) for r in running])
        return [self._emit(r, [t], stats) for r, t in zip(running, toks)]

    def _make_room(self, running: list[Request], waiting: deque, stats: GenerationStats) -> None:
        """Free blocks for a decode step: a sequence that can never grow again (alone
        in the batch, or filling the whole cache by itself) fails alone; else the most
        recently admitted one is preempted."""
        m = self.cache.manager
        capacity = self.cache.num_blocks * self.cache.block_size
        hogs = [r for r in running if m.num_tokens(r.seq_id) + 1 > capacity]
        for r in (hogs or (running[:1] if len(running) == 1 else [])):
            running.remove(r)
            self._fail(r, f"request {r.index} outgrew the KV cache: it needs "
                       f"{m.num_tokens(r.seq_id) + 1} tokens of cache, the cache holds "
                       f"{capacity} (raise num_blocks or kv_cache_memory)")
        if not hogs and running and len(running) > 1:
            self._preempt(running, waiting, stats)

    def _fail(self, r: Request, why: str) -> None:
        """Finish ``r`` alone with ``finish_reason="error"``: its blocks freed, the
        text decoded so far flushed, its event queued for the caller."""
        if r.seq_id in self.cache.manager:
            self.cache.free_sequence(r.seq_id)
        r.finish_reason, r.error = "error", why
        text, _ = r.detok.push(r.output, final=True)
        self._failed.append(TokenEvent(r.index, [], text, "error", error=why))

    def _preempt(self, running: list[Request], waiting: deque, stats: GenerationStats) -> None:
        victim = running.pop()
        self.cache.free_sequence(victim.seq_id)
        call, index, life = victim.seq_id.split(":")
        victim.seq_id = f"{call}:{index}:{int(life) + 1}"  # a fresh id for its next life
        waiting.appendleft(victim)
        stats.preemptions += 1

    def _draft(self, r: Request) -> list[int]:
        room = r.max_new_tokens - len(r.output)  # tokens still allowed after this step
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(r.tokens))
        k = min(self.spec.num_tokens, room - 1)
        if k < 1:
            return []
        return propose_draft(r.tokens, k, self.spec.max_ngram, self.spec.min_ngram)

    def _can_verify(self, running: list[Request], drafts: dict[int, list[int]]) -> bool:
        """Whether the free blocks surely cover a verify step (else plain decoding,
        which can preempt; a verify step never has to)."""
        from .spec_cache import blocks_needed

        m, bs = self.cache.manager, self.cache.block_size
        need = sum(blocks_needed(m.num_tokens(r.seq_id), len(drafts[r.index]) + 1, bs)
                   if r.index in drafts else 2 for r in running)
        return need <= m.num_free_blocks

    def _verify(self, running: list[Request], drafts: dict[int, list[int]],
                sampling: SamplingConfig, stats: GenerationStats) -> list[TokenEvent]:
        """One step where drafted sequences run ``[last, d1..dk]`` on a fork of their
        cache (the real sequence is extended only by what is accepted) and the others
        run their last token."""
        from .spec_cache import commit_fork, open_fork

        seq_ids, ids, starts = [], [], []
        forks: dict[int, Hashable] = {}
        try:
            for r in running:
                step = [r.output[-1]] + drafts.get(r.index, [])
                start = self.cache.manager.num_tokens(r.seq_id)
                if r.index in drafts:
                    sid = forks[r.index] = open_fork(self.cache, r.seq_id, step)
                else:
                    self.cache.append_tokens(r.seq_id, 1, step)
                    sid = r.seq_id
                seq_ids.append(sid)
                ids.extend(step)
                starts.append(start)
            batch = self._batch(seq_ids, starts, [0] * len(seq_ids))
            logits = self._forward(ids, batch, stats, all_logits=True)
        except BaseException:  # forks hold blocks: give them back before the error goes up
            for f in forks.values():
                if f in self.cache.manager:
                    self.cache.free_sequence(f)
            raise
        stats.spec_steps += 1
        events, row = [], 0
        for r in running:
            d = drafts.get(r.index, [])
            n = len(d) + 1
            pos = len(r.tokens)
            chosen = select_tokens(logits[row:row + n], sampling, [r.key] * n,
                                   list(range(pos, pos + n)))
            row += n
            if d:
                out = accept_draft(d, chosen)
                stats.spec_proposed += len(d)
                stats.spec_accepted += len(out) - 1
                commit_fork(self.cache, r.seq_id, forks[r.index], [r.output[-1]] + out[:-1])
            else:
                out = chosen
            self.cache.mark_computed(r.seq_id)
            events.append(self._emit(r, out, stats))
        return events

    # ------------------------------------------------------------------ output
    def _emit(self, r: Request, toks: list[int], stats: GenerationStats) -> TokenEvent:
        """Append sampled tokens, cut at end-of-sequence / length, detokenize, check
        stop strings; returns the request's event."""
        new: list[int] = []
        for t in toks:
            new.append(int(t))
            if int(t) in r.eos:
                r.finish_reason = "eos"
                break
            if len(r.output) + len(new) >= r.max_new_tokens:
                r.finish_reason = "length"
                break
        r.output.extend(new)
        stats.generated_tokens += len(new)
        if self.max_model_len is not None and len(r.tokens) >= self.max_model_len \
                and r.finish_reason is None:
            r.finish_reason = "length"
        text, hit = r.detok.push(r.output, final=r.finish_reason is not None)
        if hit:
            r.finish_reason = "stop"
        return TokenEvent(r.index, new, text, r.finish_reason)
