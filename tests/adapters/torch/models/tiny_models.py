"""Tiny seeded Hugging Face models (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256)
for the compile tests, and left-padded prompt batches."""

from __future__ import annotations

import torch
import transformers as tf

__all__ = ["DECODERS", "tiny", "left_padded", "VOCAB", "assert_layouts"]

VOCAB = 256
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

# arch -> (config class, model class, extra config)
DECODERS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 6}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {"num_local_experts": 4,
                                                           "num_experts_per_tok": 2}),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, None),
}


def config(arch: str, **over):
    cfg_cls, _, extra = DECODERS[arch]
    if arch == "gpt2":
        kw = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        kw = dict(_COMMON, **extra)
    kw.update(over)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def tiny(arch: str, seed: int = 0, **over):
    """The HF model of ``arch`` with seeded random weights, eager attention, eval mode."""
    torch.manual_seed(seed)
    if arch == "bert":
        cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128,
                            **over)
        cfg._attn_implementation = "eager"
        return tf.BertModel(cfg).eval()
    return DECODERS[arch][1](config(arch, **over)).eval()


def left_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, max(lengths)] (pad id 0 on the left) and the 0/1 attention mask."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), s), generator=g)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, s - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def assert_layouts(compiled, want: str) -> None:
    """Every projection of a compiled model's core plan (QKV, o, gate|up, down, the LM
    head) packed its weight in the layout ``want`` names (after one call)."""
    with torch.no_grad():
        compiled(torch.ones(1, 2, dtype=torch.long))
    got = compiled.atb_runner.layouts()
    heads = [n for n in got if n.endswith(("qkv", ".o", "gate_up", "down", "lm_head"))]
    assert "lm_head" in heads and any(n.endswith("qkv") for n in heads), got
    assert all(want in got[n] for n in heads), got
