"""``NaiveAllocator``: one backing buffer per block, released at once on free.

The ``allocator_type="naive"`` of :func:`atbcore.runtime.config.init`. Same interface
and statistics as :class:`~atbcore.memory.pool.MemoryPool` (and the same misuse
checks), but no arena is shared or kept: useful as a baseline and for debugging, since
every block lives in its own device allocation.
"""

from __future__ import annotations

from ..errors import PoolExhaustedError
from .block import _Arena
from .pool import MemoryPool

__all__ = ["NaiveAllocator"]


class NaiveAllocator(MemoryPool):
    """Allocates every block separately; ``max_size`` still bounds the total."""

    kind = "naive"

    def _place(self, need: int) -> tuple[_Arena, int] | None:
        if self.config.max_size - self._reserved < need:
            return None
        arena = self._new_arena(need, need)
        return None if arena is None else (arena, 0)

    def reserve(self, nbytes: int) -> None:
        """Nothing is kept ahead of time; only checks that ``nbytes`` would fit."""
        with self._lock:
            if self.config.max_size - self._reserved < int(nbytes):
                self._n_failed += 1
                raise PoolExhaustedError("MemoryPool", f"cannot reserve {nbytes} B "
                                         f"[{self._summary()}]",
                                         f"<= {self.config.max_size - self._reserved} B",
                                         f"{nbytes} B")

    def _defragment(self) -> dict[str, int]:
        # Every block owns its buffer: there is no hole to close.
        self._n_defrag += 1
        return {"moved_blocks": 0, "moved_bytes": 0, "released_bytes": 0}

    def _after_free(self, arena: _Arena) -> None:
        # The block's buffer goes back to the device right away: nothing is cached.
        self._arenas.remove(arena)
        arena.buf = None  # the freed block still names its arena
        self._reserved -= arena.size
        self._released += arena.size
        self._n_released += 1
