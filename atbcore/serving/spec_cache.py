"""KV-cache bookkeeping of speculative verification, on the paged cache's public API.

The paged cache cannot shrink a sequence, so drafts are never written into the real
sequence: a verify step runs on a **fork** (``PagedKVCache.fork`` shares the blocks;
the partly filled last block is copied on the first write), and afterwards only the
accepted tokens are appended to the real sequence, their keys and values copied from
the fork's slots. The fork is then freed, dropping the rejected drafts' KV."""

from __future__ import annotations

from typing import Any, Hashable, Sequence

__all__ = ["open_fork", "commit_fork", "blocks_needed"]


def open_fork(cache: Any, seq_id: Hashable, step_tokens: Sequence[int]) -> Hashable:
    """Fork ``seq_id`` and give the fork room for ``step_tokens`` (the last sampled
    token and the drafts); returns the fork's id."""
    fork = f"spec:{seq_id}"
    cache.fork(seq_id, fork)
    try:
        cache.append_tokens(fork, len(step_tokens), list(step_tokens))
    except BaseException:
        cache.free_sequence(fork)
        raise
    return fork


def commit_fork(cache: Any, seq_id: Hashable, fork: Hashable, kept: Sequence[int]) -> None:
    """Append ``kept`` (the step's first tokens whose KV is now valid) to ``seq_id``,
    copy their keys/values from the fork's slots, then free the fork."""
    start = cache.manager.num_tokens(seq_id)
    dst = cache.append_tokens(seq_id, len(kept), list(kept))
    cache.copy_slots(cache.manager.slots(fork, start, start + len(kept)), dst)
    cache.free_sequence(fork)


def blocks_needed(num_tokens: int, step: int, block_size: int) -> int:
    """Upper bound of the blocks one drafted sequence of ``num_tokens`` takes during a
    verify step of ``step`` tokens: the fork (a copied last block plus growth) and
    the commit (the same again) held at once."""
    one = -(-(num_tokens + step) // block_size) - num_tokens // block_size + 1
    return 2 * one
