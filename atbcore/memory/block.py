"""``Block`` (the handle of one allocation) and ``_Arena`` (one backing buffer with
its free list), the two records a :class:`~atbcore.memory.pool.MemoryPool` manages.

A block's place (arena, offset) belongs to its pool, which updates it when a
defragmentation moves the block (``version`` counts the moves). A block never moves
while it is pinned or while a view it handed out (``view``/``tensor``/``raw``) is
alive: each view holds a lease that its garbage collection returns, so a thread
writing through its view cannot have the bytes moved under it by another thread's
allocation. Slices or reshapes *of* a view share its memory but not its lease: keep
the view itself alive while using them (or ``pin()`` the block).
"""

from __future__ import annotations

import bisect
import math
import weakref
from typing import TYPE_CHECKING, Any, Sequence

from ..dtypes import Dtype
from ..errors import MemoryError_, ParamsError

if TYPE_CHECKING:
    from .pool import MemoryPool

__all__ = ["Block", "free_when_unviewed"]

_OP = "MemoryPool"


class _Arena:
    """One backing buffer. ``free_offs`` is sorted; ``free_size`` maps offset -> size."""

    __slots__ = ("id", "buf", "base", "size", "free_offs", "free_size", "live")

    def __init__(self, ident: int, buf: Any, base: int, size: int) -> None:
        self.id, self.buf, self.base, self.size = ident, buf, base, size
        self.free_offs: list[int] = [0]
        self.free_size: dict[int, int] = {0: size}
        self.live: dict[int, Block] = {}

    def take(self, off: int, need: int) -> None:
        """Carve ``need`` bytes from the start of free segment ``off`` (split the rest)."""
        size = self.free_size.pop(off)
        del self.free_offs[bisect.bisect_left(self.free_offs, off)]
        if size > need:
            bisect.insort(self.free_offs, off + need)
            self.free_size[off + need] = size - need

    def give(self, off: int, size: int) -> None:
        """Return ``[off, off + size)`` to the free list, merging with its neighbours."""
        i = bisect.bisect_left(self.free_offs, off)
        if i < len(self.free_offs) and self.free_offs[i] == off + size:  # merge right
            size += self.free_size.pop(off + size)
            del self.free_offs[i]
        if i > 0:
            left = self.free_offs[i - 1]
            if left + self.free_size[left] == off:  # merge left
                self.free_size[left] += size
                return
        self.free_offs.insert(i, off)
        self.free_size[off] = size

    def segments(self) -> list[tuple[int, int]]:
        return [(o, self.free_size[o]) for o in self.free_offs]


class _Lease:
    """The callback of a view's weak reference: takes the reference out of its block's
    leases (a referent like a NumPy array is unhashable, so refs are kept by id)."""

    __slots__ = ("leases",)

    def __init__(self, leases: dict[int, Any]) -> None:
        self.leases = leases

    def __call__(self, ref: Any) -> None:
        self.leases.pop(id(ref), None)


