"""compile(model, kv_cache_dtype="int8"): the KV cache as int8 with a per-token,
per-head scale: its bytes against a bf16 cache, and logits at 2,048 tokens of context
against the same compiled model with an fp32 cache (prefill and decode steps)."""

import pytest
import torch
import torch.nn.functional as F

from atb_torch.models import compile
from atb_torch.models.cache import ContiguousKVCache
from atb_torch.models.cache_int8 import Int8KVCache
from atbcore.errors import CapabilityError, ParamsError


@pytest.fixture(scope="module")
def llama64():
    """A seeded Llama with head_dim 64 (the usual size) and room for 2,100 positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=256, vocab_size=256,
                      max_position_embeddings=2100)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(3.0)  # sharper attention than HF's init
    return m


def test_int8_cache_bytes_and_round_trip():
    q = Int8KVCache(2, 1, 64, 2, 64, torch.bfloat16)
    b16 = ContiguousKVCache(2, 1, 64, 2, 64, torch.bfloat16)
    ratio = q.nbytes / b16.nbytes
    assert ratio == pytest.approx((64 + 2) / 128)  # 0.516: int8 plus an fp16 scale per head
    k = torch.randn(1, 5, 128)
    v = torch.randn(1, 5, 128) * 10
    q.write(1, k, v, 3)
    k2, v2 = q.view(1, 8)
    assert k2.dtype == torch.bfloat16 and k2.shape == (1, 8, 128)
    for got, want in ((k2[:, 3:], k), (v2[:, 3:], v)):
        step = want.view(1, 5, 2, 64).abs().amax(-1, keepdim=True) / 127
        err = (got.float().view(1, 5, 2, 64) - want.view(1, 5, 2, 64)).abs()
        assert (err <= step * 0.51 + want.view(1, 5, 2, 64).abs() * 2 ** -8).all()
    with pytest.raises(CapabilityError, match="int8"):
        q.layer(0)
    q.length = 8
    q.reserve(200)  # growing keeps the filled slots
    assert torch.equal(q.view(1, 8)[0], k2)


def test_int8_cache_logits_at_2048_tokens(llama64):
    ids = torch.randint(0, 256, (1, 2048), generator=torch.Generator().manual_seed(1))
    runs = {}
    for kvd in (None, "int8"):
        r = compile(llama64, kv_cache_dtype=kvd).atb_runner
        cache = r.new_cache(1, 2060)
        assert getattr(cache, "quantized", False) == (kvd == "int8")
        with torch.inference_mode():
            seen = [r.prefill(ids, cache).float().clone()]
            tok = seen[0].argmax(-1)
            for i in range(6):
                seen.append(r.decode(tok, cache).float().clone())
                tok = torch.tensor([(37 * i + 11) % 256])  # the same forced tokens for both
        runs[kvd] = seen
    cos = min(float(F.cosine_similarity(a, b, dim=-1).min())
              for a, b in zip(runs[None], runs["int8"]))
    agree = sum(bool((a.argmax(-1) == b.argmax(-1)).all()) for a, b in zip(runs[None], runs["int8"]))
    print(f"int8 KV cache at 2048 tokens: logits cosine min {cos:.6f}, argmax agreement "
          f"{agree}/{len(runs[None])}")
    assert cos >= 0.999


def test_int8_cache_through_hf_forward_and_errors(llama64):
    c = compile(llama64, kv_cache_dtype="int8")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        g = c.generate(ids, max_new_tokens=5, do_sample=False)
        ref = llama64.generate(ids, max_new_tokens=5, do_sample=False)
    assert g.shape == ref.shape  # HF's generate over the compiled model's int8 cache
    with pytest.raises(ParamsError, match="kv_cache_dtype"):
        compile(llama64, kv_cache_dtype="fp8")
