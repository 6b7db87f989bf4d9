"""Memory: the pool (arenas, best fit, defragmentation), the process-wide pool, and the
KV caches (contiguous, paged with a block manager, prefix caching).

Importing this package imports no framework; torch is imported when a pool with a
torch backing is first created.
"""

from .block_manager import BlockManager, NoFreeBlocksError
from .config import MemoryPoolConfig
from .global_pool import get_memory_pool, init_memory_pool, memory_stats, set_memory_pool
from .kv_cache import KVCache
from .naive import NaiveAllocator
from .paged import PagedBatch, PagedKVCache
from .pool import Block, MemoryPool
from .prefix import PrefixCache, block_hash

__all__ = [
    "MemoryPoolConfig", "MemoryPool", "Block", "NaiveAllocator", "init_memory_pool",
    "get_memory_pool", "set_memory_pool", "memory_stats", "KVCache", "PagedKVCache",
    "PagedBatch", "BlockManager", "NoFreeBlocksError", "PrefixCache", "block_hash",
]
