"""atb_paddle layers: every op and seed-style layer is a paddle.nn.Layer; seed
layers own Paddle parameters (state_dict round-trips, set_state_dict / in-place
writes reach the graphs), match Paddle's own layers, and share memory with the
graph weights; op layers match the NumPy reference."""

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import atbcore as atb  # noqa: E402
from atbcore.ops import list_operations  # noqa: E402
from oracle import rand  # noqa: E402
from paddle_cases import to_paddle  # noqa: E402

import atb_paddle  # noqa: E402


def _np(t):
    return atb.tensor.to_numpy(t)


def test_every_op_and_seed_layer_is_a_paddle_layer():
    for name in list(list_operations()) + ["GraphOp", "SelfAttention", "MhaV2", "MhaV3",
                                           "LayerNorm", "Linear", "SiLU", "ResidualAdd", "RoPE"]:
        cls = getattr(atb_paddle, name)
        assert issubclass(cls, paddle.nn.Layer), name
        assert name in atb_paddle.__all__
    for name in list_operations():
        assert issubclass(getattr(atb_paddle.ops, name), atb_paddle.OpLayer)
    assert atb_paddle.MhaV3 is atb_paddle.FlashAttention
    assert issubclass(atb_paddle.LayerNorm, atb_paddle.AtbLayer)
    assert atb_paddle.DtypeError is atb.DtypeError        # the core API re-exported


def test_layer_norm_and_linear_match_paddle_layers():
    x = to_paddle(rand((2, 5, 24), "fp32", 1))
    ln = atb_paddle.LayerNorm(eps=1e-5)
    y = ln(x)
    ref = paddle.nn.LayerNorm(24, epsilon=1e-5)
    with paddle.no_grad():
        ref.weight.set_value(paddle.to_tensor(rand((24,), "fp32", 2)))
        ref.bias.set_value(paddle.to_tensor(rand((24,), "fp32", 3)))
    ln.set_state_dict({"weight": ref.weight, "bias": ref.bias})
    atb.assert_close(ln(x), ref(x), "fp32", "LayerNorm vs paddle.nn.LayerNorm")
    assert y.shape == x.shape
    lin = atb_paddle.Linear(out_features=16)
    out = lin(x)
    assert list(out.shape) == [2, 5, 16] and sorted(lin.state_dict()) == ["bias", "weight"]
    plin = paddle.nn.Linear(24, 16)                     # Paddle's weight is [in, out]
    plin.weight.set_value(lin.weight.T)
    plin.bias.set_value(lin.bias)
    atb.assert_close(out, plin(x), "fp32", "Linear vs paddle.nn.Linear")


def test_op_layers_match_the_reference():
    a, b = rand((2, 3, 8), "fp32", 1), rand((5, 8), "fp32", 2)
    y = atb_paddle.MatMul(transpose_b=True)(to_paddle(a), to_paddle(b))
    assert isinstance(y, paddle.Tensor)
    atb.assert_close(y, a.astype(np.float64) @ b.T.astype(np.float64), "fp32", "MatMul layer")
    x, r, w = rand((2, 8), "bf16", 3), rand((2, 8), "bf16", 4), rand((8,), "bf16", 5)
    out, s = atb_paddle.AddRmsNorm(eps=1e-6)(to_paddle(x), to_paddle(r), to_paddle(w))
    ref, ref_s = atb.Builder(backend="numpy").build_operation("AddRmsNorm", {"eps": 1e-6}).execute([x, r, w])
    atb.assert_close(out, ref, "bf16", "AddRmsNorm layer")
    np.testing.assert_array_equal(_np(s), ref_s)
    q, k = to_paddle(rand((1, 4, 32), "fp32", 6)), to_paddle(rand((1, 4, 16), "fp32", 7))
    attn = atb_paddle.ops.FlashAttention(num_heads=2, num_kv_heads=1, causal=True)
    ref, = atb.Builder(backend="numpy").build_operation(
        "FlashAttention", {"num_heads": 2, "num_kv_heads": 1, "causal": True}).execute(
        [_np(q), _np(k), _np(k)])
    atb.assert_close(attn(q, k, k), ref, "fp32", "ops.FlashAttention")
    outs = atb_paddle.ops.Split(dim=-1, num=2).execute([q])
    assert len(outs) == 2 and list(outs[1].shape) == [1, 4, 16]


