"""``BlockManager``: which physical KV blocks each sequence uses (no tensors here).

Blocks are reference-counted: ``fork`` shares a parent's blocks with a child, and the
first write into a shared, partly filled block copies it (copy-on-write; the copy is
returned for the cache to perform). With prefix caching, full blocks are found again
by their token hash (see :mod:`atbcore.memory.prefix`). Running out of blocks raises
:class:`NoFreeBlocksError` before anything changes, so the caller can preempt a
sequence and retry; nothing already cached is lost.

    bm = BlockManager(num_blocks=1024, block_size=16, enable_prefix_caching=True)
    cached = bm.allocate("req0", token_ids=prompt)    # prompt tokens served from cache
    slots = bm.slots("req0", cached, len(prompt))     # where the rest is written
    bm.mark_computed("req0")                          # its full blocks become reusable
    slots, copies = bm.append_slots("req0", 1, [next_token])
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from ..errors import InputError, ParamsError, PoolExhaustedError
from .prefix import PrefixCache, block_hash

__all__ = ["BlockManager", "NoFreeBlocksError"]

_OP = "BlockManager"


class NoFreeBlocksError(PoolExhaustedError):
    """Not enough free KV blocks; nothing was changed (preempt a sequence and retry)."""


@dataclass
class _Seq:
    table: list[int]
    num_tokens: int
    tokens: list[int] | None  # None once token ids are unknown (no more hashing)
    hashes: list[bytes] = field(default_factory=list)  # keys of the full blocks
    registered: int = 0  # leading blocks already offered to the prefix cache


class BlockManager:
    """Block tables, reference counts, copy-on-write and prefix reuse; see module doc."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParamsError(_OP, name, "an int >= 1", repr(v))
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self.prefix: PrefixCache | None = PrefixCache() if enable_prefix_caching else None
        self._seqs: dict[Hashable, _Seq] = {}
        self.computed_tokens = 0  # tokens callers had to run through the model

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (free ones plus idle cached ones)."""
        return len(self._free) + (self.prefix.num_idle if self.prefix else 0)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return sum(1 for r in self._ref if r)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise InputError(_OP, "unknown sequence", "an allocated seq_id", repr(seq_id)) from None

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq(seq_id).table)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).num_tokens

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def slots(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> list[int]:
        """Cache slots (``block * block_size + offset``) of positions ``start..end-1``."""
        seq = self._seq(seq_id)
        end = seq.num_tokens if end is None else end
        if not 0 <= start <= end <= seq.num_tokens:
            raise InputError(_OP, "slot range", f"0 <= start <= end <= {seq.num_tokens}",
                             (start, end))
        bs = self.block_size
        return [seq.table[p // bs] * bs + p % bs for p in range(start, end)]

    # ------------------------------------------------------------------ helpers
    def _exhausted(self, what: str, seq_id: Hashable, need: int) -> NoFreeBlocksError:
        idle = self.prefix.num_idle if self.prefix else 0
        return NoFreeBlocksError(
            _OP, f"no free KV blocks to {what} sequence {seq_id!r} [num_blocks={self.num_blocks}, "
            f"free={len(self._free)}, idle_cached={idle}, used={self.num_used_blocks}, "
            f"sequences={len(self._seqs)}]", f"{need} free blocks", f"{self.num_free_blocks}")

    def _take(self) -> int:
        block = self._free.popleft() if self._free else self.prefix.evict()  # type: ignore[union-attr]
        self._ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self.prefix is not None and self.prefix.is_cached(block):
                self.prefix.park(block)  # KV still valid: reusable until evicted
            else:
                self._free.append(block)

    def _hash_full_blocks(self, seq: _Seq) -> None:
        if seq.tokens is None:
            return
        bs = self.block_size
        while len(seq.hashes) < len(seq.tokens) // bs:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes.append(block_hash(parent, seq.tokens[i * bs:(i + 1) * bs]))

    # ------------------------------------------------------------------ allocation
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int] | None = None,
                 num_tokens: int | None = None) -> int:
        """Blocks for a new sequence's prompt. Returns how many leading tokens are
        already cached (prefix hits; always fewer than the prompt, so the last token
        is computed and yields logits). Raises :class:`NoFreeBlocksError` unchanged."""
        return self.allocate_batch([seq_id], None if token_ids is None else [token_ids],
                                   None if num_tokens is None else [num_tokens])[0]

    def _new_seq(self, seq_id: Hashable, token_ids: Sequence[int] | None,
                 num_tokens: int | None) -> tuple[_Seq, list[int]]:
        """The sequence record of a prompt and the cached blocks it would reuse."""
        tokens = None if token_ids is None else [int(t) for t in token_ids]
        n = len(tokens) if tokens is not None else num_tokens
        if n is None or isinstance(n, bool) or not isinstance(n, int) or n < 1 or \
                (tokens is not None and num_tokens is not None and num_tokens != n):
            raise InputError(_OP, f"prompt length of {seq_id!r}",
                             "token_ids or num_tokens >= 1 (consistent)",
                             (None if tokens is None else len(tokens), num_tokens))
        seq = _Seq([], n, tokens)
        self._hash_full_blocks(seq)
        hits: list[int] = []
        if self.prefix is not None:
            for key in seq.hashes:
                b = self.prefix.lookup(key)
                if b is None:
                    break
                hits.append(b)
            if len(hits) * self.block_size >= n:
                hits.pop()  # recompute the last block so the last token has logits
        return seq, hits

    def allocate_batch(self, seq_ids: Sequence[Hashable],
                       token_ids: Sequence[Sequence[int]] | None = None,
                       num_tokens: Sequence[int] | None = None) -> list[int]:
        """``allocate`` for several prompts, all or nothing: the blocks every prompt
        reuses are claimed before any fresh block is taken, so no eviction can take a
        block another prompt of the batch is about to reuse."""
        ids = list(seq_ids)
        clash = [s for s in ids if s in self._seqs] or \
            [s for i, s in enumerate(ids) if s in ids[:i]]
        if clash:
            raise InputError(_OP, "sequence already allocated", "new, distinct seq_ids",
                             repr(clash[0]))
        plans = [self._new_seq(s, None if token_ids is None else token_ids[i],
                               None if num_tokens is None else num_tokens[i])
                 for i, s in enumerate(ids)]
        need = sum(-(-seq.num_tokens // self.block_size) - len(hits) for seq, hits in plans)
        idle_hits = {b for _, hits in plans for b in hits if self.prefix.is_idle(b)} \
            if self.prefix is not None else set()
        if need > self.num_free_blocks - len(idle_hits):
            raise self._exhausted("allocate", ids[0] if len(ids) == 1 else ids, need)
        for _, hits in plans:
            for b in hits:
                self._ref[b] += 1
                self.prefix.unpark(b)  # type: ignore[union-attr]
        cached = []
        for s, (seq, hits) in zip(ids, plans):
            fresh = -(-seq.num_tokens // self.block_size) - len(hits)
            seq.table = hits + [self._take() for _ in range(fresh)]
            seq.registered = len(hits)
            if self.prefix is not None:
                self.prefix.record(seq.num_tokens, len(hits), self.block_size)
            cached.append(len(hits) * self.block_size)
            self.computed_tokens += seq.num_tokens - cached[-1]
            self._seqs[s] = seq
        return cached

    def _append_need(self, seq: _Seq, n: int, refs: dict[int, int]) -> int:
        """New blocks ``n`` more tokens take, including a copy of a shared last block."""
        need = -(-(seq.num_tokens + n) // self.block_size) - len(seq.table)
        if seq.num_tokens % self.block_size and n:
            last = seq.table[-1]
            r = refs.get(last, self._ref[last])
            if r > 1:
                need += 1
                refs[last] = r - 1
        return need

    def can_append(self, seq_ids: Sequence[Hashable], num_tokens: int = 1) -> bool:
        refs: dict[int, int] = {}
        need = sum(self._append_need(self._seq(s), num_tokens, refs) for s in seq_ids)
        return need <= self.num_free_blocks

    def append_slots(self, seq_id: Hashable, num_tokens: int = 1,
                     token_ids: Sequence[int] | None = None
                     ) -> tuple[list[int], list[tuple[int, int]]]:
        """Room for ``num_tokens`` more tokens. Returns their slots and the
        copy-on-write copies ``(src_block, dst_block)`` the cache must perform first."""
        return self.append_slots_batch([seq_id], num_tokens,
                                       None if token_ids is None else [token_ids])

    def append_slots_batch(self, seq_ids: Sequence[Hashable], num_tokens: int = 1,
                           token_ids: Sequence[Sequence[int]] | None = None
                           ) -> tuple[list[int], list[tuple[int, int]]]:
        """``append_slots`` for several sequences, all or nothing."""
        seqs = [self._seq(s) for s in seq_ids]
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InputError(_OP, "num_tokens", "an int >= 0", repr(num_tokens))
        if token_ids is not None and (len(token_ids) != len(seqs) or
                                      any(len(t) != num_tokens for t in token_ids)):
            raise InputError(_OP, "token_ids", f"{len(seqs)} lists of {num_tokens} ids",
                             [len(t) for t in token_ids])
        refs: dict[int, int] = {}
        need = sum(self._append_need(s, num_tokens, refs) for s in seqs)
        if need > self.num_free_blocks:
            raise self._exhausted("append to", seq_ids[0] if len(seqs) == 1 else list(seq_ids),
                                  need)
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        for i, (sid, seq) in enumerate(zip(seq_ids, seqs)):
            last = seq.table[-1] if seq.table else None
            if seq.num_tokens % self.block_size and num_tokens and self._ref[last] > 1:
                fresh = self._take()  # copy-on-write of the shared, partly filled block
                copies.append((last, fresh))
                self._ref[last] -= 1
                seq.table[-1] = fresh
            grow = -(-(seq.num_tokens + num_tokens) // self.block_size) - len(seq.table)
            seq.table.extend(self._take() for _ in range(grow))
            start = seq.num_tokens
            seq.num_tokens += num_tokens
            slots.extend(self.slots(sid, start, seq.num_tokens))
            if seq.tokens is not None:
                if token_ids is None:
                    seq.tokens = None  # ids unknown from here on: stop hashing
                else:
                    seq.tokens.extend(int(t) for t in token_ids[i])
                    self._hash_full_blocks(seq)
        self.computed_tokens += num_tokens * len(seqs)
        return slots, copies

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """``child`` shares all of ``parent``'s blocks (copied on its first write)."""
        src = self._seq(parent)
        if child in self._seqs:
            raise InputError(_OP, "fork target already exists", "a new seq_id", repr(child))
        for b in src.table:
            self._ref[b] += 1
        self._seqs[child] = _Seq(list(src.table), src.num_tokens,
                                 None if src.tokens is None else list(src.tokens),
                                 list(src.hashes), src.registered)

    def mark_computed(self, seq_id: Hashable) -> int:
        """The sequence's tokens so far are in the cache: offer its full blocks to the
        prefix cache. Returns how many blocks were newly cached."""
        seq = self._seq(seq_id)
        if self.prefix is None:
            return 0
        new = 0
        full = min(len(seq.hashes), seq.num_tokens // self.block_size)
        for i in range(seq.registered, full):
            new += self.prefix.register(seq.table[i], seq.hashes[i])
        seq.registered = max(seq.registered, full)
        return new

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; blocks nobody else holds go back (cached ones stay reusable,
        released tail first so that they are evicted before the shared head)."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        for b in reversed(seq.table):
            self._release(b)

    def reset_prefix_cache(self) -> int:
        """Forget every idle cached block; returns how many were freed."""
        if self.prefix is None:
            return 0
        blocks = self.prefix.clear_idle()
        self._free.extend(blocks)
        return len(blocks)

    # ------------------------------------------------------------------ checking
    def filled_slots(self) -> int:
        """Slots of used blocks that hold a token (a shared block counts once)."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for seq in self._seqs.values():
            for i, b in enumerate(seq.table):
                fill[b] = max(fill.get(b, 0), min(bs, seq.num_tokens - i * bs))
        return sum(fill.values())

    def stats(self) -> dict[str, Any]:
        """Counts of blocks, sequences and tokens (``filled_slots``: slots holding a
        token, ``waste_slots``: reserved slots holding none), prefix-cache counters."""
        filled = self.filled_slots()
        out = {"num_blocks": self.num_blocks, "block_size": self.block_size,
               "free_blocks": len(self._free), "used_blocks": self.num_used_blocks,
               "sequences": len(self._seqs), "computed_tokens": self.computed_tokens,
               "tokens": sum(s.num_tokens for s in self._seqs.values()),
               "filled_slots": filled,
               "waste_slots": self.num_used_blocks * self.block_size - filled}
        if self.prefix is not None:
            out["prefix"] = self.prefix.stats()
        return out

    def check(self) -> None:
        """Assert the bookkeeping is consistent (tests and debugging)."""
        refs = [0] * self.num_blocks
        for seq in self._seqs.values():
            assert len(seq.table) == -(-seq.num_tokens // self.block_size), "table length"
            for b in seq.table:
                refs[b] += 1
        assert refs == self._ref, "reference counts disagree with the block tables"
        free = set(self._free)
        idle = set(self.prefix._idle) if self.prefix else set()
        assert len(free) == len(self._free) and not free & idle
        assert all(refs[b] == 0 for b in free | idle)
        assert len(free) + len(idle) + self.num_used_blocks == self.num_blocks
