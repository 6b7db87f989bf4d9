"""atb as MindSpore Cells: op Cells and GraphOps in PyNative, GRAPH_MODE and under
``mindspore.jit``; Parameters, checkpoints, Cell hooks, plugins; the seed's MLP
GraphOp and transformer block run as written (``forward`` spelled ``construct``)."""

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="mindspore is not installed")

import atb_mindspore as atb  # noqa: E402
from atbcore.numerics import assert_close  # noqa: E402
from atbcore.tensor import to_numpy  # noqa: E402
from ms_cases import to_ms  # noqa: E402
from oracle import rand  # noqa: E402

from mindspore import nn, ops  # noqa: E402


def _np(t):
    return to_numpy(t)


def test_op_cells_pynative_graph_mode_and_jit():
    x, w, r = rand([2, 3, 8], "fp32", 1), rand([8], "fp32", 2), rand([2, 3, 8], "fp32", 3)
    ref_y, ref_s = atb.Builder(backend="numpy").build_operation("AddRmsNorm", {"eps": 1e-6}) \
        .execute([x, r, w])
    cell = atb.ops.AddRmsNorm(eps=1e-6)
    y, s = cell(to_ms(x), to_ms(r), to_ms(w))
    assert isinstance(y, ms.Tensor) and cell.operation.last_backend == "mindspore"
    assert_close(y, ref_y, "fp32")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        yg, sg = cell(to_ms(x), to_ms(r), to_ms(w))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert_close(yg, ref_y, "fp32")
    np.testing.assert_array_equal(_np(sg), ref_s)

    soft = atb.ops.Softmax()

    def f(a):
        return soft(a) * 2.0

    got = ms.jit(f)(to_ms(x))
    want, = atb.Builder(backend="numpy").build_operation("Softmax").execute([x])
    assert_close(got, want * 2, "fp32")


def test_graph_mode_inside_a_user_cell(graph_mode):
    """A user's Cell compiled in GRAPH_MODE around atb Cells: output shapes and
    dtypes come from the core's shape inference (fp16 in, fp16 out; int64 ids)."""
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.emb = atb.ops.Embedding()
            self.norm = atb.ops.RmsNorm()
            self.w = ms.Parameter(to_ms(rand([6], "fp16", 2)), name="w")

        def construct(self, table, ids):
            return self.norm(self.emb(table, ids), self.w)

    table, ids = rand([10, 6], "fp16", 1), np.array([[3, 0, 9]], np.int64)
    out = Net()(to_ms(table), to_ms(ids))
    assert out.shape == (1, 3, 6) and out.dtype == ms.float16
    ref, = atb.Builder(backend="numpy").build_operation("RmsNorm").execute(
        [table[ids], rand([6], "fp16", 2)])
    assert_close(out, ref, "fp16")


def test_seed_mlp_graph_op_runs_as_written():
    hidden_dim, mlp_dim = 16, 48
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=mlp_dim), atb.SiLU(),
                       atb.Linear(out_features=hidden_dim), atb.ResidualAdd()])
    x = rand([2, 5, hidden_dim], "fp32", 1)
    y = mlp(to_ms(x))
    assert isinstance(y, ms.Tensor) and y.shape == (2, 5, hidden_dim)
    params = {p.name: _np(p) for p in mlp.get_parameters()}
    assert sorted(params) == [f"{mlp.name}.{n}" for n in ("0.bias", "0.weight", "1.bias",
                                                          "1.weight", "3.bias", "3.weight")]
    p = {n[len(mlp.name) + 1:]: v.astype(np.float64) for n, v in params.items()}
    h = x.astype(np.float64)
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    h = h * p["0.weight"] + p["0.bias"]
    h = h @ p["1.weight"].T + p["1.bias"]
    h = h / (1 + np.exp(-h))
    want = h @ p["3.weight"].T + p["3.bias"] + x
    assert_close(y, want.astype(np.float32), "fp32", what="seed MLP vs NumPy by hand")
    assert "FusedFeedForward" in [n.op for n in mlp.core.graph.nodes]


def test_checkpoint_round_trip_and_parameter_updates(tmp_path):
    layers = [atb.RmsNorm(eps=1e-6), atb.Linear(out_features=24, bias=False), atb.Gelu(),
              atb.Linear(out_features=8), atb.ResidualAdd()]
    block = atb.GraphOp(layers, name="mlp")
    x = to_ms(rand([3, 8], "fp32", 1))
    y = _np(block(x))
    path = str(tmp_path / "mlp.ckpt")
    ms.save_checkpoint(block, path)
    other = atb.GraphOp([atb.RmsNorm(eps=1e-6), atb.Linear("a", out_features=24, bias=False),
                         atb.Gelu(), atb.Linear("b", out_features=8), atb.ResidualAdd()], name="mlp")
    other.build(x)
    assert not np.allclose(_np(other(x)), y)          # other weights before loading
    names = {p.name for p in other.get_parameters()}
    loaded = ms.load_checkpoint(path)
    renamed = {n.replace("mlp.1.", "mlp.a.").replace("mlp.3.", "mlp.b."): v for n, v in loaded.items()}
    assert set(renamed) == names
    not_loaded, _ = ms.load_param_into_net(other, renamed)
    assert not not_loaded
    np.testing.assert_array_equal(_np(other(x)), y)   # the loaded Parameters are used
    # an in-place write is seen after refresh_weights()
    w = [p for p in other.get_parameters() if p.name == "mlp.b.bias"][0]
    ops.assign(w, w + 1.0)
    other.refresh_weights()
    np.testing.assert_allclose(_np(other(x)), y + 1.0, rtol=1e-5, atol=1e-5)


