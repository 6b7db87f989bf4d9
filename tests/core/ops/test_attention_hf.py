"""FlashAttention against Hugging Face eager attention (an independent oracle):
LlamaAttention and MistralAttention (sliding window) built from small configs with
seeded weights, and ``eager_attention_forward`` with HF-built masks for decode,
chunked prefill and padded kv lengths."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, MistralConfig
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb,
                                                      eager_attention_forward)
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralRotaryEmbedding

import atbcore as atb
from hf_masks import eager_mask

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, attention_dropout=0.0)


def _seeded(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in module.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen) * 0.2)
    return module.eval()


def _ours_through_module(attn, x, cos, sin, params):
    """The module's projections + RoPE, our FlashAttention (BNSD), its o_proj."""
    b, s, _ = x.shape
    d = attn.head_dim
    q = attn.q_proj(x).view(b, s, -1, d).transpose(1, 2)  # [B, H, S, D]
    k = attn.k_proj(x).view(b, s, -1, d).transpose(1, 2)  # [B, Hkv, S, D]
    v = attn.v_proj(x).view(b, s, -1, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    op = atb.Builder().build_operation("FlashAttention", dict(params, layout="BNSD"))
    out, = op.execute([q.contiguous(), k.contiguous(), v.contiguous()])
    assert op.last_backend == "torch"
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))


@torch.no_grad()
def test_llama_attention_gqa_causal():
    cfg = LlamaConfig(**SMALL, attn_implementation="eager")
    attn = _seeded(LlamaAttention(cfg, layer_idx=0), 0)
    b, s = 2, 11
    x = torch.randn(b, s, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(s)[None].expand(b, s)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    mask = eager_mask(b, s, s, mask_function=causal_mask_function)
    gold, _ = attn(x, position_embeddings=(cos, sin), attention_mask=mask)
    ours = _ours_through_module(attn, x, cos, sin, {"num_heads": 4, "num_kv_heads": 2,
                                                    "causal": True})
    atb.assert_close(ours, gold, "fp32", "FlashAttention in LlamaAttention vs HF eager")


@torch.no_grad()
@pytest.mark.parametrize("window", [3, 6])
def test_mistral_attention_sliding_window(window):
    cfg = MistralConfig(**SMALL, sliding_window=window, attn_implementation="eager")
    attn = _seeded(MistralAttention(cfg, layer_idx=0), 2)
    b, s = 2, 13
    x = torch.randn(b, s, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s)[None].expand(b, s)
    cos, sin = MistralRotaryEmbedding(cfg)(x, pos)
    mask = eager_mask(b, s, s, mask_function=sliding_window_causal_mask_function(window))
    gold, _ = attn(x, position_embeddings=(cos, sin), attention_mask=mask)
    ours = _ours_through_module(attn, x, cos, sin, {"num_heads": 4, "num_kv_heads": 2,
                                                    "window": window})
    atb.assert_close(ours, gold, "fp32", f"FlashAttention vs MistralAttention window {window}")


class _Groups(torch.nn.Module):
    """What eager_attention_forward reads from its module."""

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.training = False


def _hf_eager(q, k, v, masks):
    """q [B, H, Sq, D], k/v [B, Hkv, Skv, D], per-entry HF float masks [1, 1, Sq, Skv]."""
    out, _ = eager_attention_forward(_Groups(q.shape[1] // k.shape[1]), q, k, v,
                                     torch.cat(masks), scaling=q.shape[-1] ** -0.5)
    return out  # [B, Sq, H, D]


@torch.no_grad()
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("sq", [1, 4])
def test_decode_and_chunked_prefill_with_seq_lens_vs_hf(sq, dtype):
    """Queries are the last ``sq`` positions of each sequence; the kv cache of each
    batch entry is right-padded to Skv and only its first seq_lens[b] keys are real."""
    b, h, hkv, d, skv = 3, 8, 2, 16, 20
    gen = torch.Generator().manual_seed(4)
    tdt = atb.Dtype.of(dtype).torch
    q = torch.randn(b, h, sq, d, generator=gen).to(tdt)
    k = torch.randn(b, hkv, skv, d, generator=gen).to(tdt)
    v = torch.randn(b, hkv, skv, d, generator=gen).to(tdt)
    lens = torch.tensor([20, 9, 5], dtype=torch.int32)
    masks = []
    for i, n in enumerate(lens.tolist()):
        pad = (torch.arange(skv) < n)[None]  # HF 2-D padding mask (True = real token)
        masks.append(eager_mask(1, sq, skv, q_offset=max(n - sq, 0), mask_function=causal_mask_function,
                                attention_mask=pad))
    gold = _hf_eager(q.float(), k.float(), v.float(), masks).transpose(1, 2)  # [B, H, Sq, D]
    op = atb.Builder().build_operation("FlashAttention", {"causal": True, "num_kv_heads": 2})
    out, = op.execute([q, k, v, lens])
    atb.assert_close(out, gold, dtype, "decode with seq_lens vs HF eager")


@torch.no_grad()
def test_bsh_decode_vs_hf_llama_gqa():
    """BSH decode step (the seed's layout) against HF eager with repeat_kv GQA."""
    b, h, hkv, d, skv = 2, 4, 1, 72, 31
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(b, 1, h * d, generator=gen)
    k = torch.randn(b, skv, hkv * d, generator=gen)
    v = torch.randn(b, skv, hkv * d, generator=gen)
    # BSH -> BNSD for HF: [B, S, H*D] -> [B, H, S, D]
    bnsd = [x.view(b, x.shape[1], -1, d).transpose(1, 2) for x in (q, k, v)]
    gold = _hf_eager(*bnsd, [eager_mask(1, 1, skv, q_offset=skv - 1)] * b).reshape(b, 1, h * d)
    out, = atb.Builder().build_operation("MhaV3", {"head_num": h, "kv_head_num": hkv,
                                                   "size_per_head": d, "is_causal": True}
                                         ).execute([q, k, v])
    atb.assert_close(out, gold, "fp32", "MhaV3 BSH decode vs HF eager")
    assert np.isfinite(out.numpy()).all()
