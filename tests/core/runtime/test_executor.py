"""Executor: plans match the NumPy reference, count launches, record dispatch and
fallbacks, free intermediates, write into arena views where a kernel can, profile."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.backends.torch import TORCH_KERNELS
from atbcore.graph.ir import Graph, Node
from atbcore.ops.registry import get_op
from atbcore.runtime.executor import build_plan
from atbcore.runtime.profiler import Profiler
from atbcore.tensor import TensorDesc
from fake_backends import installed
from oracle import rand

H = 16


def P(op, **kw):
    return get_op(op).make_params(kw)


def norm_graph(h=H) -> Graph:
    """x -> LayerNorm -> a; a -> RmsNorm -> c, a -> RmsNorm -> d; AddRmsNorm(c, d) -> z."""
    return Graph("norms", ("x",), ("z",), (
        Node("ln", "LayerNorm", P("LayerNorm"), ("x", "w", "b"), ("a",)),
        Node("rn", "RmsNorm", P("RmsNorm"), ("a", "w"), ("c",)),
        Node("rn2", "RmsNorm", P("RmsNorm", eps=1e-3), ("a", "w"), ("d",)),
        Node("arn", "AddRmsNorm", P("AddRmsNorm"), ("c", "d", "w"), ("z", "s")),
    ), weights=(("w", rand([h], seed=1) + 1), ("b", rand([h], seed=2))))


def reference(g, x):
    plan = build_plan(g, {"x": atb.TensorDesc(x.shape)}, backend="numpy")
    assert all(c.backend == "numpy" for c in plan.calls)
    return plan.run({"x": np.asarray(x)})


def test_plan_matches_numpy_reference_and_counts_launches():
    g = norm_graph()
    x = rand([2, 3, H], seed=3)
    plan = build_plan(g, {"x": TensorDesc(x.shape)})
    assert [c.backend for c in plan.calls] == ["torch"] * 4
    (z,) = plan.run({"x": torch.from_numpy(x)})
    atb.assert_close(z, reference(g, x)[0], what="norm graph")
    want = sum(TORCH_KERNELS[n.op].launches for n in g.nodes)
    assert plan.launches == want
    assert plan.calls[0].impl == TORCH_KERNELS["LayerNorm"].impl


def test_intermediates_are_dropped_at_their_last_reader():
    plan = build_plan(norm_graph(), {"x": TensorDesc((1, 2, H))})
    frees = {c.node: set(c.frees) for c in plan.calls}
    # x after ln; a after its last reader rn2; c, d after arn; s is never read.
    assert frees == {"ln": {"x"}, "rn": set(), "rn2": {"a"}, "arn": {"c", "d", "s"}}


def test_fallback_reasons_are_recorded_per_node():
    with installed("picky"):
        plan = build_plan(norm_graph(), {"x": TensorDesc((1, 2, H))})
    rows = {r["node"]: r for r in plan.nodes_table()}
    assert rows["rn"]["backend"] == "torch"
    assert rows["rn"]["fallbacks"] == [f"picky: hidden {H} is not a multiple of 128"]
    assert rows["ln"]["fallbacks"] == ["picky: no picky kernel for LayerNorm"]


def test_mixed_backends_convert_between_natives():
    g = norm_graph()
    x = rand([2, 5, H], seed=4)
    with installed("numpy_rms"):
        plan = build_plan(g, {"x": TensorDesc(x.shape)})
        assert [c.native for c in plan.calls] == ["torch", "numpy", "numpy", "torch"]
        (z,) = plan.run({"x": torch.from_numpy(x)})
    assert isinstance(z, torch.Tensor)
    assert plan.launches == 1 + 3 + 3 + TORCH_KERNELS["AddRmsNorm"].launches
    atb.assert_close(z, reference(g, x)[0], what="mixed natives")


def test_errors_name_the_graph_node():
    g = norm_graph()
    with pytest.raises(atb.ShapeError, match=r"norms/ln \(LayerNorm\)"):
        build_plan(g, {"x": TensorDesc((2, 3, H + 1))})



def test_intermediates_live_in_the_pool_arena(pool):
    g = Graph("two_ln", ("x",), ("y",), (
        Node("ln1", "LayerNorm", P("LayerNorm"), ("x", "w", "b"), ("a",)),
        Node("ln2", "LayerNorm", P("LayerNorm"), ("a", "w", "b"), ("y",)),
    ), weights=(("w", rand([H], seed=1)), ("b", rand([H], seed=2))))
    x = rand([4, H], seed=5)
    neg = Graph("two_neg", ("x",), ("y",), (
        Node("n1", "Elewise", P("Elewise", elewise_type="neg"), ("x",), ("a",)),
        Node("n2", "Elewise", P("Elewise", elewise_type="neg"), ("a",), ("y",))))
    # Elewise kernels return new tensors: the intermediate is copied into its buffer
    plan = build_plan(neg, {"x": TensorDesc(x.shape)})
    assert plan.arena_block is not None and pool.stats()["num_blocks"] == 1
    (y,) = plan.run({"x": torch.from_numpy(x)})
    np.testing.assert_array_equal(y.numpy(), x)
    a = plan.arena_block.view(plan.memory.offsets["a"], x.shape, "float32")
    np.testing.assert_array_equal(a.numpy(), -x)
    plan.release()
    assert pool.stats()["num_blocks"] == 0
    calls: list = []
    with installed("arena", calls):
        plan = build_plan(g, {"x": TensorDesc(x.shape)})
        assert pool.stats()["num_blocks"] == 1 and plan.arena_block.nbytes == 256
        (y,) = plan.run({"x": torch.from_numpy(x)})
        (y2,) = plan.run({"x": torch.from_numpy(x)})
    # ln1's output is an intermediate: a view at its planned offset; ln2's output is
    # the graph's: a fresh buffer per run, outside the arena, that the caller owns.
    base = plan.arena_block.raw().data_ptr()
    assert calls[0][0].data_ptr() == base + plan.memory.offsets["a"]
    assert not base <= calls[1][0].data_ptr() < base + plan.arena_block.nbytes
    assert y.data_ptr() != y2.data_ptr()
    atb.assert_close(y, reference(g, x)[0], what="arena-written plan")
    atb.assert_close(y2, reference(g, x)[0], what="arena-written plan, second run")
    plan.release()
    assert pool.stats()["num_blocks"] == 0


def test_arena_always_reserves_and_release_frees(pool):
    plan = build_plan(norm_graph(), {"x": TensorDesc((2, 8, H))}, arena="always")
    assert plan.arena_block is not None
    assert pool.stats()["allocated"] >= plan.memory.arena_bytes > 0
    plan.release()
    plan.release()  # idempotent
    assert pool.stats()["num_blocks"] == 0


def test_profile_exports_a_chrome_trace(tmp_path):
    g = norm_graph()
    plan = build_plan(g, {"x": TensorDesc((2, 3, H))})
    prof = Profiler("norms")
    x = torch.from_numpy(rand([2, 3, H], seed=6))
    for _ in range(2):
        plan.run({"x": x}, profiler=prof)
    path = prof.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(open(path).read())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in xs] == [n.name for n in g.nodes] * 2
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float) for e in xs)
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(xs, xs[1:]))
    assert {e["args"]["run"] for e in xs} == {0, 1}
    assert xs[-1]["args"]["launches"] == TORCH_KERNELS["AddRmsNorm"].launches and xs[0]["args"]["backend"] == "torch"
    assert prof.totals()["arn"]["calls"] == 2


def test_weights_are_converted_once_per_plan():
    seen = []

    def fetch(tid, native, device):
        seen.append((tid, native, device))
        return torch.from_numpy(np.asarray(dict(norm_graph().weights)[tid]))

    plan = build_plan(norm_graph(), {"x": TensorDesc((1, 1, H))}, weights=fetch)
    for _ in range(3):
        plan.run({"x": torch.ones(1, 1, H)})
    assert sorted(seen) == [("b", "torch", "cpu"), ("w", "torch", "cpu")]
