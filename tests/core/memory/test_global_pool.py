"""The process-wide pool: init_memory_pool, get_memory_pool, memory_stats, and the
``allocator_type`` of ``init()`` choosing the pool or the naive allocator."""

from __future__ import annotations

import pytest

from atbcore.memory import (MemoryPool, MemoryPoolConfig, NaiveAllocator, get_memory_pool,
                            init_memory_pool, memory_stats, set_memory_pool)
from atbcore.runtime.config import get_config, init


@pytest.fixture(autouse=True)
def _restore():
    prev_pool, prev_kind = set_memory_pool(None), get_config().allocator_type
    yield
    set_memory_pool(prev_pool)
    init(allocator_type=prev_kind)


def test_default_pool_is_created_lazily_and_reused():
    init(allocator_type="pool")
    pool = get_memory_pool()
    assert type(pool) is MemoryPool and get_memory_pool() is pool
    blk = pool.alloc(1000)
    s = memory_stats()
    assert s["allocated"] == 1024 and s["allocator"] == "pool"
    blk.free()
    assert memory_stats()["allocated"] == 0


def test_init_memory_pool_installs_the_seed_config():
    cfg = MemoryPoolConfig(max_size=16 * 1024**3, growth_factor=1.5, enable_defrag=True)
    pool = init_memory_pool(cfg)
    assert get_memory_pool() is pool and pool.config == cfg
    assert memory_stats()["max_size"] == 16 * 1024**3 and memory_stats()["reserved"] == 0


def test_allocator_type_selects_naive_and_back():
    init_memory_pool(MemoryPoolConfig(max_size=1 << 20, device="numpy"))
    pooled = get_memory_pool()
    keep = pooled.alloc(64)
    assert init(allocator_type="naive") == 0
    naive = get_memory_pool()
    assert isinstance(naive, NaiveAllocator) and naive.config == pooled.config
    a, b = naive.alloc(10), naive.alloc(10)
    assert memory_stats()["num_arenas"] == 2 and memory_stats()["allocator"] == "naive"
    a.free()
    b.free()
    assert memory_stats()["reserved"] == 0
    init(allocator_type="pool")
    again = get_memory_pool()
    assert type(again) is MemoryPool
    keep.free()  # a block of the earlier pool still frees into that pool
    assert pooled.stats()["allocated"] == 0
    init(allocator_type="naive")
    assert isinstance(init_memory_pool(MemoryPoolConfig(max_size=4096)), NaiveAllocator)


def test_init_memory_pool_keywords():
    pool = init_memory_pool(max_size=1 << 20, device="numpy", initial_size=4096)
    pool.alloc(10)
    assert memory_stats()["reserved"] == 4096 and memory_stats()["backing"] == "numpy"
