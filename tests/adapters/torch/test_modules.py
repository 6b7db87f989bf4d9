"""atb_torch modules vs torch.nn / Hugging Face modules with the same weights (loaded
through load_state_dict from the reference module), fp32 and bf16 within DESIGN.md §5;
lazy parameters, state_dict, .to(), hooks and autograd."""

import pytest
import torch
from torch import nn

import atb_torch as atb

DTYPES = [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]


def x_of(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check(mod, ref, x, tag, what, *extra):
    """Same weights (ref's state_dict), same input: atb module in ``tag`` dtype vs the
    reference computed in fp32 from the same rounded values."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[tag]
    mod.load_state_dict(ref.state_dict())
    mod = mod.to(dt)
    ref = ref.to(dt).float()  # the rounded weights, computed in fp32
    with torch.no_grad():
        got = mod(x.to(dt), *extra)
        want = ref(x.to(dt).float(), *[e.float() for e in extra])
    assert got.dtype == dt
    atb.assert_close(got, want.to(dt), tag, what)
    return got


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_linear_norms_embedding_vs_torch_nn(dt, tag):
    torch.manual_seed(0)
    x = x_of(2, 5, 32)
    check(atb.Linear(32, 48), nn.Linear(32, 48), x, tag, "Linear vs nn.Linear")
    check(atb.Linear(out_features=48, bias=False), nn.Linear(32, 48, bias=False), x, tag,
          "lazy Linear (seed style) vs nn.Linear")
    ln = nn.LayerNorm(32)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    check(atb.LayerNorm("query", eps=1e-5), ln, x, tag, "LayerNorm vs nn.LayerNorm")
    rms = nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        rms.weight.normal_()
    check(atb.RmsNorm(32), rms, x, tag, "RmsNorm vs nn.RMSNorm")
    emb = nn.Embedding(20, 8)
    ids = torch.tensor([[0, 19, 3], [7, 7, 1]])
    mod = atb.Embedding(20, 8)
    mod.load_state_dict(emb.state_dict())
    assert torch.equal(mod.to(dt)(ids), emb.to(dt)(ids))


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_ffn_vs_hf_llama_mlp_and_moe_vs_mixtral(dt, tag):
    from transformers import LlamaConfig, MixtralConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48))
    check(atb.FusedFeedForward(intermediate_size=48), mlp, x_of(2, 5, 32), tag,
          "FusedFeedForward vs LlamaMLP (HF state_dict keys)")
    cfg = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4,
                        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    cfg._experts_implementation = "eager"  # HF's plain loop; 5.0 leaves it unset outside a model
    blk = MixtralSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    moe = atb.MoE(32, 24, 4, top_k=2)
    moe.load_state_dict({"router_weight": blk.gate.weight, "w_gate_up": blk.experts.gate_up_proj,
                         "w_down": blk.experts.down_proj})
    x = x_of(2, 6, 32, dtype=dt)
    with torch.no_grad():
        want = blk.to(dt).float()(x.float())
        got = moe.to(dt)(x)
    atb.assert_close(got, want.to(dt), tag, "MoE vs MixtralSparseMoeBlock")


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_activation_and_softmax_modules_vs_torch_nn(dt, tag):
    x = x_of(3, 4, 16, dtype=dt)
    xf = x.float()
    pairs = [(atb.SiLU(), nn.SiLU()), (atb.Gelu(), nn.GELU()),
             (atb.Gelu(approximate="tanh"), nn.GELU(approximate="tanh")), (atb.Relu(), nn.ReLU()),
             (atb.Softmax(dim=-1), nn.Softmax(-1)),
             (atb.Activation(activation_type="gelu_tanh"), nn.GELU(approximate="tanh"))]
    for mod, ref in pairs:
        atb.assert_close(mod(x), ref(xf).to(dt), tag, f"{type(mod).__name__} vs {ref}")
    atb.assert_close(atb.SwiGLU()(x), (nn.functional.silu(xf[..., :8]) * xf[..., 8:]).to(dt),
                     tag, "SwiGLU")
    assert torch.equal(atb.Transpose(perm=(0, 2, 1))(x), x.permute(0, 2, 1))
    assert torch.equal(atb.Reshape(shape=(3, -1))(x), x.reshape(3, 64))
    assert torch.equal(atb.Concat(dim=0)(x, x), torch.cat([x, x]))
    assert [t.shape[-1] for t in atb.Split(sizes=(4, 12))(x)] == [4, 12]
    assert torch.equal(atb.Argmax(dim=1)(x), x.argmax(1))
    y, s = atb.AddRmsNorm(16)(x, x)
    atb.assert_close(s, (xf + xf).to(dt), tag, "AddRmsNorm sum")


def test_flash_attention_and_rope_modules_vs_sdpa():
    b, s, h, hkv, d = 2, 7, 4, 2, 8
    q, k, v = x_of(b, s, h * d), x_of(b, s, hkv * d, seed=1), x_of(b, s, hkv * d, seed=2)
    attn = atb.SelfAttention(num_heads=h, num_kv_heads=hkv, causal=True)
    qh = q.view(b, s, h, d).transpose(1, 2)
    kh, vh = (t.view(b, s, hkv, d).transpose(1, 2) for t in (k, v))
    want = nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    atb.assert_close(attn(q, k, v), want.transpose(1, 2).reshape(b, s, h * d), "fp32",
                     "FlashAttention op form vs SDPA")
    # the layer form: its own projections (lazy until the hidden size is seen)
    layer = atb.FlashAttention(num_heads=h, num_kv_heads=hkv, causal=True)
    assert all(isinstance(p, nn.parameter.UninitializedParameter) for p in layer.parameters())
    x = x_of(b, s, 32, seed=3)
    with torch.no_grad():
        out = layer(x)
    qp, kp, vp = (x @ m.weight.T for m in (layer.q_proj, layer.k_proj, layer.v_proj))
    want = attn(qp, kp, vp)
    atb.assert_close(out, want, "fp32", "FlashAttention layer form vs projections + op")
    # the seed's standalone layer with its own KV cache: prefill + decode = full sequence
    seed_attn = atb.FlashAttention("attn", num_heads=h, causal=True, kv_cache=True)
    with torch.no_grad():
        full, _ = seed_attn(x, kv_cache=None)
        head, kv = seed_attn(x[:, :5], kv_cache=None)
        tail, kv = seed_attn(x[:, 5:], kv_cache=kv)
    atb.assert_close(torch.cat([head, tail], 1), full, "fp32", "standalone attention + cache")
    rope = atb.RoPE(num_heads=h, num_kv_heads=hkv)
    rq, rk = rope(q, k)
    assert rq.shape == q.shape and rk.shape == k.shape
    atb.assert_close(rq[:, 0], q[:, 0], "fp32", "position 0 is not rotated")


def test_op_modules_inside_a_graph_op_equal_their_standalone_calls():
    torch.manual_seed(0)
    emb, norm, sm = atb.Embedding(20, 8), atb.RmsNorm(8), atb.Softmax(dim=-1)
    moe = atb.MoE(8, 6, 4)
    ids = torch.tensor([[1, 5, 19]])
    with torch.no_grad():
        g = atb.GraphOp([emb, norm, sm])
        assert torch.equal(g(ids), sm(norm(emb(ids))))
        m = atb.GraphOp([atb.RmsNorm(8), moe, atb.Transpose(perm=(1, 0))])
        x = x_of(5, 8)
        atb.assert_close(m(x), moe(m.layers["rms_norm"](x)).T, "fp32", "MoE inside a GraphOp")


def test_state_dict_round_trip_lazy_params_and_to():
    lin = atb.Linear("qkv_proj", out_features=12)
    sd = lin.state_dict()
    assert set(sd) == {"weight", "bias"} and isinstance(sd["weight"],
                                                        nn.parameter.UninitializedParameter)
    lin = lin.half()
    x = x_of(3, 5)
    lin(x.half())  # first call materialises in the module's dtype
    assert lin.weight.shape == (12, 5) and lin.weight.dtype == torch.float16 and lin.in_features == 5
    bound = 1 / 5 ** 0.5
    assert lin.weight.abs().max() <= bound and lin.weight.std() > 0  # nn.Linear's init
    other = atb.Linear(out_features=12)
    other.load_state_dict(lin.state_dict())
    assert torch.equal(other.weight, lin.weight.float())
    other = other.to(torch.bfloat16)
    assert other.weight.dtype == torch.bfloat16 and other(x.bfloat16()).dtype == torch.bfloat16


def test_dlpack_inputs_from_numpy_mindspore_paddle():
    import numpy as np

    norm = atb.RmsNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(8.0))
    a = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    want = norm(torch.from_numpy(a))
    atb.assert_close(norm(a), want, "fp32", "numpy input")
    pytest.importorskip("mindspore")
    import mindspore as ms

    atb.assert_close(norm(ms.Tensor(a)), want, "fp32", "mindspore input")
    paddle = pytest.importorskip("paddle")
    atb.assert_close(norm(paddle.to_tensor(a)), want, "fp32", "paddle input")


def test_forward_hooks_fire_on_standalone_modules_and_warn_inside_graphs():
    seen = []
    lin = atb.Linear(4, 4)
    lin.register_forward_hook(lambda m, inp, out: seen.append(out.shape))
    lin(x_of(2, 4))
    assert seen == [torch.Size([2, 4])]
    inner = atb.Linear(4, 4)
    block = atb.GraphOp([inner, atb.ResidualAdd()])  # noqa: F841  (alive while hooked)
    with pytest.warns(UserWarning, match="register_plugin"):
        inner.register_forward_hook(lambda *a: None)


def test_autograd_forward_works_backward_raises_atb_error():
    lin = atb.Linear(4, 3)  # parameters require grad, as nn.Linear's
    y = lin(x_of(2, 4))
    assert y.requires_grad
    with pytest.raises(atb.AtbError, match="inference-only"):
        y.sum().backward()
    assert lin.weight.grad is None  # nothing silently accumulated


def test_bad_construction_and_inputs_raise_atb_errors():
    with pytest.raises(atb.ParamsError, match="Linear"):
        atb.Linear(out_features=0)
    with pytest.raises(atb.ParamsError, match="FlashAttention"):
        atb.FlashAttention(num_heads=4, num_kv_heads=3)
    with pytest.raises(atb.ParamsError, match="LayerNorm"):
        atb.LayerNorm(eps=-1.0)
    with pytest.raises(atb.ShapeError, match="Linear"):
        atb.Linear(8, 4)(x_of(2, 5))
    with pytest.raises(atb.InputError, match="Embedding"):
        atb.Embedding(4, 2)(torch.tensor([4]))
