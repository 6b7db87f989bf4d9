"""The pool gives empty arenas back: ``release_threshold`` on every free, ``trim(keep)``
on demand; statistics count what went back; on the CPU the memory leaves the process."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import atbcore as atb
from atbcore.memory import MemoryPool, MemoryPoolConfig, NaiveAllocator


def make(**kw) -> MemoryPool:
    kw.setdefault("max_size", 1 << 20)
    kw.setdefault("initial_size", 4096)
    kw.setdefault("growth_factor", 1.0)
    return MemoryPool(MemoryPoolConfig(device="numpy", **kw))


def test_an_emptied_arena_goes_back_at_once_by_default():
    pool = make()
    a, b = pool.alloc(4096), pool.alloc(4096)  # one arena each
    c = pool.alloc(1024)                       # a third arena, shared below
    d = pool.alloc(1024)
    assert pool.stats()["num_arenas"] == 3 and pool.stats()["reserved"] == 3 * 4096
    c.free()  # its arena still holds d: kept, the hole reused later
    assert pool.stats()["reserved"] == 3 * 4096 and pool.stats()["release_count"] == 0
    a.free()
    s = pool.stats()
    assert (s["reserved"], s["num_arenas"], s["released_bytes"], s["release_count"]) == \
        (2 * 4096, 2, 4096, 1)
    assert s["release_threshold"] == 0 and s["allocated"] == 4096 + 1024
    b.free()
    d.free()
    s = pool.stats()
    assert (s["reserved"], s["num_arenas"], s["released_bytes"], s["release_count"]) == \
        (0, 0, 3 * 4096, 3)
    e = pool.alloc(2048)  # serves again from a new arena
    assert pool.stats()["reserved"] == 4096 and e.nbytes == 2048


def test_release_threshold_keeps_that_many_empty_bytes_giving_the_largest_back():
    pool = make(initial_size=4096, growth_factor=2.0, release_threshold=8192)
    blocks = [pool.alloc(4096), pool.alloc(8192), pool.alloc(16384)]  # arenas 4K, 8K, 16K
    blocks[0].free()
    blocks[1].free()  # 12 KiB empty > 8 KiB: the 8 KiB arena goes, the 4 KiB one stays
    s = pool.stats()
    assert s["reserved"] == 4096 + 16384 and s["released_bytes"] == 8192
    assert sorted(a["size"] for a in pool.layout()) == [4096, 16384]
    blocks[2].free()  # 20 KiB empty: the 16 KiB arena goes
    assert pool.stats()["reserved"] == 4096 and pool.stats()["released_bytes"] == 8192 + 16384
    x = pool.alloc(4000)  # the kept arena serves without growing
    assert pool.stats()["num_arenas"] == 1 and x.location[1] == 0


def test_no_threshold_keeps_arenas_until_trim():
    pool = make(release_threshold=None)
    blocks = [pool.alloc(4096) for _ in range(3)]
    for b in blocks:
        b.free()
    assert pool.stats()["reserved"] == 3 * 4096 and pool.stats()["release_count"] == 0
    live = pool.alloc(4096)  # lands in a kept arena
    assert pool.trim(keep=4096) == 4096          # one empty arena may stay
    assert pool.stats()["reserved"] == 2 * 4096
    assert pool.trim() == 4096 and pool.stats()["reserved"] == 4096
    assert pool.trim() == 0                      # the live block's arena never goes
    np.testing.assert_array_equal(live.tensor((8,), "float32").shape, (8,))
    assert pool.stats()["release_count"] == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0"])
def test_bad_release_threshold_is_a_params_error(bad):
    with pytest.raises(atb.ParamsError, match="release_threshold"):
        MemoryPoolConfig(max_size=1 << 20, release_threshold=bad)


def test_naive_allocator_counts_what_it_gives_back():
    pool = NaiveAllocator(MemoryPoolConfig(max_size=1 << 20, device="numpy"))
    a, b = pool.alloc(128), pool.alloc(1024)
    a.free()
    b.free()
    s = pool.stats()
    assert (s["reserved"], s["released_bytes"], s["release_count"]) == (0, 128 + 1024, 2)


def _rss_mib() -> float:
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_cpu_arena_memory_leaves_the_process_when_released():
    torch = pytest.importorskip("torch")
    pool = MemoryPool(MemoryPoolConfig(max_size=1 << 30, device="cpu"))
    r0 = _rss_mib()
    blk = pool.alloc(128 << 20)
    t = blk.tensor((128 << 20,), "uint8")
    t.fill_(7)  # touch every page
    assert int(t[-1]) == 7
    r1 = _rss_mib()
    assert r1 - r0 > 100, (r0, r1)
    del t
    blk.free()
    r2 = _rss_mib()
    assert r1 - r2 > 100, (r0, r1, r2)
    assert pool.stats()["reserved"] == 0 and pool.stats()["released_bytes"] >= 128 << 20
    del torch
