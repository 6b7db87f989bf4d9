"""The llama.cpp baseline of the benchmarks: a tiny HF Llama written as GGUF (F32 and
Q4_0) and run by llama-cpp-python, its logits along HF's greedy path against HF fp32
(the F32 file must match HF; Q4_0 is what the w4 comparison reports). Needs the
optional llama-cpp-python + gguf (the llamacpp extra)."""

import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=320,
                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("qtype,bound", [("F32", 0.9999), ("Q4_0", 0.95)])
def test_gguf_logits_along_hf_path(tiny_llama, qtype, bound):
    from atb_torch.llm.bench.decoder import _accuracy
    from atb_torch.llm.bench.hf import hf_greedy
    from atb_torch.llm.bench.llamacpp import LlamaCppDecoder

    ids = torch.randint(3, 320, (1, 10), generator=torch.Generator().manual_seed(4))
    ref = hf_greedy(tiny_llama, ids, 6, record=True)
    dec = LlamaCppDecoder.create(tiny_llama, qtype, 1, 32)
    assert not isinstance(dec, dict), dec
    got = dec.greedy(ids, 6, record=True, forced=ref.tokens)
    assert len(got.logits) == 6 and got.logits[0].shape == (1, 320)
    assert torch.equal(got.tokens, ref.tokens)  # forced: HF's path exactly
    acc = _accuracy(ref, got)
    print(f"llama.cpp {qtype}: logits cosine to HF fp32 {acc['logits_cosine_min']:.6f}")
    assert acc["logits_cosine_min"] >= bound