class Block:
    """Handle of one allocation: ``nbytes`` requested, ``size`` bytes reserved (aligned).

    ``view(offset, shape, dtype)`` / ``tensor(shape, dtype)`` return native tensors
    (torch or NumPy, per the pool's backing) over the block's bytes. Use ``free()`` or
    ``with pool.alloc(n) as blk:``. Created only by a pool.
    """

    __slots__ = ("_pool", "_arena", "_offset", "size", "nbytes", "id", "_freed", "pinned",
                 "version", "_leases", "__weakref__")

    def __init__(self, pool: "MemoryPool", arena: _Arena, offset: int, size: int, nbytes: int,
                 ident: int, pinned: bool) -> None:
        self._pool, self._arena, self._offset = pool, arena, offset
        self.size, self.nbytes, self.id = size, nbytes, ident
        self._freed = False
        self.pinned = pinned
        self.version = 0  # bumped whenever defragmentation moves the block
        # id -> weak reference, one per live view; dict set/pop are atomic, so a view
        # collected on any thread returns its lease without taking the pool's lock
        self._leases: dict[int, weakref.ref] = {}

    # ------------------------------------------------------------------ location
    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def pool(self) -> "MemoryPool":
        return self._pool

    @property
    def location(self) -> tuple[int, int]:
        """(arena id, byte offset in the arena) right now."""
        with self._pool._lock:
            self._check_live("location")
            return self._arena.id, self._offset

    @property
    def movable(self) -> bool:
        """Whether a defragmentation may move the block now: not pinned, no live view."""
        return not self.pinned and not self._leases

    def _check_live(self, what: str) -> None:
        if self._freed:
            raise MemoryError_(_OP, f"use of a freed block ({what})", "a live block",
                               f"block #{self.id} ({self.nbytes} B), already freed")

    # ------------------------------------------------------------------ views
    def view(self, offset: int, shape: Sequence[int], dtype: Any) -> Any:
        """A typed tensor of ``shape`` starting ``offset`` bytes into the block; the
        block stays in place while this tensor object is alive."""
        dt = Dtype.of(dtype)
        shape = tuple(int(s) for s in shape)
        n = math.prod(shape) * dt.itemsize
        with self._pool._lock:
            self._check_live("view")
            if offset < 0 or offset % dt.itemsize or offset + n > self.nbytes or min(shape,
                                                                                    default=0) < 0:
                raise MemoryError_(_OP, "view outside the block",
                                   f"offset % {dt.itemsize} == 0 and offset + {n} <= {self.nbytes}",
                                   f"offset {offset}, shape {list(shape)}, {dt.name}")
            start = self._arena.base + self._offset + offset
            v = self._pool.backing.view(self._arena.buf, start, shape, dt)
            # the lease: a weak reference whose callback (the view collected, on any
            # thread) takes it out of the set; added under the lock, so no
            # defragmentation sees a view without its lease
            r = weakref.ref(v, _Lease(self._leases))
            self._leases[id(r)] = r
            return v

    def tensor(self, shape: Sequence[int], dtype: Any) -> Any:
        """``view(0, shape, dtype)``."""
        return self.view(0, shape, dtype)

    def raw(self) -> Any:
        """The block's ``nbytes`` as a flat uint8 tensor."""
        return self.view(0, (self.nbytes,), Dtype.UINT8)

    # ------------------------------------------------------------------ lifetime
    def pin(self) -> "Block":
        """Never move this block in a defragmentation (views stay valid)."""
        with self._pool._lock:
            self._check_live("pin")
            self.pinned = True
        return self

    def unpin(self) -> "Block":
        with self._pool._lock:
            self._check_live("unpin")
            self.pinned = False
        return self

    def free(self) -> None:
        """Return the block to its pool. A second call raises :class:`MemoryError_`."""
        self._pool.free(self)

    def __enter__(self) -> "Block":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._freed:
            self.free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else f"arena {self._arena.id}+{self._offset}"
        return f"Block(#{self.id}, {self.nbytes} B, {state})"


def free_when_unviewed(block: Block, then: Any = None) -> None:
    """Free ``block`` once no view it handed out is alive: now if none is, else when
    the last of them is collected (its bytes must not be handed out again while a
    view can still read or write them). For an owner that is itself being
    collected, e.g. a cache nobody freed; a block already freed is left alone.
    ``then()``, if given, runs after the free."""
    if not isinstance(block, Block):
        raise ParamsError("free_when_unviewed", "block", "a pool Block", type(block).__name__)
    if then is not None and not callable(then):
        raise ParamsError("free_when_unviewed", "then", "None or a callable",
                          type(then).__name__)
    views = [v for v in (r() for r in list(block._leases.values())) if v is not None]
    left = [len(views)]

    def one_gone() -> None:
        left[0] -= 1
        if left[0] <= 0 and not block._freed:
            block.free()
            if then is not None:
                then()
    if not views:
        one_gone()
    for v in views:
        weakref.finalize(v, one_gone)