def test_state_dict_round_trip_through_paddle_save(tmp_path):
    x = to_paddle(rand((2, 3, 16), "fp32", 1))
    blk = atb_paddle.GraphOp([atb_paddle.RmsNorm(eps=1e-6), atb_paddle.Linear(out_features=32),
                              atb_paddle.SiLU(), atb_paddle.Linear(out_features=16, bias=False),
                              atb_paddle.ResidualAdd()])
    y = blk(x)
    sd = blk.state_dict()
    assert sorted(sd) == ["0.weight", "1.bias", "1.weight", "3.weight"]
    assert all(isinstance(v, paddle.Tensor) for v in sd.values())
    paddle.save(sd, str(tmp_path / "blk.pdparams"))
    other = atb_paddle.GraphOp([atb_paddle.RmsNorm(eps=1e-6), atb_paddle.Linear(out_features=32, seed=1),
                                atb_paddle.SiLU(), atb_paddle.Linear(out_features=16, bias=False, seed=2),
                                atb_paddle.ResidualAdd()])
    assert float((other(x) - y).abs().max()) > 1e-3        # different weights
    other.set_state_dict(paddle.load(str(tmp_path / "blk.pdparams")))
    np.testing.assert_array_equal(_np(other(x)), _np(y))
    for k, v in other.state_dict().items():
        np.testing.assert_array_equal(_np(v), _np(sd[k]))


def test_parameter_changes_reach_the_graph():
    x = to_paddle(rand((2, 16), "fp32", 1))
    lin = atb_paddle.Linear(out_features=8)
    blk = atb_paddle.GraphOp([lin])
    parent = paddle.nn.Sequential(blk)
    y0 = blk(x)
    # set_state_dict on an enclosing Paddle layer (Paddle calls param.set_value)
    sd = parent.state_dict()
    sd["0.0.weight"] = paddle.zeros([8, 16])
    parent.set_state_dict(sd)
    np.testing.assert_array_equal(_np(blk(x)), np.broadcast_to(_np(lin.bias), (2, 8)))
    # an in-place write
    with paddle.no_grad():
        lin.bias.add_(paddle.ones([8]))
    np.testing.assert_allclose(_np(blk(x)), np.broadcast_to(_np(lin.bias), (2, 8)))
    # the standalone layer shares the same parameters
    np.testing.assert_array_equal(_np(lin(x)), _np(blk(x)))
    assert not np.allclose(_np(y0), _np(blk(x)))


def test_graph_weights_are_views_of_the_parameters():
    """DLPack zero-copy: the graph reads the parameter's own memory."""
    x = to_paddle(rand((2, 16), "fp32", 1))
    lin = atb_paddle.Linear(out_features=8, bias=False)
    blk = atb_paddle.GraphOp([lin, atb_paddle.Relu()])
    blk(x)
    w = dict(blk.core.graph.weights)["linear.weight"]
    view = atb.tensor.to_numpy(w)
    assert view.__array_interface__["data"][0] == lin.weight.data_ptr()
    view[0, 0] = 123.0                                  # write through the graph's view ...
    assert float(lin.weight[0, 0]) == 123.0             # ... read it in the parameter


def test_bf16_input_with_fp32_parameters():
    x = rand((2, 3, 16), "bf16", 1)
    blk = atb_paddle.GraphOp([atb_paddle.LayerNorm(eps=1e-5), atb_paddle.Linear(out_features=16)])
    y = blk(to_paddle(x))
    assert y.dtype == paddle.bfloat16
    ln_w, ln_b, w, b = (_np(blk.state_dict()[k]).astype(np.float64) for k in
                        ("0.weight", "0.bias", "1.weight", "1.bias"))
    assert blk.state_dict()["1.weight"].dtype == paddle.float32
    ref, = atb.Builder(backend="numpy").build_operation("LayerNorm", {"eps": 1e-5}).execute(
        [x, ln_w.astype(x.dtype), ln_b.astype(x.dtype)])
    ref, = atb.Builder(backend="numpy").build_operation("Linear", {}).execute(
        [ref, w.astype(x.dtype), b.astype(x.dtype)])
    atb.assert_close(y, ref, "bf16", "bf16 block")


