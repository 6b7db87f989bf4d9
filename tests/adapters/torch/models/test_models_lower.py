"""A Hugging Face decoder lowered to one core GraphOp (atb layers, the pass pipeline,
the in-place KV cache): logits against Hugging Face's own forward, for the prompt and
for decode steps, and greedy tokens against HF generate."""

import pytest
import torch

import atb_torch as atb
from atb_torch.models.lower import lower_decoder
from atbcore.memory import KVCache
from tiny_models import VOCAB, tiny


def _cache(model, batch, length=32, dtype="fp32"):
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return KVCache(c.num_hidden_layers, batch, length, c.num_key_value_heads, hd, dtype=dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_lowered_decoder_matches_hugging_face_for_prompt_and_decode_steps(arch):
    hf = tiny(arch)
    op = lower_decoder(hf)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    cache = _cache(hf, 2)
    with torch.no_grad():
        want = hf(ids).logits
        got, back = op(ids[:, :7], kv_cache=cache)  # prompt, then one token per call
        steps = [got] + [op(ids[:, t:t + 1], kv_cache=cache)[0] for t in range(7, 11)]
    assert back is cache and cache.seq_lens(layer=0)[:2].tolist() == [11, 11]
    atb.assert_close(torch.cat(steps, dim=1), want, "fp32", f"lowered {arch} vs HF")
    nodes = op._in_place.graph.nodes
    ops = [n.op for n in nodes]
    # the pipeline's fusions: the norms inside the QKV and FFN matmuls, the attention
    # residual in o_proj's GEMM, the FFN's residual in its down projection
    layers = hf.config.num_hidden_layers
    # (the final norm goes into the LM head too)
    assert ops.count("RmsNormLinear") == layers + 1 and "Concat" not in ops
    assert "AddRmsNorm" not in ops and "RmsNorm" not in ops
    ffns = [n for n in nodes if n.op == "FusedFeedForward"]
    assert len(ffns) == layers and all(f.params.norm_eps and f.params.has_residual for f in ffns)
    assert sum(1 for n in nodes if n.op == "Linear" and len(n.inputs) == 5) == layers
    assert ops.count("PagedAttention") == layers


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_last_token_lowering_gives_each_rows_last_logits(arch):
    """``last_token=True``: the final norm and LM head run one row per sequence
    (``[B, 1, V]``, what generation reads), equal to HF's last-position logits for the
    prompt and for each decode step."""
    hf = tiny(arch)
    op = lower_decoder(hf, last_token=True)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    cache = _cache(hf, 2)
    with torch.no_grad():
        want = hf(ids).logits
        got = [op(ids[:, :7], kv_cache=cache)[0]]
        got += [op(ids[:, t:t + 1], kv_cache=cache)[0] for t in range(7, 10)]
    assert all(g.shape == (2, 1, VOCAB) for g in got)
    atb.assert_close(torch.cat(got, dim=1), want[:, 6:], "fp32", f"last-token {arch} vs HF")
    # the LM head reads the gathered last rows, not the per-token hidden states
    nodes = {n.name: n for n in op._in_place.graph.nodes}
    assert nodes["last_token"].op == "Gather"
    head = next(n for n in op._in_place.graph.nodes if n.outputs[0] in op._in_place.graph.outputs)
    assert head.inputs[0] == "last_token"


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prompts_of_different_lengths_go_in_packed_and_decode_ragged(arch):
    """A batch of prompts of different lengths without padding (packed, ``q_lens``),
    then greedy steps with each row at its own length: every row's tokens equal HF
    ``generate`` on that prompt alone."""
    from atbcore.graph.graph_op_kv import run_in_place

    hf = tiny(arch)
    op = lower_decoder(hf, last_token=True)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (4, 9, 6)]
    cache = _cache(hf, 3)
    with torch.no_grad():
        logits = run_in_place(op, torch.cat(prompts), cache, [len(p) for p in prompts])
        toks = [logits[:, 0].argmax(-1)]
        for _ in range(5):
            toks.append(op(toks[-1][:, None], kv_cache=cache)[0][:, 0].argmax(-1))
        for r, p in enumerate(prompts):
            want = hf.generate(p[None], max_new_tokens=6, do_sample=False,
                               pad_token_id=0)[0, len(p):]
            assert [int(t[r]) for t in toks] == want.tolist(), f"row {r}"
    assert cache.seq_lens(layer=0)[:3].tolist() == [len(p) + 5 for p in prompts]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_half_model_lowers_in_its_own_dtype(dtype):
    """The weights keep the model's dtype (no fp32 copy); logits of the prompt and of
    decode steps within that dtype's tolerance of Hugging Face's forward."""
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    hf = tiny("llama").to(tdt)
    op = lower_decoder(hf)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    cache = _cache(hf, 2, dtype=dtype)
    with torch.no_grad():
        want = hf(ids).logits
        got = [op(ids[:, :6], kv_cache=cache)[0]]
        got += [op(ids[:, t:t + 1], kv_cache=cache)[0] for t in range(6, 9)]
    out = torch.cat(got, dim=1)
    assert out.dtype == tdt
    atb.assert_close(out.float(), want.float(), dtype, f"lowered {dtype} Llama vs HF")
    from atbcore.dtypes import Dtype
    assert {Dtype.of(w.dtype) for _, w in op.graph.weights} == {Dtype.of(dtype)}


def test_lowered_decoder_greedy_tokens_equal_hf_generate():
    hf = tiny("llama")
    op = lower_decoder(hf)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    want = hf.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    cache = _cache(hf, 1)
    with torch.no_grad():
        logits, _ = op(ids, kv_cache=cache)
        seq = ids
        for _ in range(10):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, tok], dim=1)
            logits, _ = op(tok, kv_cache=cache)
    assert torch.equal(seq, want)


def test_lowered_mixtral_moe_matches_hugging_face_logits_and_generate():
    """Mixtral's experts as one core MoE node per layer (:mod:`.lower_moe`): logits of
    the prompt and of decode steps within fp32 tolerance of HF, greedy == HF generate;
    a batch of 2 routes tokens to different experts in one call."""
    hf = tiny("mixtral")
    op = lower_decoder(hf)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    cache = _cache(hf, 2)
    with torch.no_grad():
        want = hf(ids).logits
        steps = [op(ids[:, :6], kv_cache=cache)[0]]
        steps += [op(ids[:, t:t + 1], kv_cache=cache)[0] for t in range(6, 10)]
    atb.assert_close(torch.cat(steps, dim=1), want, "fp32", "lowered Mixtral vs HF")
    ops = [n.op for n in op._in_place.graph.nodes]
    assert ops.count("MoE") == hf.config.num_hidden_layers and "FusedFeedForward" not in ops
    want_ids = hf.generate(ids[:1, :6], max_new_tokens=10, do_sample=False, pad_token_id=0)
    cache = _cache(hf, 1)
    with torch.no_grad():
        logits, seq = op(ids[:1, :6], kv_cache=cache)[0], ids[:1, :6]
        for _ in range(10):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, tok], dim=1)
            logits = op(tok, kv_cache=cache)[0]
    assert torch.equal(seq, want_ids)
