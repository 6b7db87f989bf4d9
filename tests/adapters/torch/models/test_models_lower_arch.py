"""Architectures beyond the Llama pattern lowered to the core graph: GPT-2 (LayerNorm
with bias, learned positions, biased GELU-tanh MLP, Conv1D weights, tied head),
Qwen3 (per-head q/k RmsNorm), scaled RoPE (llama3, linear, yarn, dynamic within its
length: cos/sin tables of the spec's frequencies) and other MLP activations; each
against Hugging Face's logits (prompt, then decode steps in the in-place cache form)
and greedy tokens."""

import numpy as np
import pytest
import torch

import atb_torch as atb
from atb_torch.models.lower import lower_decoder
from atbcore.errors import AtbError, CapabilityError
from atbcore.graph.graph_op_kv import run_in_place
from atbcore.memory import KVCache
from tiny_models import VOCAB, tiny


def _cache(model, batch, length=32, dtype="fp32"):
    c = model.config
    heads = c.num_attention_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    return KVCache(c.num_hidden_layers, batch, length, kv, hd, dtype=dtype)


def _prompt_then_steps(hf, op, ids, prompt, cache):
    with torch.no_grad():
        want = hf(ids).logits
        got = [op(ids[:, :prompt], kv_cache=cache)[0]]
        got += [op(ids[:, t:t + 1], kv_cache=cache)[0] for t in range(prompt, ids.shape[1])]
    return torch.cat(got, dim=1), want


ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
             "original_max_position_embeddings": 128},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
}
CASES = {"gpt2": ("gpt2", {}), "qwen3": ("qwen3", {}),
         "gpt2_layer_scaled": ("gpt2", {"scale_attn_by_inverse_layer_idx": True}),
         **{f"rope_{k}": ("llama", {"rope_parameters": v}) for k, v in ROPES.items()},
         "geglu": ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
         "llama_biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
         "relu_glu": ("qwen2", {"hidden_act": "relu"}),
         "mixtral_gelu": ("mixtral", {"hidden_act": "gelu"}),
         "plugin_relu2": ("llama", {"hidden_act": "relu2"})}  # the activations plugin's


@pytest.mark.parametrize("case", list(CASES))
def test_lowered_architecture_matches_hugging_face_for_prompt_and_decode_steps(case):
    arch, over = CASES[case]
    hf = tiny(arch, **over)
    op = lower_decoder(hf)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    cache = _cache(hf, 2)
    got, want = _prompt_then_steps(hf, op, ids, 7, cache)
    assert cache.seq_lens(layer=0)[:2].tolist() == [11, 11]
    atb.assert_close(got, want, "fp32", f"lowered {case} vs HF")
    nodes = op._in_place.graph.nodes
    ops = [n.op for n in nodes]
    layers = hf.config.num_hidden_layers
    assert "Concat" not in ops and ops.count("PagedAttention") == layers
    if arch == "gpt2":  # wte and wpe lookups; the residual + LayerNorm pairs fused
        assert ops.count("Embedding") == 2 and "RmsNorm" not in ops
        assert ops.count("AddLayerNorm") >= 1
        ffn = [n for n in nodes if n.op == "FusedFeedForward"]
        assert len(ffn) == layers and all(f.params.bias and f.params.activation_type ==
                                          "gelu_tanh" for f in ffn)
    if arch == "qwen3":  # q and k normed per head before RoPE + cache write
        norms = [n for n in nodes if n.op == "RmsNorm"]
        assert len(norms) == 2 * layers and ops.count("RopeKVCache") == layers
    if case.startswith("rope_"):  # one table pair shared by every layer, read by RoPE
        tables = [t for t, _ in op._in_place.graph.weights if t.startswith("rope_table")]
        assert len(tables) == 2
        assert all(tables[0] in n.inputs for n in nodes if n.op == "RopeKVCache")


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_lowered_greedy_tokens_equal_hf_generate_for_ragged_prompts(arch):
    """Prompts of different lengths packed (each row's positions start at 0, GPT-2's
    learned table included), then greedy decode steps: every row equals HF
    ``generate`` on its prompt alone."""
    hf = tiny(arch)
    op = lower_decoder(hf, last_token=True)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (4, 9, 6)]
    cache = _cache(hf, 3)
    with torch.no_grad():
        logits = run_in_place(op, torch.cat(prompts), cache, [len(p) for p in prompts])
        toks = [logits[:, 0].argmax(-1)]
        for _ in range(7):
            toks.append(op(toks[-1][:, None], kv_cache=cache)[0][:, 0].argmax(-1))
        for r, p in enumerate(prompts):
            want = hf.generate(p[None], max_new_tokens=8, do_sample=False,
                               pad_token_id=0)[0, len(p):]
            got = [int(t[r]) for t in toks][:len(want)]  # HF stops at EOS (id 2)
            assert got == want.tolist() and len(got) >= 2, f"row {r}"