def test_register_plugin_sees_paddle_tensors():
    seen = []

    class Double(atb_paddle.Plugin):
        def postprocess(self, outputs):
            seen.append(type(outputs[0]))
            return [o * 2 for o in outputs]

    x = to_paddle(rand((2, 4, 16), "fp32", 1))
    layers = [atb_paddle.LayerNorm(eps=1e-5), atb_paddle.Linear(out_features=32), atb_paddle.SiLU(),
              atb_paddle.Linear(out_features=16), atb_paddle.ResidualAdd()]
    cfg = {"fusion_level": "conservative"}             # keep Linear..Linear apart from the add
    plain = atb_paddle.GraphOp(layers, fusion_config=cfg)
    hooked = atb_paddle.GraphOp(layers, fusion_config=cfg).register_plugin("post_mlp", Double())
    y, yh = plain(x), hooked(x)
    assert seen and seen[0] is paddle.Tensor
    # post_mlp wraps Linear..Linear, before the residual add: (y - x) doubles
    atb.assert_close(yh - x, 2 * (y - x), "fp32", "post_mlp plugin")
    with pytest.raises(atb.ParamsError, match="plugin point"):
        plain.register_plugin("nowhere", Double())


def test_explain_shows_paddle_kernels_and_launches():
    blk = atb_paddle.GraphOp([atb_paddle.RmsNorm(eps=1e-6), atb_paddle.Linear(out_features=8)])
    blk(to_paddle(rand((2, 16), "fp32", 1)))
    text = blk.explain()
    assert "-> paddle [" in text and "fused_rms_norm" in text
    from atbcore.backends.cpu_kernels import available

    # one C matmul that RmsNorms its rows (atb's C kernels on the Paddle tensors), else
    # Paddle's fused_rms_norm and its matmul
    assert blk.last_launches == 1 if available() else blk.last_launches >= 2


def test_paddle_forward_hooks_and_save_load(tmp_path):
    x = to_paddle(rand((2, 3, 16), "fp32", 1))
    blk = atb_paddle.GraphOp([atb_paddle.RmsNorm(eps=1e-6), atb_paddle.Linear(out_features=16),
                              atb_paddle.ResidualAdd()], name="blk")
    y = blk(x)
    h = blk.register_forward_post_hook(lambda layer, inputs, out: out * 3)   # Paddle's own hook
    np.testing.assert_allclose(_np(blk(x)), 3 * _np(y), rtol=1e-6)
    h.remove()
    blk.save(str(tmp_path / "g"))
    loaded = atb_paddle.GraphOp.load(str(tmp_path / "g"))
    np.testing.assert_array_equal(_np(loaded(x)), _np(y))
    assert sorted(loaded.state_dict()) == sorted(dict(blk.core.graph_unfused.weights))


def test_graph_op_takes_core_layers_and_op_layers():
    from atbcore.graph import layers as L

    x = rand((2, 3, 16), "fp32", 1)
    core_ln = L.LayerNorm(eps=1e-5)
    blk = atb_paddle.GraphOp([core_ln, atb_paddle.Elewise(elewise_type="muls", var_attr=2.0),
                              atb_paddle.ops.Softmax(dim=-1)])
    y = blk(to_paddle(x))
    assert sorted(blk.state_dict()) == ["0.bias", "0.weight"]           # the core layer's weights
    xf = x.astype(np.float64)
    ln = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5)
    z = np.exp(2 * ln - (2 * ln).max(-1, keepdims=True))
    atb.assert_close(y, z / z.sum(-1, keepdims=True), "fp32", "LayerNorm -> muls -> Softmax")
    with pytest.raises(atb.ParamsError, match="one input and one output"):
        atb_paddle.GraphOp([atb_paddle.ops.Split(num=2)])(to_paddle(x))
    with pytest.raises(atb.ParamsError, match="atb_paddle layer"):
        atb_paddle.GraphOp([paddle.nn.Linear(16, 16)])


def test_seed_block_with_an_atb_kv_cache_decodes_as_the_full_sequence():
    """A Paddle GraphOp called with an atb.KVCache (written in place by the plan):
    prompt then one token per call equals the block on the whole sequence."""
    from atbcore.memory import KVCache

    blk = atb_paddle.GraphOp([atb_paddle.LayerNorm(eps=1e-5),
                              atb_paddle.FlashAttention(num_heads=4, causal=True, kv_cache=True),
                              atb_paddle.Linear(out_features=32), atb_paddle.ResidualAdd()])
    x = rand([2, 7, 32], seed=9)
    full = blk(to_paddle(x))
    cache = KVCache(1, 2, 16, 4, 8, dtype="fp32")
    outs = []
    for lo, hi in ((0, 4), (4, 5), (5, 6), (6, 7)):
        y, back = blk(to_paddle(x[:, lo:hi]), kv_cache=cache)
        assert back is cache
        outs.append(_np(y))
    atb.assert_close(np.concatenate(outs, axis=1), _np(full), "fp32", "Paddle KVCache decode")
    assert cache.seq_lens(layer=0)[:2].tolist() == [7, 7]
