"""atb_torch.functional vs torch.nn.functional / Hugging Face on the same inputs, in
fp32 and bf16 (the oracle computes in fp32 from the same bf16 values and rounds once),
within DESIGN.md §5; NumPy inputs accepted through DLPack; autograd refused clearly."""

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import atb_torch as atb
from atb_torch import functional as F

DTYPES = [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]


def r(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def close(got, want, tag, what):
    assert got.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[tag], (what, got.dtype)
    atb.assert_close(got, want.to(got.dtype), tag, what)


def f32(*ts):
    return [t.float() for t in ts]


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_norms_vs_torch_and_hf(dt, tag):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, res, w, b = r(2, 7, 64, dtype=dt), r(2, 7, 64, dtype=dt, seed=1), \
        r(64, dtype=dt, seed=2), r(64, dtype=dt, seed=3)
    hf = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(w.float())
    xf, rf, wf, bf = f32(x, res, w, b)
    with torch.no_grad():
        close(F.rms_norm(x, w, 1e-6), hf(xf), tag, "rms_norm vs LlamaRMSNorm")
        y, s = F.add_rms_norm(x, res, w, 1e-6)
        close(s, xf + rf, tag, "add_rms_norm sum")
        close(y, hf((xf + rf).to(dt).float()), tag, "add_rms_norm vs LlamaRMSNorm(x + r)")
        close(F.layer_norm(x, w, b, 1e-5), TF.layer_norm(xf, (64,), wf, bf, 1e-5), tag,
              "layer_norm")
        y, s = F.add_layer_norm(x, res, w, b, 1e-5)
        close(y, TF.layer_norm((xf + rf).to(dt).float(), (64,), wf, bf, 1e-5), tag,
              "add_layer_norm")


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_linear_matmul_vs_torch(dt, tag):
    from atbcore.ops.linear import quantize_w8
    from atbcore.ops.linear_quant import act_q8

    x, w, b = r(3, 5, 32, dtype=dt), r(48, 32, dtype=dt, seed=1, scale=0.2), r(48, dtype=dt, seed=2)
    close(F.linear(x, w, b), TF.linear(*f32(x, w, b)), tag, "linear")
    wq, s = quantize_w8(w.float())
    s = s.to(dt)  # the scale in the activation dtype; dequantised in fp32
    xq = torch.from_numpy(act_q8(x.float().numpy())).float()  # w8 reads x as int8 blocks
    close(F.linear(x, wq, b, scale=s),
          TF.linear(xq, wq.float() * s.float()[:, None], b.float()), tag, "linear w8")
    a, m = r(2, 4, 6, 8, dtype=dt), r(4, 5, 8, dtype=dt, seed=3)
    close(F.matmul(a, m, transpose_b=True), torch.matmul(*f32(a, m.transpose(-1, -2))), tag,
          "matmul")


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_rope_vs_hf_llama(dt, tag):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    b, h, hkv, s, d = 2, 4, 2, 6, 16
    cfg = LlamaConfig(hidden_size=h * d, num_attention_heads=h, num_key_value_heads=hkv,
                      head_dim=d, rope_theta=10000.0, max_position_embeddings=64)
    q, k = r(b, s, h, d, dtype=dt), r(b, s, hkv, d, dtype=dt, seed=1)
    pos = torch.arange(3, 3 + s).expand(b, s)
    cos, sin = LlamaRotaryEmbedding(cfg)(q.float(), pos)
    wq, wk = apply_rotary_pos_emb(q.float().transpose(1, 2), k.float().transpose(1, 2), cos, sin)
    gq, gk = F.rope(q, k, pos, num_heads=h, num_kv_heads=hkv, layout="BSND")
    close(gq, wq.transpose(1, 2), tag, "rope q vs HF")
    close(gk, wk.transpose(1, 2), tag, "rope k vs HF")
    only_q = F.rope(q.reshape(b, s, h * d), position_offset=3, num_heads=h)
    close(only_q.reshape(b, s, h, d), wq.transpose(1, 2), tag, "rope q only, offset")


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_attention_vs_sdpa(dt, tag):
    b, s, h, hkv, d = 2, 9, 4, 2, 16
    q, k, v = r(b, s, h * d, dtype=dt), r(b, s, hkv * d, dtype=dt, seed=1), \
        r(b, s, hkv * d, dtype=dt, seed=2)
    qh = q.float().view(b, s, h, d).transpose(1, 2)
    kh = k.float().view(b, s, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    vh = v.float().view(b, s, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    want = TF.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    got = F.flash_attention(q, k, v, num_heads=h, num_kv_heads=hkv, causal=True)
    close(got, want.transpose(1, 2).reshape(b, s, h * d), tag, "flash_attention vs SDPA")
    # paged: the same keys/values in blocks of 4, the last query of each sequence
    bs, nb = 4, 3
    kc = torch.zeros(b * nb, bs, hkv, d, dtype=dt)
    vc = torch.zeros_like(kc)
    slots = torch.cat([torch.arange(i * nb * bs, i * nb * bs + s) for i in range(b)])
    F.reshape_and_cache(k.reshape(b * s, hkv, d), v.reshape(b * s, hkv, d), kc, vc, slots)
    tables = torch.arange(b * nb, dtype=torch.int32).reshape(b, nb)
    out = F.paged_attention(q.view(b, s, h, d)[:, -1], kc, vc, tables,
                            torch.full((b,), s, dtype=torch.int32), num_heads=h, num_kv_heads=hkv)
    close(out, want.transpose(1, 2)[:, -1], tag, "paged_attention (last query) vs SDPA")


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_softmax_and_activations_vs_torch(dt, tag):
    x, up = r(3, 5, 16, dtype=dt, scale=2.0), r(3, 5, 16, dtype=dt, seed=1)
    xf, uf = f32(x, up)
    close(F.softmax(x), torch.softmax(xf, -1), tag, "softmax")
    close(F.softmax(x, (-1, -2)), torch.softmax(xf.flatten(-2), -1).view_as(xf), tag,
          "softmax over two axes")
    mask = torch.zeros(5, 16)
    mask[:, 10:] = float("-inf")
    close(F.scaled_masked_softmax(x, mask, scale=0.5), torch.softmax(xf * 0.5 + mask, -1), tag,
          "scaled_masked_softmax")
    close(F.gelu(x), TF.gelu(xf), tag, "gelu")
    close(F.gelu(x, "tanh"), TF.gelu(xf, approximate="tanh"), tag, "gelu tanh")
    close(F.activation(x, "gelu_tanh"), TF.gelu(xf, approximate="tanh"), tag, "activation")
    close(F.quick_gelu(x), xf * torch.sigmoid(1.702 * xf), tag, "quick_gelu")
    close(F.silu(x), TF.silu(xf), tag, "silu")
    close(F.relu(x), TF.relu(xf), tag, "relu")
    close(F.swiglu(x), TF.silu(xf[..., :8]) * xf[..., 8:], tag, "swiglu halves")
    close(F.swiglu(x, up), TF.silu(xf) * uf, tag, "swiglu(gate, up)")
    close(F.geglu(x, up), TF.gelu(xf) * uf, tag, "geglu(gate, up)")


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_ffn_vs_hf_llama_mlp(dt, tag):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48)).eval()
    x = r(2, 5, 32, dtype=dt)
    ws = [m.weight.detach().to(dt) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    with torch.no_grad():
        for m, w in zip((mlp.gate_proj, mlp.up_proj, mlp.down_proj), ws):
            m.weight.copy_(w.float())
        want = mlp(x.float())
        close(F.fused_feed_forward(x, *ws), want, tag, "fused_ffn vs LlamaMLP")
        close(F.fused_feed_forward(x, None, None, ws[2], gate_up_w=torch.cat(ws[:2])), want, tag,
              "fused_ffn merged gate/up vs LlamaMLP")
        close(F.fused_feed_forward(x, *ws, residual=x), want + x.float(), tag, "fused_ffn + residual")


@pytest.mark.parametrize("dt,tag", DTYPES)
def test_moe_vs_hf_mixtral(dt, tag):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4,
                        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    cfg._experts_implementation = "eager"  # HF's plain loop; 5.0 leaves it unset outside a model
    blk = MixtralSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_((torch.randn_like(p) * 0.1).to(dt).float())
    x = r(2, 6, 32, dtype=dt)
    ws = [w.detach().to(dt) for w in (blk.gate.weight, blk.experts.gate_up_proj,
                                       blk.experts.down_proj)]
    with torch.no_grad():
        want = blk(x.float())
        got = F.moe(x.reshape(-1, 32), *ws, top_k=2).reshape(2, 6, 32)
    close(got, want, tag, "moe vs MixtralSparseMoeBlock")


def test_shape_gather_sampling_vs_torch():
    x = r(2, 6, 8)
    assert torch.equal(F.transpose(x, (0, 2, 1)), x.permute(0, 2, 1))
    v = F.reshape(x, (2, -1))
    assert torch.equal(v, x.reshape(2, 48)) and v.data_ptr() == x.data_ptr()  # a view
    a, b = F.split(x, [2, 6])
    assert torch.equal(a, x[..., :2]) and torch.equal(b, x[..., 2:])
    assert [t.shape[-1] for t in F.split(x, num=4)] == [2, 2, 2, 2]
    assert torch.equal(F.concat([x, x], 1), torch.cat([x, x], 1))
    assert torch.equal(F.slice(x, [0, 2, 1], [-1, 3, 4]), x[:, 2:5, 1:5])
    idx = torch.tensor([[5, 0], [1, 1]])
    assert torch.equal(F.gather(x, idx, axis=1), x[:, idx])
    table = r(10, 4)
    assert torch.equal(F.embedding(idx, table), TF.embedding(idx, table))
    assert torch.equal(F.argmax(x, 1), torch.argmax(x, 1))
    logits = r(4, 30, scale=3.0)
    assert torch.equal(F.topk_topp_sampling(logits, temperature=0.0), logits.argmax(-1))
    ids = F.topk_topp_sampling(logits, top_k=3, seed=7)
    top3 = logits.topk(3, -1).indices
    assert all(int(i) in top3[row].tolist() for row, i in enumerate(ids))
    assert torch.equal(ids, F.topk_topp_sampling(logits, top_k=3, seed=7))  # seeded
    assert torch.equal(F.elewise(x, elewise_type="muls", scalar=3.0), x * 3.0)
    assert F.elewise(x, elewise_type="cast", out_dtype=torch.bfloat16).dtype == torch.bfloat16
    atb.assert_close(F.elewise(x, x, elewise_type="div"), torch.ones_like(x), "fp32", "div")
    assert torch.equal(F.residual_add(x, x), x + x)
    assert torch.equal(F.all_reduce(x), x)  # one process: identity


def test_numpy_inputs_cross_through_dlpack():
    x, w = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32), \
        np.ones(16, np.float32)
    got = F.rms_norm(x, w)
    assert isinstance(got, torch.Tensor)
    want = torch.from_numpy(x) / torch.from_numpy(x).pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    atb.assert_close(got, want, "fp32", "rms_norm on numpy inputs")


def test_bad_inputs_raise_atb_errors():
    with pytest.raises(atb.ShapeError, match="Linear"):
        F.linear(r(2, 8), r(4, 9))
    with pytest.raises(atb.InputError, match="Embedding"):
        F.embedding(torch.tensor([3, 10]), r(10, 4))
    with pytest.raises(atb.InputError, match="RmsNorm"):
        F.rms_norm([1.0, 2.0], r(2))
    with pytest.raises(atb.ShapeError, match="Split"):
        F.split(r(2, 6), num=4)
    with pytest.raises(atb.ShapeError, match="Reshape"):
        F.reshape(r(2, 6), (5, -1))


def test_autograd_works_forward_and_refuses_backward():
    x = r(2, 8).requires_grad_()
    for y in (F.silu(x), F.linear(x, r(4, 8)), F.softmax(x), F.fused_feed_forward(
            x, r(6, 8), r(6, 8), r(8, 6))):
        assert y.requires_grad  # the graph is recorded, so backward cannot pass silently
        with pytest.raises(atb.AtbError, match="inference-only"):
            y.sum().backward()
