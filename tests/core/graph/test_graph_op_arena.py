"""One arena per GraphOp: its plans (every shape bucket) share one pool block sized
for the largest and run under one lock; growth rebinds, eviction and dropping give the
block back; a pool too small leaves everything as it was; threads mixing shapes (and
growing the arena mid-run) give the serial results."""

from __future__ import annotations

import gc
import random
import threading

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.graph.graph_op import GraphOp
from atbcore.graph import layers as L
from atbcore.memory import MemoryPool, MemoryPoolConfig, set_memory_pool
from interp import run_graph
from oracle import rand

H, I = 64, 160



def _mlp(name="mlp", **kw):
    return GraphOp([L.LayerNorm(eps=1e-5), L.Linear(out_features=I), L.SiLU(),
                    L.Linear(out_features=H), L.ResidualAdd()], name=name, **kw)


def _x(rows, seed=None):
    return torch.from_numpy(rand([1, rows, H], seed=rows if seed is None else seed))


def _aligned(n, a=64):
    return -(-n // a) * a


def test_plans_share_one_block_sized_for_the_largest(pool):
    op = _mlp()
    first = op(_x(1)).clone()
    needs = {}
    for rows in (1, 3, 9, 33, 5):  # buckets 1, 4, 16, 64, then 8 (fits, no growth)
        y = op(_x(rows))
        needs[rows] = op.last_plan.memory.arena_bytes
        atb.assert_close(y, run_graph(op.graph_unfused, [_x(rows).numpy()])[0],
                         what=f"{rows} rows")
    plans = op._cache.plans
    assert len(plans) == 5 and len({id(p.arena_block) for p in plans}) == 1
    assert len({id(p.lock) for p in plans}) == 1 and plans[0].lock is op._cache.arena.lock
    s = pool.stats()
    assert s["num_blocks"] == 1 and s["allocated"] == _aligned(max(needs.values()))
    assert op._cache.arena.stats() == {"bytes": max(needs.values()), "plans": 5, "grown": 3}
    # the grown arena freed the smaller blocks (and their emptied arenas) to the pool
    assert s["reserved"] == sum(a["size"] for a in pool.layout())
    assert "shared by the plans of mlp" in op.last_plan.arena_note
    # the first plan, rebound to the grown block, gives the same bits as before
    assert torch.equal(op(_x(1)), first)
    op.destroy()
    assert pool.stats()["num_blocks"] == 0 and pool.stats()["reserved"] == 0


def test_evicted_plans_detach_and_the_last_one_frees_the_block(pool):
    op = _mlp(max_plans=2)
    for rows in (1, 2, 3, 9):
        op(_x(rows))
    assert op._cache.stats()["evictions"] == 2
    assert op._cache.arena.stats()["plans"] == 2 and pool.stats()["num_blocks"] == 1
    del op
    gc.collect()
    assert pool.stats()["num_blocks"] == 0 and pool.stats()["reserved"] == 0


def test_a_plan_too_large_for_the_pool_changes_nothing():
    small = MemoryPool(MemoryPoolConfig(max_size=1 << 20))  # 1 MiB
    prev = set_memory_pool(small)
    try:
        op = GraphOp([L.LayerNorm(eps=1e-5), L.Linear(out_features=4096), L.SiLU(),
                      L.Linear(out_features=256), L.ResidualAdd()], name="big")
        x1 = torch.from_numpy(rand([1, 1, 256], seed=1))
        y1 = op(x1).clone()
        plan1, block = op.last_plan, op._cache.arena.block
        before = small.stats()
        big = torch.from_numpy(rand([1, 8192, 256], seed=2))  # plan needs ~256 MiB
        with pytest.raises(atb.PoolExhaustedError):
            op(big)
        after = small.stats()
        assert after.pop("failed_allocs") == before.pop("failed_allocs") + 1
        assert after == before
        assert op._cache.arena.block is block and plan1.arena_block is block
        assert torch.equal(op(x1), y1)  # the small plan still runs, same bits
    finally:
        set_memory_pool(prev)


def test_threads_mixing_shapes_while_the_arena_grows_give_the_serial_results(pool):
    reference = _mlp()
    rows = [1, 2, 3, 5, 8, 13, 21, 40, 70, 6, 17, 33]
    xs = [_x(r, seed=i) for i, r in enumerate(rows * 3)]
    serial = [reference(x).clone() for x in xs]
    op = GraphOp(reference.graph_unfused, name="mlp_threads")  # same weights, fresh plans
    errors: list = []
    results: dict[tuple[int, int], torch.Tensor] = {}
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        order = list(range(len(xs)))
        random.Random(t).shuffle(order)  # each thread meets the buckets in its own order
        try:
            start.wait()
            for rep in range(3):
                for i in order:
                    results[(i, rep * 4 + t)] = op(xs[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert len(results) == 3 * 4 * len(xs)
    bad = [k for k, y in results.items() if not torch.equal(y, serial[k[0]])]
    assert bad == []
    assert op._cache.arena.stats()["plans"] == len(op._cache.plans) >= 7
    need = max(p.memory.arena_bytes for p in op._cache.plans)
    assert op._cache.arena.nbytes == need
    np.testing.assert_equal(len({id(p.arena_block) for p in op._cache.plans}), 1)
