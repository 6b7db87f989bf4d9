"""Memory: the pool (arenas, best fit, defragmentation), the process-wide pool, and the
KV caches (contiguous, paged with a block manager, prefix caching).

Importing this package imports no framework; torch is imported when a pool with a
torch backing is first created.
"""

from .config import MemoryPoolConfig
from .global_pool import get_memory_pool, init_memory_pool, memory_stats, set_memory_pool
from .naive import NaiveAllocator
from .pool import Block, MemoryPool

__all__ = [
    "MemoryPoolConfig", "MemoryPool", "Block", "NaiveAllocator", "init_memory_pool",
    "get_memory_pool", "set_memory_pool", "memory_stats",
]
