"""Bound programs: kernels bound once to arena buffers; the same bits as node-by-node
runs and the NumPy reference's values; pool exhaustion; threads; finalizers."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.graph.graph_op import GraphOp
from atbcore.graph import layers as L
from atbcore.memory import MemoryPool, MemoryPoolConfig, get_memory_pool, set_memory_pool
from atbcore.runtime.profiler import Profiler
from interp import run_graph
from llama_graphs import build_llama_layer_primitive
from oracle import rand

H, I = 64, 160



def _mlp(act="SiLU", name="mlp"):
    layer = {"SiLU": L.SiLU(), "Gelu": L.Gelu()}[act]
    return GraphOp([L.LayerNorm(eps=1e-5), L.Linear(out_features=I), layer,
                    L.Linear(out_features=H), L.ResidualAdd()], name=name)


def _unbound(op: GraphOp, xs: list) -> list:
    """The same plan run node by node through each kernel's ``fn`` (the profiled path)."""
    plan, exact = op.plan_for(xs)
    native = dict(zip(plan.graph.inputs, xs))
    return plan.run(native, descs=exact, profiler=Profiler("unbound"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_bound_mlp_is_bit_equal_to_unbound_and_matches_reference(pool, rows, dtype):
    op = _mlp()
    x = torch.from_numpy(rand([2, rows, H], seed=rows)).to(dtype)
    y = op(x)
    plan = op.last_plan
    assert all(plan.programs[next(iter(plan.programs))].bound.values())
    (u,) = _unbound(op, [x])
    assert torch.equal(y, u)
    g = op.graph_unfused  # the reference in fp32 on the same (rounded) weights
    g32 = g.replace(weights=tuple((k, np.asarray(v).astype(np.float32)) for k, v in g.weights))
    ref = run_graph(g32, [x.float().numpy()])[0]
    atb.assert_close(y.float(), ref, dtype="bf16" if dtype == torch.bfloat16 else "fp32",
                     what="bound MLP")
    # the same call again reuses the program and gives the same bits
    assert torch.equal(op(x), y) and len(plan.programs) == 1


@pytest.mark.parametrize("seq", [1, 5, 8])
def test_bound_llama_layer_matches_unbound_and_reference(pool, seq):
    g = build_llama_layer_primitive(seq=8, mask="none")
    op = GraphOp(g)
    x = torch.from_numpy(rand([2, seq, 64], seed=seq))
    y = op(x)
    (u,) = _unbound(op, [x])
    assert torch.equal(y, u)
    atb.assert_close(y, run_graph(g, [x.numpy()])[0], what=f"llama layer seq {seq}")


def test_intermediates_and_workspace_are_arena_views(pool):
    op = _mlp()
    x = torch.from_numpy(rand([1, 4, H], seed=1))
    op(x)
    plan = op.last_plan
    ws = [c for c in plan.calls if c.workspace[1]]
    assert len(ws) == 1 and ws[0].op == "FusedFeedForward"
    assert ws[0].workspace[0] is not None          # placed in the arena
    assert plan.memory.arena_bytes >= ws[0].workspace[1]
    assert ws[0].layouts == {"up_w": "32-output panels", "down_w": "32-output panels"}
    text = op.explain()
    assert "bound once" in text and "weight up_w: 32-output panels" in text
    assert "reserved" in plan.arena_note and pool.stats()["num_blocks"] == 1


def test_pool_too_small_raises_and_a_larger_pool_works():
    small = MemoryPool(MemoryPoolConfig(max_size=1 << 20))
    prev = set_memory_pool(small)
    try:
        op = GraphOp([L.LayerNorm(eps=1e-5), L.Linear(out_features=4096), L.SiLU(),
                      L.Linear(out_features=256), L.ResidualAdd()], name="big")
        x = torch.from_numpy(rand([1, 4096, 256], seed=3))  # plan needs ~100 MiB
        before = small.stats()
        with pytest.raises(atb.PoolExhaustedError):
            op(x)
        after = small.stats()
        assert after.pop("failed_allocs") == before.pop("failed_allocs") + 1
        assert after == before  # nothing reserved, nothing leaked
        atb.init_memory_pool(MemoryPoolConfig(max_size=1 << 30))
        y = op(x)
        assert op.last_plan.memory.arena_bytes > 64 << 20
        atb.assert_close(y, run_graph(op.graph_unfused, [x.numpy()])[0], what="big MLP")
    finally:
        set_memory_pool(prev)


def test_one_graph_op_from_four_threads_gives_the_serial_results(pool):
    op = _mlp()
    xs = [torch.from_numpy(rand([1, 1 + i % 5, H], seed=i)) for i in range(40)]
    serial = [op(x).clone() for x in xs]
    errors: list = []
    results: dict[tuple[int, int], torch.Tensor] = {}

    def worker(t: int) -> None:
        try:
            for rep in range(5):
                for i in range(t, len(xs), 2):
                    results[(i, rep * 4 + t)] = op(xs[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(results) == 5 * sum(len(range(t, len(xs), 2)) for t in range(4))
    bad = [k for k, y in results.items() if not torch.equal(y, serial[k[0]])]
    assert bad == []


def test_dropped_graph_op_returns_its_arenas(pool):
    op = _mlp()
    for rows in (1, 3, 9):
        op(torch.from_numpy(rand([1, rows, H], seed=rows)))
    assert len(op._cache.plans) == 3  # one plan per bucket, all in one block
    assert pool.stats()["num_blocks"] == 1
    del op
    gc.collect()
    assert pool.stats()["num_blocks"] == 0


def test_destroy_and_rebuild_after_pool_reset(pool):
    op = _mlp()
    x = torch.from_numpy(rand([1, 2, H], seed=5))
    y = op(x)
    op.destroy()
    assert pool.stats()["num_blocks"] == 0
    op2 = _mlp(name="again")
    assert op2(x).shape == y.shape


def test_numpy_inputs_run_the_bound_program_too(pool):
    op = _mlp()
    x = rand([1, 3, H], seed=9)
    y = op(x)
    assert isinstance(y, np.ndarray)
    atb.assert_close(y, run_graph(op.graph_unfused, [x])[0], what="numpy in, bound plan")
    assert get_memory_pool() is pool and pool.stats()["num_blocks"] >= 1


def test_outputs_are_checked_before_anything_is_written(pool):
    op = _mlp()
    x = rand([1, 3, H], seed=4)
    y = op(x)
    frozen = np.full_like(y, 7.0)
    frozen.flags.writeable = False
    with pytest.raises(atb.InputError, match="mlp: output 0 is read-only"):
        op.execute([x], [frozen])
    assert (frozen == 7.0).all()
    out = np.empty_like(y)
    assert op.execute([x], [out])[0] is out
    np.testing.assert_array_equal(out, y)


def test_a_reshape_no_view_can_express_copies_on_every_run(pool):
    """Reshape of a strided Split part of a planned buffer into a shape no view has
    (rows of heads across tokens): the bound program copies the current values on
    each run (one copy made at bind time would keep stale ones)."""
    from atbcore.dtypes import Dtype
    from atbcore.graph.builder import GraphBuilder
    from atbcore.tensor import TensorDesc

    rng = np.random.default_rng(0)
    b = GraphBuilder("strided_reshape")
    x = b.add_input("x", TensorDesc((6, 16), Dtype.FP32))
    y, = b.add_node("Linear", [x, b.add_weight("w", rng.standard_normal((24, 16), dtype=np.float32))])
    q, _ = b.add_node("Split", [y], {"dim": -1, "sizes": (16, 8)})
    r, = b.add_node("Reshape", [q], {"shape": (-1, 4)})          # [6, 16] of stride 24 -> [24, 4]
    n, = b.add_node("RmsNorm", [r, b.add_weight("g", np.ones(4, np.float32))], {"eps": 1e-6})
    b.mark_output(n)
    g = b.build()
    op = GraphOp(g)
    for seed in range(3):  # the first runs plan and bind, the later ones replay
        xs = torch.from_numpy(np.random.default_rng(seed).standard_normal((6, 16), dtype=np.float32))
        want = run_graph(g, [xs.numpy()])[0]
        np.testing.assert_allclose(op(xs).numpy(), want, rtol=1e-5, atol=1e-5)