def test_standalone_layers_and_op_cell_in_a_graph_op():
    x = rand([2, 4, 8], "fp32", 1)
    fc = atb.Linear(out_features=6)
    y = fc(to_ms(x))
    wt, b = _np(fc.param("weight")), _np(fc.param("bias"))
    assert_close(y, x @ wt.T + b, "fp32")
    assert fc.param("weight").name == "linear.weight"
    block = atb.GraphOp([fc, atb.ops.Softmax(dim=-1)], name="head")
    out = block(to_ms(x))
    assert fc.param("weight").name == "head.0.weight"
    z = x @ wt.T + b
    want = np.exp(z - z.max(-1, keepdims=True))
    assert_close(out, want / want.sum(-1, keepdims=True), "fp32")


def test_cell_hooks_and_plugins():
    hidden = 16
    # conservative: no fusion, so post_mlp sits before the residual add
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=32), atb.SiLU(),
                       atb.Linear(out_features=hidden), atb.ResidualAdd()],
                      fusion_config={"fusion_level": "conservative"})
    x = to_ms(rand([2, 3, hidden], "fp32", 1))
    base = _np(mlp(x))
    seen = []
    h1 = mlp.register_forward_pre_hook(lambda cell, args: seen.append(("pre", args[0].shape)))
    h2 = mlp.register_forward_hook(lambda cell, args, out: out * 2.0)
    doubled = _np(mlp(x))
    np.testing.assert_allclose(doubled, base * 2, rtol=1e-6)
    assert seen == [("pre", (2, 3, hidden))]
    h1.remove()
    h2.remove()

    got = []

    class Scale(atb.Plugin):
        def postprocess(self, outputs):
            got.append(type(outputs[0]))
            return [o * 0.0 for o in outputs]

    mlp.register_plugin("post_mlp", Scale())
    np.testing.assert_allclose(_np(mlp(x)), _np(x), rtol=1e-6)   # MLP zeroed, residual stays
    assert got and got[0] is ms.Tensor

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.block = atb.GraphOp([atb.Linear(out_features=hidden), atb.ResidualAdd()])

        def construct(self, a):
            return self.block(a)

    net = Net()
    assert atb.register_plugin(net, "post_block", atb.HookPlugin(post=lambda ts: [t * 0 for t in ts])) == 1
    assert float(_np(net(x)).__abs__().max()) == 0.0
    with pytest.raises(atb.ParamsError):
        mlp.register_plugin("nowhere", Scale())


def test_seed_transformer_block_with_kv_cache():
    """The seed's AcceleratedTransformerBlock as a MindSpore Cell: prefill then one
    decode step with the KV cache equals running the whole sequence at once."""
    hidden_dim, num_heads, mlp_dim = 16, 2, 32

    class AcceleratedTransformerBlock(nn.Cell):
        def __init__(self, hidden_dim, num_heads, mlp_dim):
            super().__init__()
            self.attention_graph = atb.GraphOp([
                atb.LayerNorm(eps=1e-5),
                atb.FlashAttention(num_heads=num_heads, causal=True, kv_cache=True),
                atb.Linear(out_features=hidden_dim),
                atb.ResidualAdd()
            ])
            self.mlp_graph = atb.GraphOp([
                atb.LayerNorm(eps=1e-5),
                atb.Linear(out_features=mlp_dim),
                atb.SiLU(),
                atb.Linear(out_features=hidden_dim),
                atb.ResidualAdd()
            ])

        def construct(self, x, kv_cache=None):
            x, kv_cache = self.attention_graph(x, kv_cache=kv_cache)
            x = self.mlp_graph(x)
            return x, kv_cache

    blk = AcceleratedTransformerBlock(hidden_dim, num_heads, mlp_dim)
    x = rand([1, 5, hidden_dim], "fp32", 1)
    full, _ = blk(to_ms(x))
    pre, kv = blk(to_ms(x[:, :4]))
    step, kv = blk(to_ms(x[:, 4:]), kv_cache=kv)
    assert_close(pre, _np(full)[:, :4], "fp32")
    assert_close(step, _np(full)[:, 4:], "fp32")


