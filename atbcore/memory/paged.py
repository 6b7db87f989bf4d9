"""``PagedKVCache``: block caches in the layout ReshapeAndCache / PagedAttention take,
managed by a :class:`~atbcore.memory.block_manager.BlockManager`.

Storage is one pinned pool block ``[num_layers, 2, num_blocks, block_size, Hkv, D]``;
``key_cache(layer)`` / ``value_cache(layer)`` are ``[num_blocks, block_size, Hkv, D]``
views. A step of a paged model reads:

    cache = PagedKVCache(2, num_blocks=256, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype="fp16", enable_prefix_caching=True)
    batch = cache.prepare_prefill(["a", "b"], [prompt_a, prompt_b])
    # per layer: cache.write(layer, k, v, batch.slot_mapping)
    #            PagedAttention([q, kc, vc, batch.block_tables, batch.context_lens,
    #                            batch.q_seq_lens])
    cache.mark_computed(["a", "b"])
    batch = cache.prepare_decode(["a", "b"], [[tok_a], [tok_b]])   # one token each

``batch.num_cached[i]`` prompt tokens of sequence i were served by the prefix cache:
only the remaining ``q_seq_lens[i]`` tokens (``batch.positions``) are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, MemoryError_, ParamsError
from .block_manager import BlockManager, NoFreeBlocksError
from .cache_common import check_positive_ints, native_ints, pool_for, to_backing
from .pool import Block, MemoryPool

__all__ = ["PagedKVCache", "PagedBatch", "NoFreeBlocksError"]

_OP = "PagedKVCache"


@dataclass
class PagedBatch:
    """Metadata of one step, as tensors of the cache's framework on its device.

    ``slot_mapping`` int32 [T] (ReshapeAndCache), ``block_tables`` int32 [B, max_blocks]
    (rows padded with block 0 past each context), ``context_lens`` int32 [B],
    ``q_seq_lens`` int32 [B] (new tokens per sequence; T = their sum), ``positions``
    int64 [T] (positions of the new tokens, e.g. for RoPE), ``num_cached`` (per
    sequence, prompt tokens reused from the prefix cache)."""

    seq_ids: list[Hashable]
    slot_mapping: Any
    block_tables: Any
    context_lens: Any
    q_seq_lens: Any
    positions: Any
    num_cached: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)


class PagedKVCache:
    """Paged KV cache with block manager; see the module docstring."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: Any = Dtype.FP16, device: str = "cpu",
                 pool: MemoryPool | None = None, enable_prefix_caching: bool = False) -> None:
        check_positive_ints(_OP, num_layers=num_layers, num_blocks=num_blocks,
                            block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        try:
            self.dtype = Dtype.of(dtype)
        except ValueError as e:
            raise ParamsError(_OP, "dtype", "a Dtype or dtype name", repr(dtype)) from e
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self.block_bytes = self.nbytes // num_blocks  # one block across layers, K and V
        self.pool = pool_for(_OP, device, self.nbytes, pool)
        self._block: Block | None = self.pool.alloc(self.nbytes, pinned=True)
        self._kv = self._block.tensor(self.shape, self.dtype)
        # Zeroed once: slots past a sequence's length are masked by attention, but
        # uninitialised bytes can hold NaN/Inf, and 0 * NaN would leak through.
        self._kv[...] = 0
        self.device = self.pool.device
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self._rac: Any = None
        # Bumped by every edit made through this object (writes, block copies, sequences
        # added / freed / forked), so a reader keeping a copy of some KV (the torch
        # runner's decode copy) knows when to refresh it. Appends alone do not bump it.
        self.version = 0

    # ------------------------------------------------------------------ storage
    def _alive(self) -> Any:
        if self._block is None:
            raise MemoryError_(_OP, "use of a destroyed cache", "a live PagedKVCache", "destroyed")
        return self._kv

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or \
                not 0 <= layer < self.num_layers:
            raise InputError(_OP, "layer", f"an int in 0..{self.num_layers - 1}", repr(layer))
        return int(layer)

    def key_cache(self, layer: int) -> Any:
        """``[num_blocks, block_size, Hkv, D]`` keys of ``layer`` (a view)."""
        return self._alive()[self._layer(layer), 0]

    def value_cache(self, layer: int) -> Any:
        """``[num_blocks, block_size, Hkv, D]`` values of ``layer`` (a view)."""
        return self._alive()[self._layer(layer), 1]

    def _ints(self, values: Any, dtype: Any = np.int32) -> Any:
        return native_ints(values, self.pool.backing.name, self._alive(), dtype)

    def _copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        kv = self._alive()
        if copies:
            self.version += 1
        for src, dst in copies:  # every layer, keys and values
            kv[:, :, dst] = kv[:, :, src]

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the keys and values at slots ``src`` to slots ``dst``, every layer
        (a speculative fork's accepted tokens into their sequence)."""
        src, dst = [int(s) for s in src], [int(s) for s in dst]
        if src == dst:
            return
        kv, bs = self._alive(), self.block_size  # [L, 2, num_blocks, block_size, Hkv, D]
        self.version += 1
        src_b, src_o, dst_b, dst_o = (self._ints(v, np.int64) for v in (
            [s // bs for s in src], [s % bs for s in src], [s // bs for s in dst],
            [s % bs for s in dst]))
        kv[:, :, dst_b, dst_o] = kv[:, :, src_b, src_o]

    def write(self, layer: int, key: Any, value: Any, slot_mapping: Any) -> None:
        """Store ``key``/``value`` ``[T, Hkv, D]`` at ``slot_mapping`` in ``layer`` through
        the ReshapeAndCache op (in place). Inputs of another framework or device are
        brought to the cache's first (no dtype cast)."""
        if self._rac is None:
            from ..operation import Builder

            self._rac = Builder().build_operation("ReshapeAndCache", {})
        kc, vc = self.key_cache(layer), self.value_cache(layer)
        self.version += 1
        name = self.pool.backing.name
        self._rac.execute([to_backing(key, name, kc), to_backing(value, name, kc), kc, vc,
                           to_backing(slot_mapping, name, kc)])

    def gather(self, layer: int, seq_id: Hashable) -> tuple[Any, Any]:
        """Contiguous copies of a sequence's keys and values ``[n, Hkv, D]`` (debugging)."""
        kc, vc = self.key_cache(layer), self.value_cache(layer)
        slots = self.manager.slots(seq_id)
        blocks = [s // self.block_size for s in slots]
        offs = [s % self.block_size for s in slots]
        return kc[blocks, offs], vc[blocks, offs]

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None,
                     num_tokens: int | None = None) -> int:
        """Allocate a prompt; returns the number of leading tokens already cached."""
        self._alive()
        self.version += 1
        return self.manager.allocate(seq_id, token_ids, num_tokens)

    def append_tokens(self, seq_id: Hashable, num_tokens: int = 1,
                      token_ids: Sequence[int] | None = None) -> list[int]:
        """Room for more tokens (copy-on-write done here); returns their slots."""
        self._alive()
        slots, copies = self.manager.append_slots(seq_id, num_tokens, token_ids)
        self._copy_blocks(copies)
        return slots

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """``child`` continues from ``parent``'s tokens, sharing its blocks."""
        self._alive()
        self.version += 1
        self.manager.fork(parent, child)

    def free_sequence(self, seq_id: Hashable) -> None:
        self._alive()
        self.version += 1
        self.manager.free(seq_id)

    def mark_computed(self, seq_ids: Sequence[Hashable] | Hashable) -> None:
        """Call after a step has written its tokens: full blocks become prefix hits."""
        ids = seq_ids if isinstance(seq_ids, (list, tuple)) else [seq_ids]
        for s in ids:
            self.manager.mark_computed(s)

    def block_tables(self, seq_ids: Sequence[Hashable]) -> Any:
        """int32 ``[B, max_blocks]`` (padded with block 0 past each sequence's blocks)."""
        tables = [self.manager.block_table(s) for s in seq_ids]
        width = max((len(t) for t in tables), default=0) or 1
        out = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = t
        return self._ints(out)

    def context_lens(self, seq_ids: Sequence[Hashable]) -> Any:
        return self._ints([self.manager.num_tokens(s) for s in seq_ids])

    def batch_for(self, seq_ids: Sequence[Hashable], starts: Sequence[int],
                  cached: Sequence[int] | None = None) -> PagedBatch:
        """A step's metadata for the tokens of each sequence from ``starts[i]`` to its
        current length (any mix: prefill chunks after ``append_tokens``, decode
        tokens, drafts on a fork); ``cached``: prompt tokens served by the prefix
        cache, per sequence (default none)."""
        seq_ids, starts = list(seq_ids), [int(a) for a in starts]
        cached = [0] * len(seq_ids) if cached is None else list(cached)
        ends = [self.manager.num_tokens(s) for s in seq_ids]
        slots = [x for s, a, e in zip(seq_ids, starts, ends) for x in self.manager.slots(s, a, e)]
        pos = [p for a, e in zip(starts, ends) for p in range(a, e)]
        return PagedBatch(list(seq_ids), self._ints(slots), self.block_tables(seq_ids),
                          self._ints(ends), self._ints([e - a for a, e in zip(starts, ends)]),
                          self._ints(pos, np.int64), cached)

    def prepare_prefill(self, seq_ids: Sequence[Hashable],
                        token_ids: Sequence[Sequence[int]] | None = None,
                        num_tokens: Sequence[int] | None = None) -> PagedBatch:
        """Allocate several prompts at once (all or nothing) and return the step's
        metadata; the new tokens are those past each sequence's cached prefix."""
        self._alive()
        seq_ids = list(seq_ids)
        self.version += 1
        cached = self.manager.allocate_batch(seq_ids, token_ids, num_tokens)
        return self.batch_for(seq_ids, cached, cached)

    def prepare_decode(self, seq_ids: Sequence[Hashable],
                       token_ids: Sequence[Sequence[int]] | None = None,
                       num_tokens: int = 1) -> PagedBatch:
        """Room for ``num_tokens`` new tokens in each sequence (all or nothing)."""
        self._alive()
        seq_ids = list(seq_ids)
        starts = [self.manager.num_tokens(s) for s in seq_ids]
        _, copies = self.manager.append_slots_batch(seq_ids, num_tokens, token_ids)
        self._copy_blocks(copies)
        return self.batch_for(seq_ids, starts)

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, Any]:
        """Block manager statistics plus bytes: ``used_bytes`` (blocks referenced),
        ``token_bytes`` (slots holding a token; shared blocks once) and
        ``waste_bytes`` (reserved slots holding none)."""
        s = self.manager.stats()
        per_token = self.block_bytes // self.block_size
        s.update(nbytes=self.nbytes, block_bytes=self.block_bytes,
                 used_bytes=s["used_blocks"] * self.block_bytes,
                 token_bytes=s["filled_slots"] * per_token,
                 waste_bytes=s["waste_slots"] * per_token)
        return s

    def destroy(self) -> None:
        """Return the memory to the pool; the cache cannot be used afterwards."""
        if self._block is not None:
            self.version += 1
            blk, self._block, self._kv = self._block, None, None
            blk.free()
            if getattr(self.pool, "private", False):
                self.pool.release()
            if self._rac is not None:
                self._rac.destroy()

    release = destroy

    @property
    def freed(self) -> bool:
        return self._block is None

    def __enter__(self) -> "PagedKVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}x"
                f"{self.block_size}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"{self.dtype.name}, {self.device})")
