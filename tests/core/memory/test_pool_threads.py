"""MemoryPool(enable_defrag=True) from 4 threads: alloc / write / check / free with
defragmentation running inside failing allocations, and no block loses a byte.

The pool is kept small so allocations fail often and compact the arenas while the
other threads hold views they are writing through. ``stress`` is also the measuring
tool: ``python tests/core/memory/test_pool_threads.py 100000``.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from atbcore.dtypes import Dtype
from atbcore.errors import PoolExhaustedError
from atbcore.memory.config import MemoryPoolConfig
from atbcore.memory.pool import MemoryPool
from atbcore.tensor import to_numpy


def stress(device: str, ops: int, threads: int = 4) -> dict[str, int]:
    """Run ``ops`` alloc/write/check/free operations over ``threads`` threads; returns
    counts (``lost``: blocks whose contents differed from what their thread wrote)."""
    pool = MemoryPool(MemoryPoolConfig(device=device, max_size=1 << 13, initial_size=1 << 11,
                                       growth_factor=1.0, enable_defrag=True))
    counts = {"ops": 0, "checked": 0, "lost": 0, "refused": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int, n_ops: int) -> None:
        rng = np.random.default_rng(seed)
        mine: list = []  # (block, view, value): views held while other threads allocate
        local = {"ops": 0, "checked": 0, "lost": 0, "refused": 0}

        def check_and_free(blk, view, value) -> None:
            again = to_numpy(blk.tensor((blk.nbytes // 4,), Dtype.FP32))
            ok = bool((to_numpy(view) == value).all() and (again == value).all())
            local["checked"] += 1
            local["lost"] += not ok
            del again
            blk.free()

        try:
            for _ in range(n_ops):
                local["ops"] += 1
                if mine and (len(mine) >= 6 or rng.random() < 0.4):
                    check_and_free(*mine.pop(int(rng.integers(len(mine)))))
                    continue
                try:
                    blk = pool.alloc(int(rng.integers(1, 160)) * 4)
                except PoolExhaustedError:
                    local["refused"] += 1
                    continue
                view = blk.tensor((blk.nbytes // 4,), Dtype.FP32)
                value = float(rng.integers(1, 1 << 20))
                to_numpy(view)[:] = value  # write through the view, as a user would
                mine.append((blk, view, value))
            while mine:
                check_and_free(*mine.pop())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
        with lock:
            for k, v in local.items():
                counts[k] += v

    per = ops // threads
    ts = [threading.Thread(target=worker, args=(s, per)) for s in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    s = pool.stats()
    counts.update(defrags=s["defrag_count"], live_after=s["num_blocks"])
    return counts


@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_four_threads_with_defragmentation_lose_nothing(device):
    res = stress(device, 10_000)
    assert res["lost"] == 0, res
    assert res["checked"] > 2_000 and res["defrags"] > 0, res  # the race was exercised
    assert res["live_after"] == 0


def test_a_live_view_keeps_its_block_in_place():
    pool = MemoryPool(MemoryPoolConfig(device="numpy", max_size=8192, initial_size=8192))
    a, b = pool.alloc(4096), pool.alloc(4096)
    view = b.tensor((1024,), Dtype.FP32)
    view[:] = 3.0
    a.free()
    assert not b.movable
    assert pool.defragment()["moved_blocks"] == 0 and b.location[1] == 4096
    del view                                    # the lease goes with the view
    assert b.movable
    assert pool.defragment()["moved_blocks"] == 1 and b.location[1] == 0
    assert (to_numpy(b.tensor((1024,), Dtype.FP32)) == 3.0).all()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    for dev in ("numpy", "cpu"):
        print(dev, stress(dev, n))
