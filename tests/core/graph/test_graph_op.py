"""GraphOp on hand-built graphs: any framework in and out, execute into outputs,
infer_shape, plan cache through the GraphOp, plugins at their points, explain,
profiling, destroy/with."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.graph_op_explain import plugin_points
from atbcore.graph.ir import Graph, Node
from atbcore.memory import MemoryPool, MemoryPoolConfig, set_memory_pool
from atbcore.ops.base import Params
from atbcore.ops.registry import get_op
from atbcore.plugin import Plugin
from atbcore.runtime.executor import build_plan
from atbcore.tensor import TensorDesc
from oracle import rand

B, S, H, NH = 2, 5, 32, 4


def P(op, **kw):
    return get_op(op).make_params(kw)


def attention_block() -> Graph:
    """LayerNorm -> packed QKV Linear -> causal FlashAttention -> out Linear ->
    AddRmsNorm with the block input (returns the normed sum and the sum)."""
    return Graph("attn", ("x",), ("y", "sum"), (
        Node("ln", "LayerNorm", P("LayerNorm", eps=1e-5), ("x", "ln_w", "ln_b"), ("h",)),
        Node("qkv", "Linear", P("Linear"), ("h", "w_qkv"), ("qkv",)),
        Node("attn", "FlashAttention", P("FlashAttention", num_heads=NH, causal=True),
             ("qkv",), ("ctx",)),
        Node("out", "Linear", P("Linear"), ("ctx", "w_o", "b_o"), ("o",)),
        Node("res", "AddRmsNorm", P("AddRmsNorm"), ("o", "x", "n_w"), ("y", "sum")),
    ), weights=(("ln_w", rand([H], seed=1) + 1), ("ln_b", rand([H], seed=2)),
                ("w_qkv", rand([3 * H, H], seed=3, scale=0.2)),
                ("w_o", rand([H, H], seed=4, scale=0.2)), ("b_o", rand([H], seed=5)),
                ("n_w", rand([H], seed=6) + 1)))


def reference(g, *xs):
    descs = {i: TensorDesc(x.shape) for i, x in zip(g.inputs, xs)}
    return build_plan(g, descs, backend="numpy").run(dict(zip(g.inputs, xs)))


@pytest.fixture
def op():
    with GraphOp(attention_block(), fusion_config={"fusion_level": "conservative"}) as o:
        yield o


def test_runs_numpy_and_torch_and_matches_the_reference(op):
    x = rand([B, S, H], seed=7)
    y, s = op(x)
    assert isinstance(y, np.ndarray) and y.shape == (B, S, H)
    ref = reference(op.graph, x)
    atb.assert_close(y, ref[0], what="attention block y")
    atb.assert_close(s, ref[1], what="attention block sum")
    yt, _ = op(torch.from_numpy(x))
    assert isinstance(yt, torch.Tensor)
    atb.assert_close(yt, ref[0], what="torch in/out")
    assert op.last_launches == op.last_plan.launches > 0


def test_execute_into_outputs_and_failed_calls_leave_them_untouched(op):
    x = rand([B, S, H], seed=8)
    outs = [np.zeros((B, S, H), np.float32), TensorDesc((B, S, H))]
    res = op.execute([x], outs)
    assert res is outs and isinstance(outs[1], np.ndarray)
    atb.assert_close(outs[0], reference(op.graph, x)[0], what="written output")
    keep = np.full((B, S, H), 7.0, np.float32)
    with pytest.raises(atb.ShapeError, match="output 1 shape"):
        op.execute([x], [keep, np.zeros((B, S, H + 1), np.float32)])
    assert (keep == 7.0).all()
    with pytest.raises(atb.InputError, match="number of inputs"):
        op.execute([x, x])


def test_infer_shape_and_cache_reuse_across_sequence_lengths(op):
    assert op.infer_shape([TensorDesc((3, 11, H))]) == [TensorDesc((3, 11, H))] * 2
    for s in (5, 6, 7, 8):
        x = rand([1, s, H], seed=s)
        atb.assert_close(op(x)[0], reference(op.graph, x)[0], what=f"seq {s}")
    st = op.cache_stats()
    assert st["misses"] == 1 and st["hits"] == 3
    op.set_dynamic_shape({"seq_len": (1, 8)})
    with pytest.raises(atb.ShapeError, match=r"'seq_len'.*\[1, 8\].*given 9"):
        op(rand([1, 9, H]))
    with pytest.raises(atb.ShapeError, match=r"'seq_len'.*given 9"):
        op.infer_shape([TensorDesc((1, 9, H))])


class Scale(Plugin):
    def __init__(self, k, pre=True):
        self.k, self.calls = k, []

    def preprocess(self, inputs):
        self.calls.append([tuple(t.shape) for t in inputs])
        return [t * self.k for t in inputs]

    def postprocess(self, outputs):
        self.calls.append([tuple(t.shape) for t in outputs])
        return [t * self.k for t in outputs]


def test_block_points_wrap_inputs_and_outputs(op):
    x = rand([B, S, H], seed=9)
    plain = op(2 * x)
    op.register_plugin("pre_block", Scale(2))
    post = Scale(-1)
    op.register_plugin("post_block", post)
    y, s = op(x)
    atb.assert_close(y, -plain[0], what="pre/post block")
    atb.assert_close(s, -plain[1], what="pre/post block sum")
    assert post.calls == [[(B, S, H), (B, S, H)]]


@pytest.mark.parametrize("point", ["pre_attention", "post_attention"])
def test_attention_points_see_the_attention_activations(op, point):
    # Zeroing attention's input (packed qkv) or output zeroes the out-projection's
    # input, so the block reduces to RmsNorm(b_o + x).
    x = rand([B, S, H], seed=10)
    plug = Scale(0)
    op.register_plugin(point, plug)
    y, _ = op(x)
    want = reference(Graph("r", ("x",), ("y",), (
        Node("r", "RmsNorm", P("RmsNorm"), ("x", "n_w"), ("y",)),),
        weights=op.graph.weights), x + op.graph.weight_map["b_o"])[0]
    atb.assert_close(y, want, what=point)
    shape = (B, S, 3 * H) if point == "pre_attention" else (B, S, H)
    assert plug.calls == [[shape]]  # activations only: no weights


def test_plugin_points_placement_rules():
    p = Params()
    g = Graph("mlp", ("x",), ("y",), (
        Node("ln", "LayerNorm", p, ("x",), ("h",)),
        Node("up", "Linear", p, ("h", "w1"), ("u",)),
        Node("act", "SiLU", p, ("u",), ("a",)),
        Node("down", "Linear", p, ("a", "w2"), ("d",)),
        Node("res", "ResidualAdd", p, ("d", "x"), ("y",))))
    assert plugin_points(g) == {"up": ("pre_mlp", None), "down": (None, "post_mlp")}
    g2 = Graph("blk", ("x",), ("y",), (
        Node("fa", "FlashAttention", p, ("x",), ("a",)),
        Node("ffn", "FusedFeedForward", p, ("a",), ("y",))))
    assert plugin_points(g2) == {"fa": ("pre_attention", "post_attention"),
                                 "ffn": ("pre_mlp", "post_mlp")}
    with pytest.raises(atb.ParamsError, match="plugin point"):
        GraphOp(g2).register_plugin("middle", Scale(1))


def test_explain_lists_kernels_launches_arena_and_cache(op):
    op(rand([B, S, H], seed=11))
    text = op.explain()
    for frag in ("Before fusion: 5 nodes", "After fusion", "attn: FlashAttention -> torch",
                 f"Launches per run: {op.last_plan.launches}", "Memory: arena",
                 "Plan cache: 0 hits, 1 misses", "attn[pre_attention/post_attention]"):
        assert frag in text, frag
    assert GraphOp(attention_block()).explain().endswith(
        "not built yet: call it once, or explain(*inputs) with tensors or TensorDescs")


def test_profile_trace_through_the_graph_op(tmp_path):
    with GraphOp(attention_block(), profile=True) as op:
        op(rand([B, S, H], seed=12))
        trace = json.load(open(op.export_trace(tmp_path / "t.json")))
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert names == [n.name for n in op.graph.nodes]


def test_fusion_config_dict_accepts_seed_keys_and_rejects_unknown():
    op = GraphOp(attention_block(), fusion_config={"fusion_level": "standard",
                                                   "memory_optimization": "flash"})
    assert op.fusion_config.fusion_level == "standard"
    assert op.fusion_extra == {"memory_optimization": "flash"}
    with pytest.raises(atb.ParamsError, match="unknown fusion_config key 'fuse_everything'"):
        GraphOp(attention_block(), fusion_config={"fuse_everything": True})


def test_kv_cache_is_returned_alongside_the_output(op):
    x = rand([B, S, H], seed=13)
    (y, _), cache = op(x, kv_cache="cache")
    assert cache == "cache" and y.shape == (B, S, H)


def test_destroy_frees_the_arena_and_blocks_further_calls():
    pool = MemoryPool(MemoryPoolConfig(max_size=1 << 24))
    prev = set_memory_pool(pool)
    try:
        with GraphOp(attention_block(), arena="always") as op:
            op(rand([B, S, H], seed=14))
            assert pool.stats()["num_blocks"] == 1
            assert pool.stats()["allocated"] >= op.memory_plan.arena_bytes > 0
        assert pool.stats()["num_blocks"] == 0
        with pytest.raises(atb.AtbError, match="destroyed"):
            op(rand([B, S, H]))
    finally:
        set_memory_pool(prev)


def test_global_preprocess_hooks_run_at_graph_op_points(op):
    from atbcore.plugin import get_plugin_manager, hookimpl

    seen = []

    class Doubler:
        @hookimpl
        def atb_preprocess(self, point, tensors, node):
            seen.append((point, node))
            return [t * 2 for t in tensors] if point == "pre_block" else None

    x = rand([B, S, H], seed=15)
    plain = op(2 * x)
    pm = get_plugin_manager()
    plugin = Doubler()
    pm.register(plugin, name="test_doubler")
    try:
        y, _ = op(x)
    finally:
        pm.unregister(plugin)
    atb.assert_close(y, plain[0], what="global pre_block hook")
    assert ("pre_block", "attn") in seen and ("pre_attention", "attn/attn") in seen
    op(x)
    assert len(seen) == 2  # unregistered: no hooks, plain plan path again
