"""Block: a layer list used as one layer. Two blocks in one GraphOp compute what the
two GraphOps compute one after the other (NumPy reference backend and the torch
kernels), ResidualAdd inside a block adds the block's input (or a named layer of the
block), and a bad block is refused naming it."""

from __future__ import annotations

import numpy as np
import pytest

import atbcore as atb
from atbcore.errors import InputError, ParamsError
from atbcore.graph import layers as L
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.layers_block import Block, flat_layers
from atbcore.memory import KVCache

H = 16


def _attn():
    return [L.LayerNorm("ln", eps=1e-5), L.FlashAttention("attn", num_heads=4, causal=True,
                                                          kv_cache=True),
            L.Linear("o", out_features=H), L.ResidualAdd()]


def _mlp():
    return [L.LayerNorm("ln", eps=1e-5), L.Linear("up", out_features=2 * H), L.SiLU(),
            L.Linear("down", out_features=H), L.ResidualAdd("out", residual="ln")]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_blocks_in_one_graph_equal_the_graph_ops_in_turn(backend):
    a, m = _attn(), _mlp()
    x = np.random.default_rng(0).standard_normal((2, 5, H)).astype(np.float32)
    if backend == "torch":
        import torch
        x = torch.from_numpy(x)
    first, second = GraphOp(a, backend=backend), GraphOp(m, backend=backend)
    want = second(first(x))  # creates the weights
    both = GraphOp([Block("a", a), Block("m", m)], backend=backend)
    got = both(x)
    atb.assert_close(np.asarray(got), np.asarray(want), "fp32", "blocks vs graph ops in turn")
    names = {n.name for n in both.graph_unfused}
    assert {"a.ln", "a.o", "m.ln", "m.up", "m.down", "m.out"} <= names
    # the named residual is the block's own layer, not another block's "ln"
    (res,) = [n for n in both.graph_unfused if n.name == "m.out"]
    assert res.inputs[1] == "m.ln"
    assert [type(l).__name__ for l in flat_layers([Block("a", a), Block("m", m)])] == \
        [type(l).__name__ for l in (*a, *m)]


def test_blocks_with_a_kv_cache_decode_like_the_graph_ops():
    rng = np.random.default_rng(1)
    a1, a2 = _attn(), _attn()
    x = rng.standard_normal((1, 4, H)).astype(np.float32)
    c1, c2 = (KVCache(2, 1, 16, 4, H // 4, dtype="fp32") for _ in range(2))
    g1, g2 = GraphOp(a1), GraphOp(a2)
    both = GraphOp([Block("one", a1), Block("two", a2)])
    for step in (x, x[:, :1] * 0.5, x[:, 1:2]):
        y, _ = g1(step, kv_cache=c1)
        want, _ = g2(y, kv_cache=c1)
        got, _ = both(step, kv_cache=c2)
        atb.assert_close(np.asarray(got), np.asarray(want), "fp32", "blocks with a cache")
    assert c2.seq_lens().tolist() == c1.seq_lens().tolist() == [6]


def test_bad_blocks_are_refused_by_name():
    with pytest.raises(ParamsError, match="Block"):
        Block("", [L.SiLU()])
    with pytest.raises(ParamsError, match="blk"):
        Block("blk", [])
    with pytest.raises(ParamsError, match="blk.*layer 1"):
        Block("blk", [L.SiLU(), "relu"])


def test_shared_cache_layers_are_checked():
    from atbcore.graph.graph_op_kv import cache_layers, share_cache_layers

    op = GraphOp([Block("a", _attn())])
    cache = KVCache(2, 1, 8, 4, H // 4, dtype="fp32")
    x = np.zeros((1, 2, H), np.float32)
    op(x, kv_cache=cache)
    assert cache_layers(op, cache) == [0]
    share_cache_layers(op, cache, [1])
    assert cache_layers(op, cache) == [1]
    for bad in ([0, 1], [2]):
        with pytest.raises(InputError, match="KVCache layers to share"):
            share_cache_layers(op, cache, bad)
    assert cache_layers(op, cache) == [1]


def test_last_token_keeps_each_rows_last_position():
    from atbcore.graph.layers_block import LastToken

    x = np.random.default_rng(2).standard_normal((3, 5, H)).astype(np.float32)
    lin = L.Linear("head", out_features=7)
    op = GraphOp([L.RmsNorm("n", eps=1e-6), LastToken("last"), lin])
    got = np.asarray(op(x))
    full = np.asarray(GraphOp([L.RmsNorm("n", eps=1e-6), lin])(x))
    assert got.shape == (3, 1, 7)
    atb.assert_close(got, full[:, -1:], "fp32", "last token vs the last row of all")
