"""``MemoryPool``: arenas carved into blocks by best fit, with splitting, coalescing,
growth up to ``max_size`` and defragmentation.

    pool = MemoryPool(MemoryPoolConfig(max_size=1 << 30, growth_factor=1.5))
    blk = pool.alloc(4096)
    x = blk.tensor((32, 32), Dtype.FP32)   # a torch (or NumPy) view into the arena
    blk.free()

A :class:`Block` is the handle of an allocation. The pool owns the record of where it
lives (arena, offset) and updates it when :meth:`MemoryPool.defragment` moves the block,
so the handle stays valid. A block never moves while a view it handed out is alive
(the view holds a lease until it is garbage-collected) or while it is pinned (KV
caches pin their storage); slices of a view do not hold the lease, so keep the view
itself while using them. Misuse (double free, a handle of another pool, use after
free) raises :class:`MemoryError_` and leaves the pool as it was.

Giving memory back: the pool keeps free space inside arenas that still hold a block
(it is reused by best fit), but an arena that a free leaves empty goes back to the
device -- on the CPU its pages back to the OS -- once the empty arenas together
exceed ``config.release_threshold`` (default 0: at once; ``None``: only on
:meth:`MemoryPool.trim` or :meth:`MemoryPool.release`). ``stats()`` counts what went
back (``released_bytes``, ``release_count``). Plans take one block per GraphOp
(:mod:`atbcore.memory.plan_arena`), so a GraphOp destroyed or grown frees whole arenas.

Thread safety: every method of the pool and of its blocks takes the pool's lock, and
a defragmentation (explicit, or the one ``enable_defrag`` runs inside a failing
``alloc``) moves only blocks with no live view, under that lock. So threads may
alloc, write and read through their views, and free concurrently with defragmentation
on: a block's contents stay intact until it is freed. What the lock cannot guard is
two threads writing the *same* block: that is the caller's to order.
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any, Sequence

from ..errors import MemoryError_, ParamsError, PoolExhaustedError
from .backing import Backing, make_backing
from .block import Block, _Arena
from .config import MemoryPoolConfig

__all__ = ["Block", "MemoryPool"]

_OP = "MemoryPool"


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


class MemoryPool:
    """Best-fit pool over growable arenas; see the module docstring.

    ``alloc(nbytes, pinned=False) -> Block``, ``free(block)``, ``defragment()``,
    ``reserve(nbytes)`` (grow ahead of time), ``release()`` / ``trim(keep)`` (give
    empty arenas back; ``config.release_threshold`` does it on every free),
    ``stats()``, ``layout()`` (arenas with their live and free segments).
    """

    kind = "pool"

    def __init__(self, config: MemoryPoolConfig | None = None, **kw: Any) -> None:
        if config is None:
            config = MemoryPoolConfig(**kw)
        elif kw:
            raise ParamsError(_OP, "give either a MemoryPoolConfig or keywords", "one", "both")
        self.config = config
        self.backing: Backing = make_backing(config.device)
        self.device = self.backing.device
        self._lock = threading.RLock()
        self._arenas: list[_Arena] = []
        self._arena_ids = itertools.count()
        self._block_ids = itertools.count(1)
        self._live: dict[int, Block] = {}
        self._last_arena_size = 0
        self._reserved = self._allocated = self._requested = 0
        self._peak = self._peak_reserved = 0
        self._n_alloc = self._n_free = self._n_failed = self._n_defrag = 0
        self._released = self._n_released = 0  # arenas given back to the device

    # ------------------------------------------------------------------ allocation
    def alloc(self, nbytes: int, pinned: bool = False) -> Block:
        """A block of at least ``nbytes`` (aligned to ``config.alignment``).

        Raises :class:`PoolExhaustedError` (statistics in the message) when ``max_size``
        cannot hold it even after releasing empty arenas and, with ``enable_defrag``,
        defragmenting; the pool is unchanged and serves again after frees.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            try:
                ok = int(nbytes) == nbytes and int(nbytes) >= 0 and not isinstance(nbytes, bool)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ParamsError(_OP, "alloc size", "an int >= 0", repr(nbytes))
            nbytes = int(nbytes)
        need = _align_up(max(nbytes, 1), self.config.alignment)
        with self._lock:
            place = self._place(need)
            if place is None:
                self._n_failed += 1
                raise PoolExhaustedError(
                    _OP, f"cannot allocate {nbytes} B ({need} B aligned) within max_size "
                    f"[{self._summary()}]", f"<= {self._servable()} B", f"{nbytes} B")
            arena, off = place
            arena.take(off, need)
            blk = Block(self, arena, off, need, nbytes, next(self._block_ids), pinned)
            arena.live[blk.id] = blk
            self._live[blk.id] = blk
            self._allocated += need
            self._requested += nbytes
            self._peak = max(self._peak, self._allocated)
            self._n_alloc += 1
            return blk

    allocate = alloc

    def _place(self, need: int) -> tuple[_Arena, int] | None:
        """Where a block of ``need`` bytes goes, growing/releasing/defragmenting as needed."""
        place = self._best_fit(need, self._arenas)
        if place is not None:
            return place
        arena = self._grow(need)
        if arena is None and self._release_empty():
            arena = self._grow(need)
        if arena is None and self.config.enable_defrag and self._live:
            self._defragment()
            place = self._best_fit(need, self._arenas)
            if place is not None:
                return place
            arena = self._grow(need)
        return None if arena is None else (arena, 0)

    @staticmethod
    def _best_fit(need: int, arenas: Sequence[_Arena]) -> tuple[_Arena, int] | None:
        best: tuple[int, _Arena, int] | None = None
        for a in arenas:
            for off in a.free_offs:
                size = a.free_size[off]
                if size >= need and (best is None or size < best[0]):
                    best = (size, a, off)
                    if size == need:
                        return a, off
        return None if best is None else (best[1], best[2])

    def _grow(self, need: int) -> _Arena | None:
        """A new arena of ``growth_factor`` x the previous one (at least ``need``)."""
        cfg = self.config
        room = cfg.max_size - self._reserved
        if room < need:
            return None
        if self._last_arena_size == 0:
            target = cfg.initial_size if cfg.initial_size is not None else min(cfg.max_size,
                                                                               cfg.DEFAULT_INITIAL)
        else:
            target = math.ceil(self._last_arena_size * cfg.growth_factor)
        size = max(need, min(target, room) // cfg.alignment * cfg.alignment)
        return self._new_arena(size, need)

    def _new_arena(self, size: int, need: int) -> _Arena | None:
        align = self.config.alignment
        try:
            buf = self.backing.allocate(size + align)  # slack to align the base address
        except (MemoryError, RuntimeError) as e:
            raise PoolExhaustedError(_OP, f"the device refused an arena of {size} B: {e} "
                                     f"[{self._summary()}]", f"{need} B", "out of device memory")
        base = (-self.backing.address(buf)) % align
        arena = _Arena(next(self._arena_ids), buf, base, size)
        self._arenas.append(arena)
        self._reserved += size
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        self._last_arena_size = max(self._last_arena_size, size)
        return arena

    # ------------------------------------------------------------------ freeing
    def free(self, block: Block) -> None:
        """Return ``block``; double frees and foreign handles raise :class:`MemoryError_`."""
        with self._lock:
            if not isinstance(block, Block):
                raise MemoryError_(_OP, "free of something that is not a Block",
                                   "a Block from this pool", type(block).__name__)
            if block._pool is not self:
                raise MemoryError_(_OP, "free of a foreign block", "a Block from this pool",
                                   f"{block!r} of another pool")
            if block._freed:
                raise MemoryError_(_OP, "double free", "a live block",
                                   f"block #{block.id} ({block.nbytes} B), already freed")
            if self._live.get(block.id) is not block:
                raise MemoryError_(_OP, "free of an unknown block", "a Block this pool handed out",
                                   repr(block))
            arena = block._arena
            del self._live[block.id]
            del arena.live[block.id]
            arena.give(block._offset, block.size)
            block._freed = True
            self._allocated -= block.size
            self._requested -= block.nbytes
            self._n_free += 1
            self._after_free(arena)

    def _after_free(self, arena: _Arena) -> None:
        """An arena the free left empty goes back beyond ``release_threshold`` (the
        naive allocator overrides this: each of its arenas goes back at once)."""
        keep = self.config.release_threshold
        if keep is not None and not arena.live:
            self._release_empty(keep)

    def release(self) -> int:
        """Give arenas that hold no live block back to the device; returns bytes released."""
        with self._lock:
            return self._release_empty()

    empty_cache = release

    def trim(self, keep: int = 0) -> int:
        """Give empty arenas back, largest first, until at most ``keep`` bytes of them
        remain; returns bytes released. Blocks in use never move or go."""
        with self._lock:
            return self._release_empty(int(keep))

    def _release_empty(self, keep: int = 0) -> int:
        empty = sorted((a for a in self._arenas if not a.live), key=lambda a: -a.size)
        idle = sum(a.size for a in empty)
        gone = 0
        for a in empty:
            if idle <= keep:
                break
            self._arenas.remove(a)
            a.buf = None  # freed blocks still name their arena: drop the memory itself
            self._reserved -= a.size
            idle -= a.size
            gone += a.size
            self._n_released += 1
        self._released += gone
        return gone

    # ------------------------------------------------------------------ growth & defrag
    def reserve(self, nbytes: int) -> None:
        """Make sure one free segment of ``nbytes`` exists, growing now rather than later."""
        need = _align_up(max(int(nbytes), 1), self.config.alignment)
        with self._lock:
            if self._best_fit(need, self._arenas) is None and self._grow(need) is None:
                self._n_failed += 1
                raise PoolExhaustedError(_OP, f"cannot reserve {nbytes} B [{self._summary()}]",
                                         f"<= {self.config.max_size - self._reserved} B",
                                         f"{nbytes} B")

    def defragment(self) -> dict[str, int]:
        """Compact live, movable blocks (unpinned, no live view; contents kept, handles
        updated) and release
        emptied arenas. Returns ``{"moved_blocks", "moved_bytes", "released_bytes"}``."""
        with self._lock:
            return self._defragment()

    def _defragment(self) -> dict[str, int]:
        moved = [0, 0]
        for a in self._arenas:
            self._compact(a, moved)
        # Pull blocks of later arenas into holes of earlier ones, so whole arenas empty out.
        for j in range(len(self._arenas) - 1, 0, -1):
            src = self._arenas[j]
            for blk in sorted(src.live.values(), key=lambda b: -b.size):
                if not blk.movable:
                    continue
                place = self._best_fit(blk.size, self._arenas[:j])
                if place is not None:
                    self._move(blk, place[0], place[1], moved)
            self._compact(src, moved)
        self._n_defrag += 1
        released = self._release_empty()
        return {"moved_blocks": moved[0], "moved_bytes": moved[1], "released_bytes": released}

    def _compact(self, arena: _Arena, moved: list[int]) -> None:
        """Slide unpinned blocks, in address order, into the lowest free space below them
        that holds them (the free run right below a block always does, once merged)."""
        for blk in sorted(arena.live.values(), key=lambda b: b._offset):
            if not blk.movable:
                continue
            for off in arena.free_offs:
                if off >= blk._offset:
                    break
                size = arena.free_size[off]
                if size >= blk.size or off + size == blk._offset:
                    self._move(blk, arena, off, moved)
                    break

    def _move(self, blk: Block, dst: _Arena, off: int, moved: list[int]) -> None:
        src = blk._arena
        self.backing.move(dst.buf, dst.base + off, src.buf, src.base + blk._offset, blk.nbytes)
        # Bookkeeping after the copy; give() before take() so that a block sliding onto
        # the free run right below it merges with that run first.
        del src.live[blk.id]
        src.give(blk._offset, blk.size)
        dst.take(off, blk.size)
        blk._arena, blk._offset = dst, off
        dst.live[blk.id] = blk
        blk.version += 1
        moved[0] += 1
        moved[1] += blk.nbytes

    # ------------------------------------------------------------------ introspection
    def _largest_free(self) -> int:
        return max((s for a in self._arenas for s in a.free_size.values()), default=0)

    def _servable(self) -> int:
        return max(self._largest_free(), self.config.max_size - self._reserved)

    def _summary(self) -> str:
        s = self.stats()
        return ", ".join(f"{k}={s[k]}" for k in ("max_size", "reserved", "allocated",
                                                 "largest_free_block", "num_arenas",
                                                 "num_blocks")) + \
            f", fragmentation={s['fragmentation']:.3f}"

    def stats(self) -> dict[str, Any]:
        """Byte counts and counters; ``fragmentation = 1 - largest_free / free``."""
        with self._lock:
            free = self._reserved - self._allocated
            largest = self._largest_free()
            return {
                "allocator": self.kind, "backing": self.backing.name, "device": self.device,
                "max_size": self.config.max_size, "reserved": self._reserved,
                "allocated": self._allocated, "requested": self._requested, "free": free,
                "peak": self._peak, "peak_reserved": self._peak_reserved,
                "largest_free_block": largest,
                "fragmentation": (1.0 - largest / free) if free else 0.0,
                "num_arenas": len(self._arenas), "num_blocks": len(self._live),
                "alloc_count": self._n_alloc, "free_count": self._n_free,
                "failed_allocs": self._n_failed, "defrag_count": self._n_defrag,
                "release_threshold": self.config.release_threshold,
                "released_bytes": self._released, "release_count": self._n_released,
            }

    def layout(self) -> list[dict[str, Any]]:
        """Per arena: ``{"id", "size", "live": [(offset, size, block id)], "free": [(offset, size)]}``."""
        with self._lock:
            return [{"id": a.id, "size": a.size,
                     "live": sorted((b._offset, b.size, b.id) for b in a.live.values()),
                     "free": a.segments()} for a in self._arenas]

    def live_blocks(self) -> list[Block]:
        with self._lock:
            return list(self._live.values())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device={self.device!r}, backing={self.backing.name}, "
                f"reserved={self._reserved}, allocated={self._allocated})")
