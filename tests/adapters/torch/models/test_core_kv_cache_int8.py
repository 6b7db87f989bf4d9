"""``compile(model, kv_cache_dtype="int8")`` on the core engine: RowKVCache with int8
rows and fp16 scales (bytes, growth, beam reordering, Hugging Face's dequantized
view, a converted cache quantized on the way in) and a left-padded batch against
the same model over a float cache (logits cosine; greedy agreement printed)."""

import pytest
import torch
import torch.nn.functional as F

from atb_torch.models.core_runner import CoreRunner, why_not_core
from atb_torch.models.row_cache import RowKVCache
from atbcore.errors import InputError

L, B, HKV, D = 2, 2, 2, 64


def _step(x):  # half a quantization step per head: |x - deq| <= s / 2, s = absmax / 127
    return x.abs().amax(-1, keepdim=True) / 127 * 0.5 + x.abs() * 2 ** -10


def test_row_cache_int8_bytes_growth_select_and_hf_view():
    c8 = RowKVCache(L, B, 8, HKV, D, torch.bfloat16, kv_dtype="int8")
    c16 = RowKVCache(L, B, 8, HKV, D, torch.bfloat16)
    assert c8.quantized and not c16.quantized
    assert c8.nbytes / c16.nbytes == pytest.approx((D + 2) / (2 * D))  # 0.516 of bf16
    k, v = torch.randn(B, 6, HKV, D), torch.randn(B, 6, HKV, D) * 10
    c8.write(1, k, v, 0)
    c8.length = 6
    c8._lens[:] = 6
    got = c8.hf_view(1, 1)                                   # [B, Hkv, length, D]
    assert got.dtype == torch.bfloat16 and got.shape == (B, HKV, 6, D)
    assert ((got.float().transpose(1, 2) - v).abs() <= _step(v) + v.abs() * 2 ** -8).all()
    before = [c8.hf_view(layer, w).clone() for layer in range(L) for w in (0, 1)]
    c8.reserve(40)                                           # rows and scales move together
    assert c8.capacity >= 40 and c8.version == 1
    assert c8.nbytes / RowKVCache(L, B, c8.capacity, HKV, D, torch.bfloat16).nbytes == \
        pytest.approx((D + 2) / (2 * D))
    after = [c8.hf_view(layer, w) for layer in range(L) for w in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    c8.select(torch.tensor([1, 0]))                          # beam reordering
    assert torch.equal(c8.hf_view(1, 1), before[3][[1, 0]])
    with pytest.raises(InputError, match="kv_dtype"):
        RowKVCache(L, B, 8, HKV, D, torch.float32, kv_dtype="fp8")
    c8.free(), c16.free()


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, vocab_size=256)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return m


def test_left_padded_batch_over_an_int8_cache_matches_the_float_cache(llama):
    assert why_not_core(CoreRunner.from_hf(llama).spec, None, "int8") == ""
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :13] = 0                                         # row 1 left-padded
    runs = {}
    for kvd in (None, "int8"):
        r = CoreRunner.from_hf(llama, kv_cache_dtype=kvd)
        cache = r.new_cache(2, 8)                            # grows while prefilling
        assert cache.quantized == (kvd == "int8")
        with torch.inference_mode():
            seen = [r.prefill(ids, cache, attention_mask=mask).float().clone()]
            for i in range(5):
                tok = torch.tensor([(7 * i + 1) % 256, (11 * i + 5) % 256])
                seen.append(r.decode(tok, cache).float().clone())
        runs[kvd] = seen
        if kvd == "int8":
            nodes = [n.op for n in r.op._in_place.graph.nodes]
            assert "PagedAttentionInt8" in nodes and "PagedAttention" not in nodes
    cos = min(float(F.cosine_similarity(a, b, dim=-1).min())
              for a, b in zip(runs[None], runs["int8"]))
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(runs[None],
                                                                           runs["int8"]))
    print(f"int8 KV cache, left-padded batch: logits cosine min {cos:.6f}, greedy agreement "
          f"{agree}/{2 * len(runs[None])}")
    assert cos >= 0.999
