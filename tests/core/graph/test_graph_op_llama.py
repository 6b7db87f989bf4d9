"""Acceptance: a LLaMA decoder layer built from primitive ops (llama_graphs.py) runs at
``standard`` fusion as RmsNorm -> merged QKV Linear -> RopeFlashAttention -> Linear ->
AddRmsNorm -> FusedFeedForward, equals the unfused graph within tolerance, launches
far fewer kernels per forward, and its memory plan reuses the arena."""

from __future__ import annotations

import numpy as np
import pytest

from atbcore.runtime.planner import _best_fit

import atbcore as atb
from atbcore.backends.torch import TORCH_KERNELS
from atbcore.graph.graph_op import GraphOp
from interp import run_graph
from llama_graphs import build_llama_layer_primitive, fused_ops
from oracle import rand


def _pair(dtype="fp32", **kw):
    g = build_llama_layer_primitive(dtype=dtype, **kw)
    return g, GraphOp(g, name="llama"), GraphOp(g, name="llama_unfused",
                                                 fusion_config={"fusion_level": "conservative"})


@pytest.mark.parametrize("dtype", ["fp32"])
def test_fused_layer_equals_unfused(dtype):
    # fp32 only: an unfused fp16 graph rounds after every primitive op (~30 roundings),
    # so it is the less accurate side and not a fair golden at fp16 tolerance.
    g, fused, unfused = _pair(dtype)
    x = rand([2, 8, 64], dtype, seed=1)
    y = fused(x)
    assert [n.op for n in fused.graph.nodes] == fused_ops()
    atb.assert_close(y, unfused(x), what=f"fused vs unfused ({dtype})")
    # and against the NumPy reference run of the primitive graph (float64 inside)
    atb.assert_close(y, run_graph(g, [x])[0], what=f"fused vs numpy reference ({dtype})")


def _launches():
    g, fused, unfused = _pair()
    x = rand([2, 8, 64], seed=2)
    fused(x)
    unfused(x)
    return fused, unfused


def _declared(op, n, descs):
    """Node ``n``'s declared launches: its kernel's ``launches_for`` at the node's input
    shapes where it has one (the FFN: two C calls when the gate|up matmul applies the
    activation), else ``launches``."""
    from atbcore.graph.analysis import bind_ids
    from atbcore.ops.registry import get_op

    k = TORCH_KERNELS[n.op]
    if k.launches_for is None:
        return k.launches
    ids = bind_ids(get_op(n.op), n, descs)
    return k.launches_for(n.params, {name: tuple(descs[v].shape) for name, v in ids.items()
                                     if isinstance(v, str) and v in descs})


def test_launches_are_the_sum_of_the_chosen_kernels_and_drop_by_more_than_half():
    from atbcore.graph.analysis import infer_descs

    fused, unfused = _launches()
    for op in (fused, unfused):
        descs = infer_descs(op.graph, partial=True)
        assert op.last_launches == sum(_declared(op, n, descs) for n in op.graph.nodes)
    # Measured: 13 fused (RmsNorm 1, Linear 1, RopeFlashAttention 3, Linear 1,
    # AddRmsNorm 2, FusedFeedForward 5) vs 34 unfused.
    assert fused.last_launches * 2 < unfused.last_launches


def test_launches_drop_by_at_least_70_percent():
    fused, unfused = _launches()
    assert fused.last_launches <= 0.3 * unfused.last_launches


def test_the_arena_reuses_memory_across_intermediates():
    fused, unfused = _launches()
    # the fused graph has three tensors left (qkv, attention, o_proj's sum), and the
    # first and last can share bytes: reuse >= 1.2x
    for op, reuse in ((fused, 1.2), (unfused, 2.0)):
        m = op.memory_plan
        assert m.total_intermediate_bytes > 0
        # the graph's tensors alone: a kernel's workspace is live for its node only
        tensors = {t: b for t, b in m.sizes.items() if not t.endswith("#workspace")}
        replan = _best_fit(tensors, {t: m.intervals[t] for t in tensors})
        arena = max(replan[t] + tensors[t] for t in tensors)
        assert reuse * arena <= sum(tensors.values()), (op.name, m.summary())
        assert m.arena_bytes <= sum(m.sizes.values())
    # every intermediate of the fused plan is in the arena or aliases one that is
    m = fused.memory_plan
    produced = {t for n in fused.graph.nodes for t in n.outputs} - set(fused.graph.outputs)
    assert all(m.offset_of(t) is not None for t in produced)


def test_one_plan_serves_a_range_of_sequence_lengths():
    g = build_llama_layer_primitive(seq=8, mask="none")
    op = GraphOp(g)
    for s in (5, 6, 7, 8):
        x = rand([2, s, 64], seed=s)
        atb.assert_close(op(x), run_graph(g, [x])[0], what=f"seq {s}")
    assert op.cache_stats()["plans"] == 1 and op.cache_stats()["hits"] == 3


def test_primitive_builder_refuses_bad_arguments():
    from atbcore.graph.primitives import llama_layer_primitive
    from llama_graphs import llama_weights

    w = llama_weights()
    with pytest.raises(atb.InputError, match="missing"):
        llama_layer_primitive({k: v for k, v in w.items() if "down" not in k}, batch=1, seq=4,
                              heads=4)
    with pytest.raises(atb.ParamsError, match="heads"):
        llama_layer_primitive(w, batch=1, seq=4, heads=5)
    with pytest.raises(atb.ShapeError, match="mask"):
        llama_layer_primitive(w, batch=1, seq=4, heads=4, mask=np.zeros((3, 3)))
