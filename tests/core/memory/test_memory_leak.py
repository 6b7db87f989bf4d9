"""The seed article's ``check_memory_leak``: build and destroy ops, graph plans and KV
caches 100 times; the pool's allocated bytes return to their start value (and no
arena is added after the first round). A deliberately leaking loop is caught."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.graph.ir import Graph, Node
from atbcore.memory import MemoryPoolConfig, memory_stats, set_memory_pool
from atbcore.memory.kv_cache import KVCache
from atbcore.memory.paged import PagedKVCache
from atbcore.ops import get_op
from atbcore.runtime.config import get_config, init
from atbcore.runtime.executor import build_plan
from atbcore.tensor import TensorDesc


@pytest.fixture(params=["pool", "naive"])
def fresh_pool(request):
    prev_kind = get_config().allocator_type
    init(allocator_type=request.param)
    prev = set_memory_pool(None)  # the next get_memory_pool() builds one of this kind
    from atbcore.memory import init_memory_pool

    pool = init_memory_pool(MemoryPoolConfig(max_size=64 << 20, growth_factor=1.5,
                                             enable_defrag=True))
    yield pool
    set_memory_pool(prev)
    init(allocator_type=prev_kind)


def check_memory_leak(step: Callable[[int], None], rounds: int = 100) -> tuple[int, int, int]:
    """Run ``step`` ``rounds`` times; returns (allocated before, after, reserved growth
    after the first round)."""
    start = memory_stats()["allocated"]
    step(0)
    reserved_1 = memory_stats()["reserved"]
    for i in range(1, rounds):
        step(i)
    s = memory_stats()
    return start, s["allocated"], s["reserved"] - reserved_1


def _graph() -> Graph:
    p = get_op("RmsNorm").make_params({"eps": 1e-6})
    w = np.ones(64, np.float32)
    return Graph("leak", ("x",), ("z",), (Node("n0", "RmsNorm", p, ("x", "w"), ("y",)),
                                           Node("n1", "RmsNorm", p, ("y", "w"), ("z",))),
                 weights=(("w", w),))


def _one_round(i: int) -> None:
    ln = atb.Builder().build_operation("LayerNorm", {"hidden_size": 64, "dtype": atb.Dtype.FP16})
    mha = atb.Builder().build_operation("MhaV3", {"head_num": 4, "kv_head_num": 2,
                                                  "size_per_head": 16, "dtype": atb.Dtype.FP16})
    x = torch.randn(2, 64, dtype=torch.float16)
    ln.execute([x, torch.ones(64, dtype=torch.float16), torch.zeros(64, dtype=torch.float16)])
    ln.destroy()
    atb.destroy_operations([mha])

    kv = KVCache(2, 2, 32, 2, 16, "fp16")
    kv.append(0, torch.randn(2, 3, 2, 16, dtype=torch.float16),
              torch.randn(2, 3, 2, 16, dtype=torch.float16))
    kv.destroy()

    paged = PagedKVCache(2, 16, 4, 2, 16, "fp16", enable_prefix_caching=True)
    batch = paged.prepare_prefill(["a", "b"], [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7]])
    k = torch.randn(batch.num_tokens, 2, 16, dtype=torch.float16)
    paged.write(0, k, k, batch.slot_mapping)
    paged.mark_computed(["a", "b"])
    paged.destroy()

    plan = build_plan(_graph(), {"x": TensorDesc((2, 64))}, arena="always")
    assert plan.arena_block is not None  # the plan really holds pool memory
    plan.run({"x": torch.ones(2, 64)})
    plan.release()


def test_build_and_destroy_100_times_leaks_nothing(fresh_pool):
    start, end, growth = check_memory_leak(_one_round)
    assert end == start == 0
    assert growth == 0  # freed memory is reused; the pool did not keep growing
    s = fresh_pool.stats()
    assert s["alloc_count"] == s["free_count"] >= 300


def test_leak_check_catches_a_leak(fresh_pool):
    kept = []

    def leaky(i: int) -> None:
        kv = KVCache(1, 1, 8, 1, 16, "fp32")
        if i % 10 == 0:
            kept.append(kv)  # never destroyed
        else:
            kv.destroy()

    start, end, _ = check_memory_leak(leaky)
    assert end - start == 10 * 1 * 2 * 8 * 16 * 4
    for kv in kept:
        kv.destroy()
    assert memory_stats()["allocated"] == start


def test_graph_op_build_and_destroy_100_times(fresh_pool):
    from atbcore.graph.graph_op import GraphOp

    def step(i: int) -> None:
        g = GraphOp(_graph(), arena="always")
        g(torch.ones(2, 64))
        g.destroy()

    start, end, growth = check_memory_leak(step)
    assert end == start and growth == 0
