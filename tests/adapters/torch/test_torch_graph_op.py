"""atb_torch.GraphOp: the seed's blocks run as written and equal a plain-PyTorch model
with the same weights (prefill and cached decode, fp32 and bf16); an HF Llama decoder
layer built from GraphOps; zero-copy parameter binding and re-binding; KV-cache
forms; plugins and forward hooks; autograd refusal; graphs, save/load."""

import pytest
import torch
from torch import nn

import atb_torch as atb
from seed_models import (AcceleratedLLaMA, AcceleratedTransformerBlock, PlainBlock, PlainLLaMA,
                         block_state_to_plain, copy_weights)

H, HEADS, MLP = 32, 4, 64


def x_of(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def seeded_block(seed=0):
    torch.manual_seed(seed)
    blk = AcceleratedTransformerBlock(H, HEADS, MLP)
    blk(x_of(1, 2, H))  # materialise the lazy parameters (torch's init)
    with torch.no_grad():  # non-trivial norms so a wrong binding would show
        for name, p in blk.named_parameters():
            if "layer_norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    return blk


@pytest.mark.parametrize("dt,tag", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_seed_block_matches_plain_pytorch_prefill_and_decode(dt, tag):
    blk = seeded_block().to(dt)
    ref = PlainBlock(H, HEADS, MLP)
    ref.load_state_dict(block_state_to_plain(blk.state_dict()))
    if dt != torch.float32:
        ref.round_to(dt)
    x = x_of(2, 6, H, dtype=dt)
    with torch.no_grad():
        y, kv = blk(x)                                   # kv_cache=None: starts empty
        want, past = ref(x.float())
        atb.assert_close(y, want, tag, "seed block prefill vs plain PyTorch")
        for step in range(2):                            # cached decode, one token at a time
            t = x_of(2, 1, H, dtype=dt, seed=10 + step)
            y, kv = blk(t, kv_cache=kv)
            want, past = ref(t.float(), past)
            atb.assert_close(y, want, tag, f"seed block decode step {step}")
    k, v = next(iter(kv.values()))[0]
    assert k.shape == (2, 8, H) and k.dtype == dt
    atb.assert_close(k, past[0], tag, "cached keys")


@pytest.mark.parametrize("dt,tag", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_seed_llama_shell_with_atb_kv_cache_matches_plain_model(dt, tag):
    torch.manual_seed(0)
    vocab, layers = 40, 2
    model = AcceleratedLLaMA(vocab, H, layers, HEADS, MLP, max_batch=2, max_seq_len=16, dtype=dt)
    ids = torch.randint(0, vocab, (2, 7))
    with torch.no_grad():
        for layer in model.layers:
            layer(x_of(1, 1, H))  # materialise the lazy parameters (no cache involved)
    model = model.to(dt)
    plain = copy_weights(model, PlainLLaMA(vocab, H, layers, HEADS, MLP))
    if dt != torch.float32:
        plain.round_to(dt)
    with torch.no_grad():
        full = plain(ids)
        prefill = model(ids[:, :5])
        step1 = model(ids[:, 5:6])
        step2 = model(ids[:, 6:7])
    atb.assert_close(prefill, full[:, :5], tag, "AcceleratedLLaMA prefill vs plain")
    atb.assert_close(step1, full[:, 5:6], tag, "AcceleratedLLaMA decode 1 vs plain")
    atb.assert_close(step2, full[:, 6:7], tag, "AcceleratedLLaMA decode 2 vs plain")
    assert model.kv_cache.seq_lens().tolist() == [7, 7]


def test_seed_fused_attention_block_example_runs_as_written():
    """The seed's first snippet: named layers, packed QKV after a Linear, the residual
    named ("output", "input"), called with four tensors of which it reads the first."""
    hidden_dim, num_heads = H, HEADS
    torch.manual_seed(0)
    attention_block = atb.GraphOp([
        atb.LayerNorm("query", eps=1e-5),
        atb.Linear("qkv_proj", out_features=3 * hidden_dim),
        atb.FlashAttention("attn", num_heads=num_heads, causal=True),
        atb.Linear("out_proj", out_features=hidden_dim),
        atb.ResidualAdd("output", "input")
    ])
    query, key, value, residual = (x_of(2, 5, H, seed=i) for i in range(4))
    with pytest.warns(UserWarning, match="ignored"), torch.no_grad():
        output = attention_block(query, key, value, residual)
    assert [n for n, _ in attention_block.named_parameters()] == [
        "layers.query.weight", "layers.query.bias", "layers.qkv_proj.weight",
        "layers.qkv_proj.bias", "layers.out_proj.weight", "layers.out_proj.bias"]
    L = attention_block.layers
    with torch.no_grad():
        n = nn.functional.layer_norm(query, (H,), L.query.weight, L.query.bias, 1e-5)
        q, k, v = L.qkv_proj(n).split(H, -1)
        heads = [t.view(2, 5, HEADS, H // HEADS).transpose(1, 2) for t in (q, k, v)]
        a = nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
        want = L.out_proj(a.transpose(1, 2).reshape(2, 5, H)) + query
    atb.assert_close(output, want, "fp32", "seed fused attention block vs plain PyTorch")


def test_rope_attention_with_cache_decodes_like_the_full_sequence():
    torch.manual_seed(0)
    g = atb.GraphOp([atb.RmsNorm(H), atb.RoPE(num_heads=HEADS),
                     atb.FlashAttention(num_heads=HEADS, num_kv_heads=2, causal=True, kv_cache=True,
                                        hidden_size=H), atb.Linear(H, H), atb.ResidualAdd()])
    x = x_of(1, 6, H)
    with torch.no_grad():
        full = g(x)
        y, kv = g(x[:, :4], kv_cache=None)
        for i in (4, 5):  # positions P + arange(S) continue where the cache ends
            step, kv = g(x[:, i:i + 1], kv_cache=kv)
            atb.assert_close(step, full[:, i:i + 1], "fp32", f"decode at position {i}")
    atb.assert_close(y, full[:, :4], "fp32", "prefill")


def test_llama_decoder_layer_from_graph_ops_vs_hf():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4,
                      num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = LlamaDecoderLayer(cfg, 0).eval()
    attn = atb.GraphOp([atb.RmsNorm("input_layernorm", eps=1e-6),
                        atb.RoPE("rope", num_heads=4),
                        atb.FlashAttention("self_attn", num_heads=4, num_kv_heads=2, causal=True),
                        atb.Linear("o_proj", out_features=H, bias=False), atb.ResidualAdd()])
    mlp = atb.GraphOp([atb.RmsNorm("post_attention_layernorm", eps=1e-6),
                       atb.FusedFeedForward("mlp", intermediate_size=48), atb.ResidualAdd()])
    x = x_of(2, 6, H)
    attn(x[:, :1])
    sd = hf.state_dict()
    attn.load_state_dict({f"layers.{k.replace('self_attn.o_proj', 'o_proj')}": v
                          for k, v in sd.items() if "self_attn" in k or "input_layernorm" in k})
    mlp.load_state_dict({f"layers.{k}": v for k, v in sd.items()
                         if k.startswith("mlp") or "post_attention" in k})
    pos = torch.arange(6).expand(2, 6)
    mask = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = hf(x, attention_mask=mask, position_ids=pos,
                  position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))
        want = want[0] if isinstance(want, tuple) else want
        got = mlp(attn(x))
    atb.assert_close(got, want, "fp32", "GraphOp Llama decoder layer vs HF LlamaDecoderLayer")


def test_parameters_are_bound_zero_copy_and_rebound_on_change():
    blk = seeded_block()
    x = x_of(2, 4, H)
    with torch.no_grad():
        blk(x)
        core = blk.attention_graph.core
        ln = blk.attention_graph.layers.layer_norm
        assert core._bound["layer_norm.weight"].data_ptr() == ln.weight.data_ptr()
        mlp_core = blk.mlp_graph.core
        fc1 = blk.mlp_graph.layers.linear
        assert mlp_core._bound["linear.weight"].data_ptr() == fc1.weight.data_ptr()
        # load_state_dict copies in place: the next call sees the new values, the
        # fused (merged QKV) weight is recomputed
        new = seeded_block(seed=1)
        blk.load_state_dict(new.state_dict())
        ref = PlainBlock(H, HEADS, MLP)
        ref.load_state_dict(block_state_to_plain(new.state_dict()))
        y, _ = blk(x)
        atb.assert_close(y, ref(x)[0], "fp32", "after load_state_dict")
        want16 = ref.round_to(torch.bfloat16)(x.bfloat16().float())[0]
        fused = [t for t in blk.attention_graph.core._bound if "+" in t]
        assert fused, "the qkv fusion should have merged the projections"
        # .to() makes new tensors: rebound (and rebuilt for the new dtype)
        blk = blk.to(torch.bfloat16)
        y, _ = blk(x.bfloat16())
        atb.assert_close(y, want16, "bf16", "after .to(bf16)")
        assert blk.attention_graph.core._bound["layer_norm.weight"].data_ptr() == \
            ln.weight.data_ptr()


def test_kv_cache_forms_pairs_and_dict():
    blk = seeded_block()
    g = blk.attention_graph
    x = x_of(1, 5, H)
    with torch.no_grad():
        full, _ = g(x, kv_cache=None)
        y1, state = g(x[:, :3], kv_cache=None)
        k, v = state[g._key][0]
        y2, presents = g(x[:, 3:], kv_cache=(k, v))      # a bare (past_key, past_value) pair
    assert isinstance(presents, tuple) and presents[0].shape == (1, 5, H)
    atb.assert_close(torch.cat([y1, y2], 1), full, "fp32", "pairs form: prefill + continuation")
    with pytest.raises(atb.InputError, match="kv_cache"):
        g(x, kv_cache=[(k, v), (k, v)])


def test_plugins_and_forward_hooks():
    blk = seeded_block()
    x = x_of(2, 3, H)
    with torch.no_grad():

        class Zero(atb.Plugin):
            def postprocess(self, outputs):
                return [torch.zeros_like(t) for t in outputs]

        g = blk.attention_graph
        g.register_plugin("post_attention", Zero())   # the attention output, before o_proj
        y = g(x)  # no kv_cache= given: just the output
        atb.assert_close(y, x + g.layers["linear"].bias, "fp32", "post_attention plugin")
        seen = []
        assert atb.register_plugin(blk, "pre_block", atb.HookPlugin(
            pre=lambda ts: seen.append([t.shape for t in ts]))) == 2
        blk(x)
        assert seen[0][0] == (2, 3, H) and len(seen) == 2
        with pytest.raises(atb.ParamsError, match="plugin point"):
            blk.mlp_graph.register_plugin("nowhere", Zero())
        # standard nn.Module hooks on a GraphOp fire
        other = seeded_block()
        zero_out = other.mlp_graph(torch.zeros_like(x))
        h = other.mlp_graph.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
        got = other.mlp_graph(x)
        h.remove()
        assert torch.equal(got, zero_out) and not torch.equal(got, other.mlp_graph(x))
        seen_out = []
        other.mlp_graph.register_forward_hook(lambda m, args, out: seen_out.append(out))
        assert torch.equal(other.mlp_graph(x), seen_out[0])


def test_autograd_is_refused_with_atb_error():
    blk = seeded_block()
    y, _ = blk(x_of(1, 3, H))
    assert y.requires_grad
    with pytest.raises(atb.AtbError, match="inference-only"):
        y.sum().backward()
    model = AcceleratedLLaMA(20, H, 1, HEADS, MLP, max_batch=1, max_seq_len=8)
    with torch.no_grad():
        model(torch.tensor([[1]]))
    model.kv_cache.reset()
    logits = model(torch.tensor([[1, 2]]))  # the KVCache path, grad on
    with pytest.raises(atb.AtbError, match="inference-only"):
        logits.sum().backward()


def test_graph_op_from_builder_graph_and_save_load(tmp_path):
    import numpy as np

    b = atb.GraphBuilder("mlp")
    x = b.add_input("x", atb.TensorDesc([2, 8], atb.Dtype.FP32))
    w = b.add_weight("fc.weight", np.random.default_rng(0).standard_normal((4, 8)).astype("f4"))
    h, = b.add_node("Linear", [x, w], name="fc")
    y, = b.add_node("SiLU", [h])
    b.mark_output(y)
    g = atb.GraphOp(b.build())
    assert [k for k, _ in g.named_parameters()] == ["weights.fc_weight"]
    xs = x_of(2, 8)
    with torch.no_grad():
        want = nn.functional.silu(xs @ g.weights["fc_weight"].T)
        atb.assert_close(g(xs), want, "fp32", "GraphOp(graph)")
        g.weights["fc_weight"].mul_(2.0)  # in-place edit: rebound at the next call
        atb.assert_close(g(xs), nn.functional.silu(xs @ g.weights["fc_weight"].T), "fp32",
                         "after an in-place edit")
        blk = seeded_block()
        blk.mlp_graph(xs[:, None].expand(2, 3, 8).repeat(1, 1, 4))
        blk.mlp_graph.save(tmp_path / "mlp")
        loaded = atb.GraphOp.load(tmp_path / "mlp")
        z = x_of(2, 3, H)
        atb.assert_close(loaded(z), blk.mlp_graph(z), "fp32", "GraphOp.load(save())")


def test_deepcopy_and_torch_save_give_independent_graph_ops(tmp_path):
    import copy

    blk = seeded_block()
    x = x_of(1, 3, H)
    with torch.no_grad():
        want, _ = blk(x)
        twin = copy.deepcopy(blk)
        assert twin.attention_graph._handle != blk.attention_graph._handle
        got, _ = twin(x)
        atb.assert_close(got, want, "fp32", "deepcopy")
        twin.mlp_graph.layers["linear_1"].bias.add_(1.0)   # the copy's own parameters
        assert torch.equal(blk(x)[0], want) and not torch.equal(twin(x)[0], want)
        torch.save(blk, tmp_path / "blk.pt")
        loaded = torch.load(tmp_path / "blk.pt", weights_only=False)
        atb.assert_close(loaded(x)[0], want, "fp32", "torch.save / torch.load")


def test_construction_errors():
    from atbcore.graph import layers as core

    with pytest.raises(atb.ParamsError, match="atbcore layer"):
        atb.GraphOp([core.Linear(out_features=4)])
    with pytest.raises(atb.ParamsError, match="cannot be a GraphOp layer"):
        atb.GraphOp([atb.MatMul()])
    with pytest.raises(atb.ParamsError, match="used twice"):
        atb.GraphOp([atb.Linear("a", out_features=4), atb.Linear("a", out_features=4)])
    with pytest.raises(atb.InputError):
        atb.GraphOp([])
    g = atb.GraphOp([atb.Linear(4, 4)])
    with pytest.raises(atb.ShapeError):
        g(x_of(2, 5))
    g.destroy()
    with pytest.raises(atb.AtbError, match="destroyed"):
        g(x_of(2, 4))
