"""Plan cache: buckets reuse plans across sequence lengths, declared ranges are
enforced with clear errors, exact shapes are validated, LRU eviction releases plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.graph.ir import Graph, Node
from atbcore.ops.registry import get_op
from atbcore.runtime.executor import build_plan
from atbcore.runtime.plan_cache import PlanCache, bucket
from atbcore.tensor import TensorDesc
from fake_backends import installed
from oracle import rand


def P(op, **kw):
    return get_op(op).make_params(kw)


def rms_graph(h=12) -> Graph:
    return Graph("rms", ("x",), ("y",), (
        Node("n1", "RmsNorm", P("RmsNorm"), ("x", "w"), ("a",)),
        Node("n2", "RmsNorm", P("RmsNorm"), ("a", "w"), ("y",)),
    ), weights=(("w", rand([h], seed=1)),))


def cache_for(g, **kw):
    return PlanCache(lambda d, fw: build_plan(g, d, framework=fw), name=g.name, inputs=g.inputs,
                     **kw)


def x_desc(b, s, h=12):
    return {"x": TensorDesc((b, s, h))}


def test_bucket_is_the_next_power_of_two_capped():
    assert [bucket(v, None) for v in (1, 2, 3, 5, 8, 9, 1000)] == [1, 2, 4, 8, 8, 16, 1024]
    assert bucket(9, 12) == 12 and bucket(3000, 2048) == 2048


def test_sequence_lengths_in_one_bucket_share_a_plan_and_run_correctly():
    g = rms_graph()
    c = cache_for(g)
    ref = build_plan(g, x_desc(2, 8), backend="numpy")
    plans = set()
    for s in (5, 6, 7, 8, 6):
        plan, descs = c.get(x_desc(2, s))
        plans.add(id(plan))
        assert descs["a"].shape == (2, s, 12)  # exact descriptors for this call
        x = rand([2, s, 12], seed=s)
        (y,) = plan.run({"x": torch.from_numpy(x)}, descs=descs)
        want = build_plan(g, x_desc(2, s), backend="numpy").run({"x": x})[0]
        atb.assert_close(y, want, what=f"seq {s}")
    assert len(plans) == 1 and plan.descs["x"].shape == (2, 8, 12)  # planned for the bound
    assert plan.memory.sizes["a"] == 2 * 8 * 12 * 4
    assert c.stats() == {"hits": 4, "misses": 1, "plans": 1, "evictions": 0, "signatures": 4}
    c.get(x_desc(2, 9))  # next bucket (16)
    c.get(x_desc(3, 9))  # batch 3 -> bucket 4
    assert c.stats()["misses"] == 3
    del ref


def test_out_of_range_dims_raise_shape_error_naming_dim_range_and_value():
    c = cache_for(rms_graph(), dynamic_shape={"seq_len": (1, 16), "batch_size": (1, 4)})
    c.get(x_desc(4, 16))
    with pytest.raises(atb.ShapeError) as ei:
        c.get(x_desc(1, 17))
    msg = str(ei.value)
    assert "'seq_len'" in msg and "[1, 16]" in msg and "given 17" in msg and "'x' dim 1" in msg
    with pytest.raises(atb.ShapeError, match=r"'batch_size'.*\[1, 4\].*given 5"):
        c.get(x_desc(5, 3))
    c.set_dynamic_shape({"batch_size": 2})
    with pytest.raises(atb.ShapeError, match=r"'batch_size'.*expected 2.*given 3"):
        c.get(x_desc(3, 3))
    # the bucket bound never exceeds the declared max
    c.set_dynamic_shape({"seq_len": (1, 12)})
    plan, _ = c.get(x_desc(1, 9))
    assert plan.descs["x"].shape == (1, 12, 12)


def test_seed_style_entries_that_name_no_input_dim_are_accepted():
    c = cache_for(rms_graph(), dynamic_shape={"seq_len": (1, 8192), "num_heads": 32,
                                             "head_dim": 128, "hidden_size": (8, 64)})
    assert c.unused_dims(x_desc(1, 3)) == ["head_dim", "num_heads"]
    with pytest.raises(atb.ParamsError):
        c.set_dynamic_shape({"seq_len": (9, 3)})


def test_a_bucket_bound_that_is_not_a_valid_shape_falls_back_to_an_exact_plan():
    # hidden_size is declared dynamic, but the weights pin it to 12: the bound 16 is
    # not a valid shape, so the signature gets its own exact plan.
    g = rms_graph(12)
    c = cache_for(g, dynamic_shape={"hidden_size": (8, 64)})
    plan, descs = c.get(x_desc(1, 3))
    assert plan.descs["x"].shape == (1, 3, 12) and descs["y"].shape == (1, 3, 12)
    assert c.get(x_desc(1, 3))[0] is plan and c.stats()["misses"] == 1
    with pytest.raises(atb.ShapeError, match=r"rms/n1 \(RmsNorm\)"):
        c.get(x_desc(1, 3, 13))  # a real mismatch still fails, naming the node


def test_exact_shapes_a_kernel_refuses_get_their_own_plan():
    g = rms_graph()
    with installed("even"):
        c = cache_for(g)
        p8, _ = c.get(x_desc(1, 8))  # bucket bound 8: the 'even' kernel takes it
        assert [k.backend for k in p8.calls] == ["even", "even"]
        p6, _ = c.get(x_desc(1, 6))
        assert p6 is p8
        p5, d5 = c.get(x_desc(1, 5))  # same bucket, but 5 rows is odd
        assert p5 is not p8 and [k.backend for k in p5.calls] == ["torch", "torch"]
        (y,) = p5.run({"x": torch.ones(1, 5, 12)}, descs=d5)
    assert c.stats()["misses"] == 2 and y.shape == (1, 5, 12)


def test_lru_eviction_releases_plans_and_forgets_their_signatures():
    c = cache_for(rms_graph(), max_plans=2)
    released = []
    first, _ = c.get(x_desc(1, 1))
    first.release = lambda: released.append(1)
    c.get(x_desc(1, 2))
    c.get(x_desc(1, 4))
    assert released == [1] and c.stats()["evictions"] == 1 and c.stats()["plans"] == 2
    again, _ = c.get(x_desc(1, 1))
    assert again is not first and c.stats()["misses"] == 4


def test_declared_dim_names_override_the_convention():
    g = Graph("tok", ("x",), ("y",), (Node("n", "RmsNorm", P("RmsNorm"), ("x", "w"), ("y",)),),
              weights=(("w", np.ones(12, np.float32)),))
    c = cache_for(g, dim_names={"x": ("seq_len", None)})
    assert c.get({"x": TensorDesc((5, 12))})[0] is c.get({"x": TensorDesc((7, 12))})[0]
    plain = cache_for(g)  # rank-2 float input: no named dims, one plan per shape
    assert plain.get({"x": TensorDesc((5, 12))})[0] is not plain.get({"x": TensorDesc((7, 12))})[0]
    with pytest.raises(atb.ShapeError, match="dim_names"):
        cache_for(g, dim_names={"x": ("seq_len",)}).get({"x": TensorDesc((5, 12))})
