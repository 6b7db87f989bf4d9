"""The serving engine of every front-end: continuous batching over the paged KV cache,
one step at a time, on any model that runs packed tokens over a
:class:`~atbcore.memory.PagedKVCache` (``model.forward_paged(ids, batch, cache,
all_logits)``: the core lowered decoder through :class:`~.paged_model.PagedDecoder`,
or ``atb_torch``'s runner), its tokens chosen by :attr:`Engine.select` (host NumPy
logits: :func:`~.select.select_tokens`; a front-end may bind its own with the same
rules, as ``atb_torch`` does for torch logits).

Requests join with :meth:`Engine.add` and leave with :meth:`Engine.abort` (their
blocks freed) between any two steps; each carries its own sampling settings,
length limit, stop strings and statistics. Each :meth:`Engine.step` is one model
forward over packed tokens (no padding): either a **prefill** of newly admitted prompts (their tokens past the
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

The engine itself is not thread-safe: one thread owns it (``atb_torch.llm.loop``; the
MindSpore/Paddle ``LLM`` steps it in the caller's thread), and every client talks to
that thread.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from typing import Any, Callable, Hashable, Iterable, Sequence

from ..memory.block_manager import NoFreeBlocksError
from ..memory.paged import PagedBatch
from ..memory.prefix import block_hash
from .outputs import GenerationStats, TokenEvent
from .request import Request, SpecConfig
from .sampling_config import TokenLogprob
from .select import select_tokens
from .speculative import accept_draft, propose_draft

__all__ = ["Request", "Engine", "SpecConfig"]


class Engine:
    """Runs requests through ``model.forward_paged`` over ``cache`` (a
    :class:`atbcore.memory.PagedKVCache`); see the module docstring.

    ``on_step(kind, batch_size, num_tokens)`` (optional) is told about every forward
    (``kind`` "prefill", "decode" or "verify")."""

    # (logits [R, V], settings, keys, positions, histories) -> (tokens, logprobs)
    select: Callable[..., tuple[list[int], list[TokenLogprob | None]]] = \
        staticmethod(select_tokens)

    def __init__(self, model: Any, cache: Any, max_batch_size: int = 32,
                 max_prefill_tokens: int = 4096, max_model_len: int | None = None,
                 spec: SpecConfig | None = None,
                 on_step: Callable[[str, int, int], None] | None = None) -> None:
        self.model, self.cache = model, cache
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.max_model_len = max_model_len
        self.spec = spec
        self.on_step = on_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._failed: list[tuple[Request, TokenEvent]] = []  # failed alone this step

    # ------------------------------------------------------------------ requests
    def add(self, requests: Iterable[Request]) -> None:
        """Queue ``requests`` (FIFO after those already waiting)."""
        for r in requests:
            # str ids: the cache reads a tuple as a list of ids
            r.seq_id = f"{next(self._ids)}:{r.life}"
            self.waiting.append(r)

    def abort(self, r: Request) -> bool:
        """Take ``r`` out (waiting or running), free its KV blocks, mark it
        ``finish_reason="abort"``; False when it was not in the engine."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        else:
            return False
        if r.seq_id in self.cache.manager:
            self.cache.free_sequence(r.seq_id)
        r.finish_reason = "abort"
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[tuple[Request, TokenEvent]]:
        """One forward: admit and prefill what fits, else decode every running
        sequence. Returns ``(request, event)`` for each request that produced tokens
        or finished; finished requests have left the engine and freed their blocks.
        An exception from the model leaves every request in the engine (the caller
        aborts them)."""
        waiting, running = self.waiting, self.running
        admitted = self._admit(waiting, running)
        if admitted:
            running.extend(admitted)  # first: a failing step must free them too
            events = self._prefill(admitted)
        elif running:  # forward and sampling in the model's parked context (if any)
            with self._parked(len(running)):
                events = self._decode(running, waiting)
        else:
            events = []
        for st in _stats_of(running):
            st.max_running = max(st.max_running, len(running))
        for r in [r for r in running if r.finish_reason is not None]:
            running.remove(r)
            self.cache.free_sequence(r.seq_id)
        failed, self._failed = self._failed, []
        return failed + events

    def _parked(self, rows: int) -> Any:
        parked = getattr(self.model, "parked", None)
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
    def _forward(self, ids: list[int], batch: PagedBatch, reqs: list[Request], counts: list[int],
                 kind: str, all_logits: bool = False) -> Any:
        """The model on ``ids`` (``counts[i]`` of them belong to ``reqs[i]``); every
        request's statistics count the step."""
        logits = self.model.forward_paged(ids, batch, self.cache, all_logits=all_logits)
        for r, n in zip(reqs, counts):
            r.stats.computed_tokens += n
        for st in _stats_of(reqs):
            st.steps += 1
            st.batch_sizes.append(len(batch.seq_ids))
            st.prefill_steps += kind == "prefill"
            st.spec_steps += kind == "verify"
        if self.on_step is not None:
            self.on_step(kind, len(batch.seq_ids), len(ids))
        return logits

    def _select(self, logits: Any, reqs: list[Request],
                positions: list[int]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Each request's token from its row of ``logits`` (its own sampling)."""
        return self.select(logits, [r.sampling for r in reqs], [r.key for r in reqs],
                             positions, [(r.prompt, r.output) for r in reqs])

    def _prefill(self, admitted: list[Request]) -> list[tuple[Request, TokenEvent]]:
        ids, starts, cached, counts = [], [], [], []
        for r in admitted:
            c = r.ctx_cached
            ctx = r.tokens[:-1] if r.output else r.prompt
            ids.extend(ctx[c:])
            counts.append(len(ctx) - c)
            starts.append(c)
            cached.append(c)
            if not r.output:
                r.stats.cached_prompt_tokens += c
        batch = self.cache.batch_for([r.seq_id for r in admitted], starts, cached)
        logits = self._forward(ids, batch, admitted, counts, "prefill")
        self.cache.mark_computed([r.seq_id for r in admitted])
        fresh = [r for r in admitted if not r.output]
        if not fresh:  # resumed requests: their next token is already known
            return []
        rows = logits[[i for i, r in enumerate(admitted) if not r.output]]
        toks, lps = self._select(rows, fresh, [len(r.prompt) for r in fresh])
        return [self._emit(r, [t], [lp]) for r, t, lp in zip(fresh, toks, lps)]

    def _decode(self, running: list[Request], waiting: deque) -> list[tuple[Request, TokenEvent]]:
        drafts = {}
        if self.spec is not None:
            for r in running:
                d = self._draft(r)
                if d:
                    drafts[id(r)] = d
        if drafts and self._can_verify(running, drafts):
            return self._verify(running, drafts)
        while True:
            if not running:  # every one of them failed for lack of cache
                return []
            try:
                batch = self.cache.prepare_decode([r.seq_id for r in running],
                                                  [[r.output[-1]] for r in running], 1)
                break
            except NoFreeBlocksError:
                self._make_room(running, waiting)
        logits = self._forward([r.output[-1] for r in running], batch, running,
                               [1] * len(running), "decode")
        self.cache.mark_computed([r.seq_id for r in running])
        toks, lps = self._select(logits, running, [len(r.tokens) for r in running])
        return [self._emit(r, [t], [lp]) for r, t, lp in zip(running, toks, lps)]

    def _make_room(self, running: list[Request], waiting: deque) -> None:
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
            self._preempt(running, waiting)

    def _fail(self, r: Request, why: str) -> None:
        """Finish ``r`` alone with ``finish_reason="error"``: its blocks freed, the
        text decoded so far flushed, its event queued for the caller."""
        if r.seq_id in self.cache.manager:
            self.cache.free_sequence(r.seq_id)
        r.finish_reason, r.error = "error", why
        text, _ = r.detok.push(r.output, final=True)
        self._failed.append((r, TokenEvent(r.index, [], text, "error", error=why)))

    def _preempt(self, running: list[Request], waiting: deque) -> None:
        victim = running.pop()
        self.cache.free_sequence(victim.seq_id)
        victim.life += 1
        victim.seq_id = f"{victim.seq_id.split(':')[0]}:{victim.life}"  # a fresh id per life
        waiting.appendleft(victim)
        victim.stats.preemptions += 1

    def _draft(self, r: Request) -> list[int]:
        if r.sampling.penalized or r.sampling.logprobs is not None:
            return []  # their tokens depend on what came before, position by position
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
        need = sum(blocks_needed(m.num_tokens(r.seq_id), len(drafts[id(r)]) + 1, bs)
                   if id(r) in drafts else 2 for r in running)
        return need <= m.num_free_blocks

    def _verify(self, running: list[Request],
                drafts: dict[int, list[int]]) -> list[tuple[Request, TokenEvent]]:
        """One step where drafted sequences run ``[last, d1..dk]`` on a fork of their
        cache (the real sequence is extended only by what is accepted) and the others
        run their last token."""
        from .spec_cache import commit_fork, open_fork

        seq_ids, ids, starts, counts = [], [], [], []
        forks: dict[int, Hashable] = {}
        try:
            for r in running:
                step = [r.output[-1]] + drafts.get(id(r), [])
                start = self.cache.manager.num_tokens(r.seq_id)
                if id(r) in drafts:
                    sid = forks[id(r)] = open_fork(self.cache, r.seq_id, step)
                else:
                    self.cache.append_tokens(r.seq_id, 1, step)
                    sid = r.seq_id
                seq_ids.append(sid)
                ids.extend(step)
                counts.append(len(step))
                starts.append(start)
            batch = self.cache.batch_for(seq_ids, starts)
            logits = self._forward(ids, batch, running, counts, "verify", all_logits=True)
        except BaseException:  # forks hold blocks: give them back before the error goes up
            for f in forks.values():
                if f in self.cache.manager:
                    self.cache.free_sequence(f)
            raise
        events, row = [], 0
        for r in running:
            d = drafts.get(id(r), [])
            n = len(d) + 1
            pos = len(r.tokens)
            chosen, lps = self.select(logits[row:row + n], [r.sampling] * n, [r.key] * n,
                                        list(range(pos, pos + n)))
            row += n
            if d:
                out = accept_draft(d, chosen)
                r.stats.spec_proposed += len(d)
                r.stats.spec_accepted += len(out) - 1
                commit_fork(self.cache, r.seq_id, forks[id(r)], [r.output[-1]] + out[:-1])
            else:
                out = chosen
            self.cache.mark_computed(r.seq_id)
            events.append(self._emit(r, out, lps[:len(out)]))
        return events

    # ------------------------------------------------------------------ output
    def _emit(self, r: Request, toks: list[int],
              lps: Sequence[TokenLogprob | None]) -> tuple[Request, TokenEvent]:
        """Append sampled tokens, cut at end-of-sequence / length, detokenize, check
        stop strings; returns the request and its event."""
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
        got = [lp for lp in lps[:len(new)] if lp is not None]
        r.logprobs.extend(got)
        r.stats.generated_tokens += len(new)
        if self.max_model_len is not None and len(r.tokens) >= self.max_model_len \
                and r.finish_reason is None:
            r.finish_reason = "length"
        text, hit = r.detok.push(r.output, final=r.finish_reason is not None)
        if hit:
            r.finish_reason = "stop"
        return r, TokenEvent(r.index, new, text, r.finish_reason, logprobs=got or None)


def _stats_of(reqs: Iterable[Request]) -> list[GenerationStats]:
    """The distinct statistics objects of ``reqs`` (one per client call)."""
    return list({id(r.stats): r.stats for r in reqs}.values())
