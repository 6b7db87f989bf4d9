"""FusedFeedForward: torch kernel vs the NumPy reference across activations, layouts
(separate / merged gate-up, nn.Linear and transposed weights), bias and residual;
Hugging Face LlamaMLP and BERT intermediate+output oracles; the seed article's call;
bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from oracle import FLOATS, as_torch, check_error, check_op, rand, run

GATED = ["swiglu", "geglu"]
PLAIN = ["gelu", "gelu_tanh", "relu", "silu"]


def weights(h, i, dtype, gated, seed=10):
    """nn.Linear-layout weights: (gate [I, H], up [I, H], down [H, I]) or (up, down)."""
    s = 1.0 / np.sqrt(h)
    ws = [rand((i, h), dtype, seed, s), rand((i, h), dtype, seed + 1, s),
          rand((h, i), dtype, seed + 2, 1.0 / np.sqrt(i))]
    return ws if gated else ws[1:]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 769), (2, 3, 769), (4, 64)])
@pytest.mark.parametrize("act", GATED + PLAIN)
def test_matches_reference(act, shape, dtype):
    h, i = shape[-1], 96
    x = rand(shape, dtype, 1)
    check_op("FusedFeedForward", {"activation_type": act}, [x, *weights(h, i, dtype, act in GATED)])


@pytest.mark.parametrize("dtype", FLOATS)
def test_merged_bias_residual_and_transposed_layouts(dtype):
    h, i = 769, 48
    x, res = rand((2, 5, h), dtype, 1), rand((2, 5, h), dtype, 2)
    g, u, d = weights(h, i, dtype, True)
    gu = np.concatenate([g, u])                                  # [2I, H], gate rows first
    bg, bu, bd = rand((i,), dtype, 3), rand((i,), dtype, 4), rand((h,), dtype, 5)
    base = check_op("FusedFeedForward", {}, [x, g, u, d])[0]
    merged = check_op("FusedFeedForward", {"gate_up_merged": True, "hidden_size": h,
                                           "intermediate_size": i}, [x, gu, d])[0]
    np.testing.assert_array_equal(merged, base)
    tr = check_op("FusedFeedForward", {}, [x, g.T.copy(), u.T.copy(), d.T.copy()])[0]
    np.testing.assert_array_equal(tr, base)                     # [in, out] accepted
    check_op("FusedFeedForward", {"gate_up_merged": True}, [x, gu.T.copy(), d])
    with_res = check_op("FusedFeedForward", {"has_residual": True}, [x, g, u, d, res])[0]
    f64 = np.float64
    np.testing.assert_allclose(with_res.astype(f64), base.astype(f64) + res.astype(f64),
                               rtol=2e-2, atol=2e-2)
    check_op("FusedFeedForward", {"bias": True, "has_residual": True}, [x, g, u, d, bg, bu, bd, res])
    check_op("FusedFeedForward", {"bias": True, "gate_up_merged": True},
             [x, gu, d, np.concatenate([bg, bu]), bd])
    check_op("FusedFeedForward", {"bias": True}, [x, g, u, d, None, bu, None])  # a bias left out
    check_op("FusedFeedForward", {"activation_type": "gelu", "bias": True}, [x, u, d, bu, bd])



@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("merged", [True, False])
def test_norm_inside_matches_rms_norm_then_ffn(merged, dtype):
    """``norm_eps``: x RmsNorm'd by the first matmul (the norm_ffn fusion's op) equals
    the RmsNorm op followed by the FFN, with and without the residual (torch kernel,
    numpy_c and the NumPy reference)."""
    h, i = 96, 48
    x, res, nw = rand((3, h), dtype, 1), rand((3, h), dtype, 2), rand((h,), dtype, 6)
    g, u, d = weights(h, i, dtype, True)
    ws = [np.concatenate([g, u]), d] if merged else [g, u, d]
    p = {"gate_up_merged": merged, "has_residual": True}
    fused = check_op("FusedFeedForward", {**p, "norm_eps": 1e-5}, [x, *ws, res, nw])[0]
    normed = check_op("RmsNorm", {"eps": 1e-5}, [x, nw])[0]
    want = check_op("FusedFeedForward", p, [normed, *ws, res])[0]
    atb.assert_close(fused, want, dtype, "FFN(norm inside) vs RmsNorm + FFN")
    if dtype == "fp32":
        got, = atb.Builder(backend="numpy_c").build_operation(
            "FusedFeedForward", {**p, "norm_eps": 1e-5}).execute([x, *ws, res, nw])
        atb.assert_close(got, fused, "fp32", "numpy_c FFN(norm inside) vs reference")
        xt = torch.from_numpy(x)
        n = F.rms_norm(xt, (h,), torch.from_numpy(nw), 1e-5)
        gt, ut, dt_ = (torch.from_numpy(a) for a in (g, u, d))
        oracle = torch.from_numpy(res) + F.linear(F.silu(F.linear(n, gt)) * F.linear(n, ut), dt_)
        atb.assert_close(fused, oracle, "fp32", "FFN(norm inside) vs torch.nn.functional")

def test_square_weights_read_as_out_in():
    h = 64
    x = torch.from_numpy(rand((3, h), "fp32", 1))
    g, u, d = (torch.from_numpy(w) for w in weights(h, h, "fp32", True))
    y, = atb.Builder().build_operation("FusedFeedForward").execute([x, g, u, d])
    atb.assert_close(y, F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d), "fp32")


def _llama_mlp(h, i):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    m = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=i, hidden_act="silu",
                                 num_attention_heads=1, num_key_value_heads=1, head_dim=64)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, h ** -0.5)
    return m


def test_vs_hf_llama_mlp():
    m = _llama_mlp(769, 160)
    x = torch.randn(2, 7, 769, generator=torch.Generator().manual_seed(1))
    want = m(x).detach()
    g, u, d = (w.detach() for w in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight))
    y, = atb.Builder().build_operation("FusedFeedForward", {"activation_type": "swiglu"}).execute(
        [x, g, u, d])
    atb.assert_close(y, want, "fp32", "FusedFeedForward vs LlamaMLP")
    y, = atb.Builder().build_operation("FusedFeedForward", {"gate_up_merged": True}).execute(
        [x[:1, :1], torch.cat([g, u]), d])                      # one row
    atb.assert_close(y, want[:1, :1], "fp32", "merged gate_up, one row, vs LlamaMLP")


def test_vs_hf_bert_intermediate_and_output():
    from transformers.models.bert.modeling_bert import BertConfig, BertIntermediate, BertOutput

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=384, intermediate_size=1536, hidden_act="gelu",
                     hidden_dropout_prob=0.0)
    inter, out = BertIntermediate(cfg).eval(), BertOutput(cfg).eval()
    with torch.no_grad():
        for p in [*inter.parameters(), out.dense.weight, out.dense.bias]:
            p.normal_(0.0, 0.05)
    x = torch.randn(3, 11, 384)
    ws = [inter.dense.weight, out.dense.weight, inter.dense.bias, out.dense.bias]
    ws = [w.detach() for w in ws]
    y, = atb.Builder().build_operation("FusedFeedForward", {"activation_type": "gelu", "bias": True,
                                                            "has_residual": True}).execute([x, *ws, x])
    want = out.dense(inter(x)).detach() + x
    atb.assert_close(y, want, "fp32", "FusedFeedForward vs BERT dense(gelu(dense(x))) + x")
    # FFN then AddLayerNorm is BertOutput(BertIntermediate(x), x)
    f, = atb.Builder().build_operation("FusedFeedForward", {"activation_type": "gelu",
                                                            "bias": True}).execute([x, *ws])
    z, _ = atb.Builder().build_operation("AddLayerNorm", {"eps": cfg.layer_norm_eps}).execute(
        [f, x, out.LayerNorm.weight.detach(), out.LayerNorm.bias.detach()])
    atb.assert_close(z, out(inter(x), x).detach(), "fp32", "FFN + AddLayerNorm vs BertOutput")


def test_seed_article_call():
    """Seed 8.5: seed params (fusion hints included) and weights created [H, I] / [I, H]."""
    hidden, ffn = 256, 1024
    params = {"hidden_size": hidden, "intermediate_size": ffn, "activation_type": "swiglu",
              "dtype": atb.Dtype.FP16, "fuse_gate_up": True, "fuse_activation": True,
              "fuse_down": True, "fuse_add": True, "intermediate_dtype": atb.Dtype.BF16}
    op = atb.Builder().build_operation("FusedFeedForward", params)
    assert op.params.hints["intermediate_dtype"] == atb.Dtype.BF16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, hidden, generator=g).half()
    gate = (torch.randn(hidden, ffn, generator=g) * hidden ** -0.5).half()
    up = (torch.randn(hidden, ffn, generator=g) * hidden ** -0.5).half()
    down = (torch.randn(ffn, hidden, generator=g) * ffn ** -0.5).half()
    outputs = [atb.TensorDesc(shape=list(x.shape), dtype=atb.Dtype.FP16)]
    op.execute([x, gate, up, down], outputs)
    xf = x.float()
    want = (F.silu(xf @ gate.float()) * (xf @ up.float())) @ down.float()
    assert outputs[0].dtype == torch.float16
    atb.assert_close(outputs[0], want, "fp16", "seed FusedFeedForward")


H, I = 16, 8
X = rand((2, H))
W = weights(H, I, "fp32", True)
BAD = [
    # (params, inputs, error, fragments)
    ({}, [rand((H,)), *W], atb.ShapeError, ["x", "rank >= 2"]),
    ({}, [X, rand((1, I, H)), *W[1:]], atb.ShapeError, ["gate_w", "rank 2"]),
    ({}, [X, W[0], rand((I + 1, H)), W[2]], atb.ShapeError, ["up_w", f"[{I}, {H}]", f"[{I + 1}, {H}]"]),
    ({}, [X, W[0], W[1], rand((H, I + 2))], atb.ShapeError, ["down_w", f"[{H}, {I + 2}]"]),
    ({}, [X, rand((I, H + 1)), W[1], W[2]], atb.ShapeError, ["gate_w", f"[{I}, {H + 1}]"]),
    ({"hidden_size": 32}, [X, *W], atb.ShapeError, ["hidden_size", "32"]),
    ({"intermediate_size": 4}, [X, *W], atb.ShapeError, ["gate_w", "[4, 16]"]),
    ({}, [X, W[0].astype(np.float16), *W[1:]], atb.DtypeError, ["gate_w", "FP16"]),
    ({}, [X.astype(np.int32), *W], atb.DtypeError, ["x", "INT32"]),
    ({"dtype": "fp16"}, [X, *W], atb.DtypeError, ["FP16", "FP32"]),
    ({}, [X, *W[:2]], atb.InputError, ["number of inputs", "down_w"]),
    ({}, [X, *W, X], atb.InputError, ["number of inputs", "has_residual=False"]),
    ({"has_residual": True}, [X, *W], atb.InputError, ["number of inputs", "residual"]),
    ({"has_residual": True}, [X, *W, rand((3, H))], atb.ShapeError, ["residual"]),
    ({}, [X, W[0], None, W[2]], atb.InputError, ["up_w", "missing"]),
    ({"bias": True}, [X, *W, rand((I,)), rand((I,)), rand((I,))], atb.ShapeError, ["down_b", f"[{H}]"]),
    ({"gate_up_merged": True}, [X, rand((2 * I + 1, H)), W[2]], atb.ShapeError, ["even"]),
    ({"activation_type": "gelu"}, [X, *W], atb.InputError, ["number of inputs", "3"]),
]


@pytest.mark.parametrize("params,inputs,exc,frags", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(params, inputs, exc, frags):
    check_error("FusedFeedForward", params, inputs, exc, *frags,
                outputs=[np.full((2, H), 3.0, np.float32)])


def test_bad_params():
    for params, frag in [({"activation_type": "mish"}, "mish"),
                         ({"activation_type": "gelu", "gate_up_merged": True}, "gated"),
                         ({"intermediate_size": 0}, "intermediate_size"),
                         ({"hidden_size": 1.5}, "hidden_size"),
                         ({"fuse_everything": True}, "fuse_everything")]:
        check_error("FusedFeedForward", params, [], atb.ParamsError, frag, build_error=True)


def test_wrong_outputs_leave_them_untouched():
    check_error("FusedFeedForward", {}, [X, *W], atb.InputError, "number of outputs",
                outputs=[np.full((2, H), 3.0, np.float32)] * 2)
    check_error("FusedFeedForward", {}, [X, *W], atb.ShapeError, "output",
                outputs=[np.full((2, I), 3.0, np.float32)])


@pytest.mark.parametrize("inter", [64, 48])
def test_merged_gate_up_activation_in_the_matmul_epilogue(inter, monkeypatch):
    """A merged gate|up projection of whole 32-output panels (I = 64) applies the gated
    activation in its epilogue, so no activation kernel runs; I = 48 (the up half starts
    mid-panel) keeps the activation kernel. Both match the NumPy reference, and the
    NumPy backend's C path gives the torch kernel's bits."""
    from atbcore.backends.cpu_kernels import available, torch_ops

    h = 72
    x, res = rand((3, h), "float32", 1), rand((3, h), "float32", 2)
    g, u, d = weights(h, inter, "float32", True)
    bgu, bd = rand((2 * inter,), "float32", 3), rand((h,), "float32", 4)
    params = {"gate_up_merged": True, "bias": True, "has_residual": True}
    calls = []
    act = torch_ops.activation
    monkeypatch.setattr(torch_ops, "activation",
                        lambda *a, **k: calls.append(1) or act(*a, **k))
    got = run("FusedFeedForward", params, [as_torch(v) for v in
                                           (x, np.concatenate([g, u]), d, bgu, bd, res)], "torch")
    ref = check_op("FusedFeedForward", params, [x, np.concatenate([g, u]), d, bgu, bd, res])
    if available():
        assert (len(calls) == 0) == (inter % 32 == 0), calls
    gu_w = np.concatenate([g, u])
    op = atb.GraphOp(_ffn_graph(params, x, gu_w, d, bgu, bd, res))
    native = op(x, res)
    np.testing.assert_array_equal(np.asarray(native), got[0].numpy())
    atb.assert_close(native, ref[0], "fp32", "NumPy backend GraphOp")


def _ffn_graph(params, x, gu_w, d, bgu, bd, res):
    gb = atb.GraphBuilder("ffn")
    xi, ri = gb.add_input("x", x), gb.add_input("r", res)
    ins = [xi, gb.add_weight("gu", gu_w), gb.add_weight("d", d), gb.add_weight("bgu", bgu),
           gb.add_weight("bd", bd), ri]
    y, = gb.add_node("FusedFeedForward", ins, params, name="ffn")
    gb.mark_output(y)
    return gb.build()
