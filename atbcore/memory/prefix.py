"""Prefix caching: full KV blocks found again by the hash of their tokens and prefix.

A block's key is ``blake2b(parent key || its token ids)``: two sequences share a
block only when they agree on every token up to the end of that block, so a hit on
block i implies hits on blocks 0..i-1. Cached blocks that no sequence references are
kept (their KV is still valid) in least-recently-used order and evicted only when a
fresh block is needed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

__all__ = ["block_hash", "PrefixCache", "ROOT_HASH"]

ROOT_HASH = b"\x00" * 16


def block_hash(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Key of a full block: the parent block's key (``None`` for the first block), the
    block's token ids, and ``extra`` (e.g. an adapter id that changes the KV)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or ROOT_HASH)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra)
    return h.digest()


class PrefixCache:
    """Hash -> block table of computed full blocks, plus the LRU of unreferenced ones.

    The block manager owns reference counts; this class only knows which blocks are
    cached and which of those are idle (evictable)."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.lookups = self.lookup_tokens = self.hit_blocks = self.hit_tokens = 0
        self.evictions = 0

    # ------------------------------------------------------------------ queries
    def lookup(self, key: bytes) -> int | None:
        """The cached block holding ``key``, or None."""
        return self._by_hash.get(key)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    # ------------------------------------------------------------------ updates
    def register(self, block: int, key: bytes) -> bool:
        """Cache ``block`` under ``key``; False when the key or block is already cached
        (an identical block computed twice stays private to its sequence)."""
        if key in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[key] = block
        self._hash_of[block] = key
        return True

    def park(self, block: int) -> None:
        """``block`` lost its last reference: keep it, most recently used."""
        self._idle[block] = None
        self._idle.move_to_end(block)

    def unpark(self, block: int) -> None:
        """``block`` is referenced again (a hit): it is no longer evictable."""
        self._idle.pop(block, None)

    def evict(self) -> int | None:
        """Forget the least recently used idle block and return it (None if none)."""
        if not self._idle:
            return None
        block, _ = self._idle.popitem(last=False)
        del self._by_hash[self._hash_of.pop(block)]
        self.evictions += 1
        return block

    def clear_idle(self) -> list[int]:
        """Forget every idle block; returns them (to go back to the free list)."""
        out = []
        while self._idle:
            out.append(self.evict())
        return out

    def record(self, tokens: int, hit_blocks: int, block_size: int) -> None:
        self.lookups += 1
        self.lookup_tokens += tokens
        self.hit_blocks += hit_blocks
        self.hit_tokens += hit_blocks * block_size

    def stats(self) -> dict[str, Any]:
        rate = self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
        return {"cached_blocks": self.num_cached, "idle_blocks": self.num_idle,
                "lookups": self.lookups, "lookup_tokens": self.lookup_tokens,
                "hit_blocks": self.hit_blocks, "hit_tokens": self.hit_tokens,
                "hit_rate": rate, "evictions": self.evictions}