def test_graph_mode_graph_op_with_explicit_cache_tensors(graph_mode):
    """GRAPH_MODE takes the cache tensors explicitly: a prefill in PyNative, then
    the next tokens in GRAPH_MODE with the prefill's keys/values, equal the whole
    sequence run at once."""
    blk = atb.GraphOp([atb.FlashAttention(num_heads=2, causal=True, kv_cache=True)], name="kv")
    x = rand([1, 5, 8], "fp32", 1)
    empty = to_ms(np.zeros((1, 0, 8), np.float32))
    graph_mode.set_context(mode=graph_mode.PYNATIVE_MODE)
    full, _ = blk(to_ms(x), kv_cache=(empty, empty))
    _, (pk, pv) = blk(to_ms(x[:, :2]), kv_cache=(empty, empty))
    graph_mode.set_context(mode=graph_mode.GRAPH_MODE)
    out, k2, v2 = blk(to_ms(x[:, 2:]), pk, pv)
    assert_close(out, _np(full)[:, 2:], "fp32")
    assert k2.shape == (1, 5, 8)
    with pytest.raises(atb.CapabilityError, match="kv_cache"):
        blk(to_ms(x), kv_cache=None)
    with pytest.raises(atb.CapabilityError, match="empty tensor"):
        blk(to_ms(x), empty, empty)


def test_explain_and_save_load(tmp_path):
    blk = atb.GraphOp([atb.RmsNorm(), atb.Linear(out_features=8)], name="tiny")
    x = to_ms(rand([2, 8], "fp32", 1))
    y = _np(blk(x))
    text = blk.explain()
    assert "tiny" in text and "mindspore" in text
    blk.save(str(tmp_path / "g"))
    again = atb.GraphOp.load(str(tmp_path / "g"))
    np.testing.assert_array_equal(_np(again(x)), y)
    assert {p.name for p in again.get_parameters()} >= {"tiny.linear.weight"}


def test_seed_attention_block_runs_as_written():
    """The seed's attention block with named layers, called with four tensors
    (the three extra ones are ignored with a warning), in PyNative and GRAPH_MODE."""
    hidden_dim, num_heads = 16, 2
    attention_block = atb.GraphOp([
        atb.LayerNorm("query", eps=1e-5),
        atb.Linear("qkv_proj", out_features=3 * hidden_dim),
        atb.FlashAttention("attn", num_heads=num_heads, causal=True),
        atb.Linear("out_proj", out_features=hidden_dim),
        atb.ResidualAdd("output", "input")
    ])
    query = key = value = residual = to_ms(rand([2, 5, hidden_dim], "fp32", 1))
    with pytest.warns(UserWarning, match="ignored"):
        output = attention_block(query, key, value, residual)
    prefix = attention_block.name + "."
    assert {p.name for p in attention_block.get_parameters()} == {
        prefix + n for n in ("query.weight", "query.bias", "qkv_proj.weight", "qkv_proj.bias",
                             "out_proj.weight", "out_proj.bias")}
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        again = attention_block(query, key, value, residual)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert_close(again, _np(output), "fp32")


def test_bf16_graph_op_in_pynative_vs_numpy_reference():
    def layers():
        return [atb.LayerNorm(eps=1e-5), atb.Linear(out_features=32), atb.SiLU(),
                atb.Linear(out_features=16), atb.ResidualAdd()]

    x = to_ms(rand([2, 5, 16], "bf16", 3))
    mlp, ref = atb.GraphOp(layers()), atb.GraphOp(layers(), backend="numpy").build(x)
    for a, b in zip(mlp.build(x).get_parameters(), ref.get_parameters()):
        b.set_data(a.copy())
    y = mlp(x)
    assert y.dtype == ms.bfloat16
    assert {c.backend for c in mlp.core.last_plan.calls} == {"mindspore"}
    assert_close(y, _np(ref(x)), "bf16")


def test_seed_block_with_an_atb_kv_cache_decodes_as_the_full_sequence():
    """A MindSpore GraphOp called with an atb.KVCache (written in place by the plan):
    prompt then one token per call equals the block on the whole sequence."""
    from atbcore.memory import KVCache

    blk = atb.GraphOp([atb.LayerNorm(eps=1e-5),
                       atb.FlashAttention(num_heads=4, causal=True, kv_cache=True),
                       atb.Linear(out_features=32), atb.ResidualAdd()])
    x = rand([2, 7, 32], seed=9)
    full = blk(to_ms(x))
    cache = KVCache(1, 2, 16, 4, 8, dtype="fp32")
    outs = []
    for lo, hi in ((0, 4), (4, 5), (5, 6), (6, 7)):
        y, back = blk(to_ms(x[:, lo:hi]), kv_cache=cache)
        assert back is cache
        outs.append(to_numpy(y))
    assert_close(np.concatenate(outs, axis=1), to_numpy(full), "fp32", "MindSpore KVCache decode")
    assert cache.seq_lens(layer=0)[:2].tolist() == [7, 7]