def test_partial_rotary_rotates_only_the_first_rotary_dims(monkeypatch):
    """A spec with ``rotary_dim < head_dim`` (what plugin architectures describe):
    against HF Llama made to rotate only the first 8 of 16 dims per head."""
    import dataclasses

    import transformers.models.llama.modeling_llama as ml
    from atbcore.graph.graph_op import GraphOp
    from atbcore.models.arch import resolve_architecture
    from atbcore.models.decoder import decoder_layers

    rd, full = 8, ml.apply_rotary_pos_emb

    def partial(q, k, cos, sin, unsqueeze_dim=1):
        qr, kr = full(q[..., :rd], k[..., :rd], cos, sin, unsqueeze_dim)
        return torch.cat([qr, q[..., rd:]], -1), torch.cat([kr, k[..., rd:]], -1)

    monkeypatch.setattr(ml, "apply_rotary_pos_emb", partial)
    hf = tiny("llama")
    inv = 1e4 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    hf.model.rotary_emb.inv_freq = inv.float()
    arch = resolve_architecture(hf.config)
    spec = arch.describe(hf.config)
    spec = dataclasses.replace(spec, rope=dataclasses.replace(
        spec.rope, rotary_dim=rd, inv_freq=tuple(inv.float().double().tolist())))
    op = GraphOp(decoder_layers(spec, arch.extract(hf, spec)), name="partial")
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    got, want = _prompt_then_steps(hf, op, ids, 6, _cache(hf, 2))
    atb.assert_close(got, want, "fp32", "partial rotary vs HF")
    rope = [n for n in op._in_place.graph.nodes if n.op == "RopeKVCache"]
    assert rope and all(n.params.rotary_dim == rd for n in rope)


def test_dynamic_rope_is_refused_past_its_length_and_the_cache_is_untouched():
    """Dynamic NTK's frequencies change past ``max_position_embeddings``: within it
    the logits equal HF's; a step going past it raises and writes nothing."""
    hf = tiny("llama", rope_parameters=ROPES["dynamic"], max_position_embeddings=12)
    op = lower_decoder(hf)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = _cache(hf, 1)
    got, want = _prompt_then_steps(hf, op, ids, 9, cache)
    atb.assert_close(got, want, "fp32", "dynamic RoPE within its length")
    keys = cache.keys(0).clone()
    with pytest.raises(AtbError, match="cos/sin table"):
        op(ids[:, :1], kv_cache=cache)
    assert cache.seq_lens(layer=0)[:1].tolist() == [12] and torch.equal(cache.keys(0), keys)


@pytest.mark.parametrize("case", ["gpt2", "qwen3", "rope_yarn"])
def test_a_bf16_model_lowers_in_its_own_dtype(case):
    """bf16 weights and cache (the RoPE tables stay fp32, as the runner keeps them)."""
    arch, over = CASES[case]
    hf = tiny(arch, **over).to(torch.bfloat16)
    op = lower_decoder(hf)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    got, want = _prompt_then_steps(hf, op, ids, 6, _cache(hf, 2, dtype="bf16"))
    assert got.dtype == torch.bfloat16
    atb.assert_close(got.float(), want.float(), "bf16", f"lowered bf16 {case} vs HF")


def test_rope_table_equals_hugging_face_rotary_embedding():
    """The cos/sin table the lowering builds from a scaled spec is HF's own
    rotary embedding at those positions (llama3 frequencies, yarn's attention factor)."""
    from atbcore.graph.layers_position import rope_table
    from atbcore.models.hf_arch import rope_spec

    for rope in ("llama3", "yarn"):
        hf = tiny("llama", rope_parameters=ROPES[rope])
        spec = rope_spec(hf.config, 16)
        cos, sin = rope_table(spec.inv_freq, 40, spec.attention_factor)
        x = torch.zeros(1, 40, 64)
        want_cos, want_sin = hf.model.rotary_emb(x, torch.arange(40)[None])
        np.testing.assert_allclose(cos, want_cos[0].numpy(), rtol=0, atol=2e-6)
        np.testing.assert_allclose(sin, want_sin[0].numpy(), rtol=0, atol=2e-6)


def test_gated_activation_registers_the_gated_form_of_any_activation():
    from atbcore.ops.activation_fns import gated_activation, get_activation

    assert gated_activation("silu") == "swiglu" and gated_activation("gelu_tanh") == "geglu_tanh"
    name = gated_activation("relu")
    x = np.random.default_rng(0).standard_normal((3, 8))
    np.testing.assert_array_equal(get_activation(name).numpy(x), np.maximum(x[:, :4], 0) * x[:, 4:])
    with pytest.raises(AtbError, match="already gated"):
        gated_activation("swiglu")


def test_models_the_lowering_does_not_cover_are_refused_by_name():
    from atbcore.models.arch import resolve_architecture
    from atbcore.models.decoder import why_not_lowered

    bert = tiny("bert")
    spec = resolve_architecture(bert.config).describe(bert.config)
    assert "decoders only" in why_not_lowered(spec) and "post-norm" in why_not_lowered(spec)
    with pytest.raises(CapabilityError, match="decoders only"):
        lower_decoder(bert)


def test_gpt2_past_its_learned_positions_is_refused_and_the_cache_is_untouched():
    hf = tiny("gpt2", n_positions=8)
    op = lower_decoder(hf)
    cache = _cache(hf, 1)
    with torch.no_grad():
        op(torch.randint(3, VOCAB, (1, 8)), kv_cache=cache)
        keys = cache.keys(0).clone()
        with pytest.raises(AtbError, match="8 rows"):
            op(torch.randint(3, VOCAB, (1, 1)), kv_cache=cache)
    assert cache.seq_lens(layer=0)[:1].tolist() == [8] and torch.equal(cache.keys(0), keys)
