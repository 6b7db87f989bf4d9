"""What a GraphOp hands plugins at its points: typed payloads (q/k/v head-split,
positions after the cache offset, layer index, RoPE parameters, cache state), which
hook runs where (preprocess only at pre points, postprocess only at post points),
the rope point with RoPE fused into the attention, and no cost without plugins."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from atbcore.graph import layers as L
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.layers_attention import FlashAttention, FusedFeedForward, RoPE
from atbcore.memory import KVCache
from atbcore.numerics import assert_close
from atbcore.plugin import Plugin, get_plugin_manager, hookimpl
from atbcore.plugin.points import POST_POINTS, PRE_POINTS
from atbcore.plugin.rope_point import builtin_rope

H, D, HID = 2, 8, 16


def _block(layers: int = 2, base: float = 10000.0, kv_cache: bool = True) -> GraphOp:
    out = []
    for i in range(layers):
        out += [L.Linear(f"l{i}.qkv", out_features=3 * H * D, bias=False, seed=10 + i),
                RoPE(f"l{i}.rope", base=base),
                FlashAttention(f"l{i}.attn", num_heads=H, causal=True, kv_cache=kv_cache),
                L.Linear(f"l{i}.o", out_features=HID, bias=False, seed=20 + i),
                FusedFeedForward(f"l{i}.mlp", intermediate_size=32, seed=30 + i)]
    return GraphOp(out, name="blk")


class Recorder(Plugin):
    def __init__(self):
        self.calls = []

    def preprocess(self, inputs, payload):
        self.calls.append(("pre", payload))

    def postprocess(self, outputs, payload):
        self.calls.append(("post", payload))


def _x(b=2, s=5, seed=0):
    return np.random.default_rng(seed).standard_normal((b, s, HID)).astype(np.float32)


def test_pre_and_post_run_where_documented_with_attention_payloads(plugin_env):
    op, rec = _block(), Recorder()
    for point in sorted(PRE_POINTS | POST_POINTS):
        op.register_plugin(point, rec)
    x = _x()
    _, kv = op(x[:, :4], kv_cache=None)
    rec.calls.clear()
    op(x[:, 4:5], kv_cache=kv)  # one decode step after 4 cached tokens
    seen = {(kind, p.point) for kind, p in rec.calls}
    assert seen == {("pre", "pre_block"), ("pre", "pre_attention"), ("pre", "pre_mlp"),
                    ("post", "post_attention"), ("post", "post_mlp"), ("post", "post_block")}
    att = [p for kind, p in rec.calls if p.point == "pre_attention"]
    assert [p.layer for p in att] == [0, 1] and att[0].node == "blk/l0.attn"
    a = att[1]
    assert a.q.shape == (2, 1, H, D) and a.k.shape == (2, 5, H, D) and a.v.shape == (2, 5, H, D)
    assert np.asarray(a.positions).tolist() == [[4], [4]]
    assert a.cache.form == "concatenate" and a.cache.past_lengths == (4, 4)
    assert (a.rope.base, a.rope.rotary_dim, a.rope.rotary_type) == (10000.0, D, "half")
    post = [p for kind, p in rec.calls if p.point == "post_attention"][1]
    assert post.output.shape == (2, 1, H, D) and post.q is not None
    mlp = [p for kind, p in rec.calls if p.point == "pre_mlp"]
    assert [p.layer for p in mlp] == [0, 1] and mlp[0].cache.form == "concatenate"


def test_in_place_cache_payload_reads_the_cache_rows(plugin_env):
    op, rec = _block(layers=1), Recorder()
    op.register_plugin("pre_attention", rec)
    cache = KVCache(1, 2, 16, H, D, dtype="fp32")
    x = _x(s=6)
    op(x[:, :5], kv_cache=cache)
    rec.calls.clear()
    op(x[:, 5:6], kv_cache=cache)
    (_, a), = rec.calls
    assert a.cache.form == "in_place" and a.cache.past_lengths == (5, 5)
    assert np.asarray(a.positions).tolist() == [[5], [5]]
    assert a.q.shape == (2, 1, H, D) and a.k.shape == (2, 6, H, D)
    np.testing.assert_array_equal(np.asarray(a.k), np.asarray(cache.keys(0))[:2, :6])


def test_old_style_hooks_keep_working_next_to_payload_hooks(plugin_env):
    got = {}

    class Old:
        @hookimpl
        def atb_postprocess(self, point, tensors, node):
            got.setdefault("old", []).append(point)

    class New:
        @hookimpl
        def atb_preprocess(self, point, tensors, payload):
            got.setdefault("new", []).append((point, payload.layer))

    pm = get_plugin_manager()
    pm.register(Old(), name="old")
    pm.register(New(), name="new")
    op = _block(layers=1, kv_cache=False)
    op(_x())
    assert got["old"] == ["post_attention", "post_mlp", "post_block"]
    assert got["new"] == [("pre_block", None), ("pre_attention", 0), ("pre_mlp", 0)]


@pytest.mark.parametrize("late", [False, True], ids=["before first call", "after"])
def test_rope_point_with_rope_fused_into_attention(plugin_env, late):
    """Without a cache RoPE fuses into the attention; a rope plugin keeps it apart
    (registered late, the GraphOp builds again), so the plugin's rotation runs: a
    plugin rotating with base 100 equals the block built with base 100."""
    x = _x(seed=3)
    want = _block(layers=1, base=100.0, kv_cache=False)(x)
    op = _block(layers=1, kv_cache=False)
    first = op(x)
    assert "RopeFlashAttention" in [n.op for n in op.graph.nodes]
    plugin = lambda p: builtin_rope(replace(p, rope=replace(p.rope, base=100.0)))  # noqa: E731
    if not late:
        op = _block(layers=1, kv_cache=False)
    op.register_plugin("rope", plugin)
    got = op(x)
    assert "RopeFlashAttention" not in [n.op for n in op.graph.nodes]
    assert_close(got, want, "fp32", what="rope plugin")
    assert np.abs(first - want).max() > 1e-3


def test_no_plugin_means_no_hook_and_the_bound_program(plugin_env):
    pm = get_plugin_manager()  # loaded, holding no execution plugins
    assert not pm.execution_hooks_active()
    op = _block(layers=1)
    x = _x()
    op(x, kv_cache=None)
    assert not op._plugins_active()
    plain = GraphOp([L.Linear("a", out_features=HID, seed=1)], name="lin")
    plain(x)
    plain(x)
    assert plain._hot is not None  # the second call took the bound-program fast path

    class P:
        @hookimpl
        def atb_rope(self, payload):
            return None

    pm.register(P(), name="p")
    assert pm.execution_hooks_active() and op._plugins_active()
    pm.unregister(name="p")
    assert not pm.execution_hooks_active()


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("rotary_type", ["half", "interleave"])
def test_builtin_rope_through_the_point_equals_the_rope_node(plugin_env, framework, rotary_type):
    """The built-in RoPE is one implementation of the rope point: a plugin that
    answers with builtin_rope gives the RoPE node's own result, in the concatenating
    form's incremental steps too (partial rotary, half and interleaved pairs)."""
    from atbcore.tensor import from_numpy, to_numpy

    def block():
        return GraphOp([L.Linear("qkv", out_features=3 * H * D, bias=False, seed=4),
                        RoPE("rope", rotary_dim=D // 2, rotary_type=rotary_type, base=500.0),
                        FlashAttention("attn", num_heads=H, causal=True, kv_cache=True)])

    x = from_numpy(_x(s=6, seed=8), framework)
    want, _ = block()(x, kv_cache=None)
    op, calls = block(), []
    op.register_plugin("rope", lambda p: calls.append(p) or builtin_rope(p))
    _, kv = op(x[:, :4], kv_cache=None)
    step, _ = op(x[:, 4:6], kv_cache=kv)
    assert len(calls) == 2 and calls[1].rope.rotary_dim == D // 2
    assert_close(to_numpy(step), to_numpy(want)[:, 4:6], "fp32", what="builtin_rope via the point")


def test_bnsd_attention_payload_is_head_split_per_token(plugin_env):
    """A hand-built BNSD attention: the payload shows q/k/v and the output as
    [B, S, H, D] (the tensors the plugin gets stay [B, H, S, D])."""
    from atbcore.graph.builder import GraphBuilder
    from atbcore.tensor import TensorDesc

    b = GraphBuilder("bnsd")
    q, k, v = (b.add_input(n, TensorDesc([1, H, 3, D], "fp32")) for n in "qkv")
    (o,) = b.add_node("FlashAttention", [q, k, v], {"num_heads": H, "layout": "BNSD"}, name="attn")
    b.mark_output(o)
    op, rec = GraphOp(b.build()), Recorder()
    op.register_plugin("post_attention", rec)
    xs = [np.random.default_rng(i).standard_normal((1, H, 3, D)).astype(np.float32)
          for i in range(3)]
    y = op(*xs)
    (_, p), = rec.calls
    assert p.layer == 0 and p.cache.form == "none"
    np.testing.assert_array_equal(np.asarray(p.q), xs[0].transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(np.asarray(p.output), np.asarray(y).transpose(0, 2, 1, 3))
    assert np.asarray(p.positions).tolist() == [[0, 1, 2]]


def test_rope_fused_with_the_cache_write(plugin_env):
    """In the in-place cache form RoPE fuses with the cache write (RopeKVCache): the
    attention payload still names the rotation; a global rope plugin arriving late
    is refused by name; a local one rebuilds the block unfused and rotates."""
    from atbcore.errors import PluginError

    x = _x(s=5, seed=6)
    want = _block(layers=1, base=100.0)(x, kv_cache=None)[0]
    op, rec = _block(layers=1), Recorder()
    op.register_plugin("pre_attention", rec)
    op(x[:, :4], kv_cache=KVCache(1, 2, 16, H, D, dtype="fp32"))
    assert "RopeKVCache" in [n.op for n in op._in_place.graph.nodes]
    assert rec.calls[0][1].rope.base == 10000.0

    class Late:
        @hookimpl
        def atb_rope(self, payload):
            return None

    get_plugin_manager().register(Late(), name="late")
    with pytest.raises(PluginError, match="RopeKVCache"):
        op(x[:, :4], kv_cache=KVCache(1, 2, 16, H, D, dtype="fp32"))
    get_plugin_manager().unregister(name="late")

    op.register_plugin("rope", lambda p: builtin_rope(replace(p, rope=replace(p.rope, base=100.0))))
    cache = KVCache(1, 2, 16, H, D, dtype="fp32")
    first, _ = op(x[:, :4], kv_cache=cache)
    last, _ = op(x[:, 4:5], kv_cache=cache)
    assert "RopeKVCache" not in [n.op for n in op._in_place.graph.nodes]
    assert_close(np.concatenate([first, last], 1), want, "fp32", what="rope plugin, in place")
