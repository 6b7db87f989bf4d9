"""A local checkpoint directory for LLM tests: a seeded random tiny Llama saved with
``save_pretrained(safe_serialization=True)`` and a byte-level BPE tokenizer trained
here on a few sentences (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is atb speaking from a tiny model",
    "a small tokenizer trained inside a test on a few sentences",
    "numbers 0 1 2 3 4 5 6 7 8 9 and letters a b c d e f",
    "one two three four five six seven eight nine ten",
    "continuous batching serves many prompts at once without padding",
]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def build_checkpoint(path: Path, seed: int = 0, layers: int = 2, arch: str = "llama") -> Path:
    """Write the tiny checkpoint into ``path`` and return it. ``arch``: "llama",
    "qwen2" (q/k/v biases, given random values: HF starts them at zero) or
    "mistral" (a sliding window of 8 tokens)."""
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 8})}
    cfg_cls, model_cls, extra = classes[arch]
    path = Path(path)
    tok = build_tokenizer()
    tok.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = cfg_cls(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=len(tok),
                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, rms_norm_eps=1e-6, tie_word_embeddings=False, **extra)
    model = model_cls(cfg).eval()
    # larger weights than HF's 0.02 init: sharper logits, so argmax ties are rare
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path
