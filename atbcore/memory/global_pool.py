"""The process-wide pool: ``init_memory_pool``, ``get_memory_pool``, ``memory_stats``.

    atb.init_memory_pool(atb.MemoryPoolConfig(max_size=16 * 1024**3, growth_factor=1.5,
                                              enable_defrag=True))
    blk = get_memory_pool().alloc(1 << 20)
    memory_stats()["allocated"]

Which allocator serves is chosen by ``init(allocator_type=...)``: ``"pool"`` (default, a
:class:`MemoryPool`) or ``"naive"`` (a :class:`NaiveAllocator`). When the setting
changes, the next :func:`get_memory_pool` builds an allocator of the new kind with the
same config; blocks of the previous one stay valid and are freed into it.
"""

from __future__ import annotations

import threading
from typing import Any

from ..runtime.config import get_config
from .config import MemoryPoolConfig
from .naive import NaiveAllocator
from .pool import MemoryPool

__all__ = ["init_memory_pool", "get_memory_pool", "set_memory_pool", "memory_stats",
           "make_allocator", "ALLOCATORS", "DEFAULT_MAX_SIZE"]

ALLOCATORS: dict[str, type[MemoryPool]] = {"pool": MemoryPool, "naive": NaiveAllocator}
DEFAULT_MAX_SIZE = 8 << 30  # reserved lazily, arena by arena; only a ceiling

_lock = threading.Lock()
_pool: MemoryPool | None = None


def make_allocator(config: MemoryPoolConfig, allocator_type: str | None = None) -> MemoryPool:
    """A new allocator of ``allocator_type`` (default: the runtime config's)."""
    kind = allocator_type or get_config().allocator_type
    return ALLOCATORS[kind](config)


def init_memory_pool(config: MemoryPoolConfig | None = None, **kw: Any) -> MemoryPool:
    """Install a new process-wide pool built from ``config`` (or keywords) and return it."""
    global _pool
    cfg = config if config is not None else MemoryPoolConfig(**{"max_size": DEFAULT_MAX_SIZE,
                                                               **kw})
    pool = make_allocator(cfg)
    with _lock:
        _pool = pool
    return pool


def get_memory_pool() -> MemoryPool:
    """The process-wide pool, created lazily (cpu, ``DEFAULT_MAX_SIZE``) and rebuilt
    with the same config when ``init(allocator_type=...)`` asks for another kind."""
    global _pool
    kind = get_config().allocator_type
    with _lock:
        if _pool is None or _pool.kind != kind:
            cfg = _pool.config if _pool is not None else MemoryPoolConfig(max_size=DEFAULT_MAX_SIZE)
            _pool = make_allocator(cfg, kind)
        return _pool


def set_memory_pool(pool: MemoryPool | None) -> MemoryPool | None:
    """Swap the process-wide pool (``None`` = build a default one on next use);
    returns the previous one. Handy in tests."""
    global _pool
    with _lock:
        prev, _pool = _pool, pool
    return prev


def memory_stats() -> dict[str, Any]:
    """Statistics of the process-wide pool (see :meth:`MemoryPool.stats`)."""
    return get_memory_pool().stats()
