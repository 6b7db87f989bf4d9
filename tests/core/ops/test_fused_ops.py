"""The fused ops the graph passes emit: RopeFlashAttention (separate or packed QKV,
GQA, positions, masks) and LinearActivation — torch kernels vs the NumPy
reference, the unfused op chain, and Hugging Face's RoPE + torch SDPA."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand

B, S, NH, KV, HD = 2, 7, 4, 2, 16


def run(op, params, ins, backend="numpy"):
    return atb.Builder(backend=backend).build_operation(op, params).execute(ins)


@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_flash_attention_equals_rope_then_attention(dtype):
    q, k, v = (rand((B, S, h * HD), dtype, seed=i) for i, h in enumerate((NH, KV, KV)))
    pos = np.array([3, 4, 5, 6, 7, 8, 9])
    p = {"num_heads": NH, "num_kv_heads": KV, "causal": True, "rotary_type": "half"}
    fused = check_op("RopeFlashAttention", p, [q, k, v, pos])
    qr, kr = run("RoPE", {"num_heads": NH, "num_kv_heads": KV}, [q, k, pos])
    ref, = run("FlashAttention", {"num_heads": NH, "num_kv_heads": KV, "causal": True},
               [qr, kr, v])
    atb.assert_close(fused[0], ref, dtype, "fused vs RoPE -> FlashAttention")
    packed = check_op("RopeFlashAttention", p, [np.concatenate([q, k, v], -1), None, None, pos])
    atb.assert_close(packed[0], fused[0], dtype, "packed vs separate")


def test_rope_flash_attention_vs_hugging_face():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=NH * HD, num_attention_heads=NH, num_key_value_heads=KV,
                      head_dim=HD)
    q, k, v = (torch.from_numpy(rand((B, h, S, HD), seed=i)) for i, h in enumerate((NH, KV, KV)))
    pos = torch.arange(S)[None].expand(B, S)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos)
    qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
    gold = F.scaled_dot_product_attention(qr, kr.repeat_interleave(NH // KV, 1),
                                          v.repeat_interleave(NH // KV, 1), is_causal=True)
    ours, = run("RopeFlashAttention", {"num_heads": NH, "num_kv_heads": KV, "causal": True,
                                       "layout": "BNSD"}, [q, k, v], backend="torch")
    atb.assert_close(ours, gold, "fp32", "RopeFlashAttention vs HF RoPE + SDPA")


def test_rope_flash_attention_mask_and_bad_input():
    q = rand((B, S, NH * HD), seed=1)
    mask = np.triu(np.full((S, S), -1e9, np.float32), 1)
    p = {"num_heads": NH}
    got = check_op("RopeFlashAttention", p, [q, q, q, None, None, None, mask])
    qr, kr = run("RoPE", {"num_heads": NH, "num_kv_heads": NH}, [q, q])
    ref, = run("FlashAttention", p, [qr, kr, q, mask])
    atb.assert_close(got[0], ref, "fp32", "masked")
    check_error("RopeFlashAttention", p, [q, q], atb.InputError, "'k' or 'v' is missing")
    check_error("RopeFlashAttention", {"num_heads": NH, "rotary_type": "spiral"}, [q],
                atb.ParamsError, "rotary_type", build_error=True)
    check_error("RopeFlashAttention", p, [q, q, q, np.array([0, 1])], atb.ShapeError,
                "position_ids")
    check_error("RopeFlashAttention", {"num_heads": 5}, [q, q, q], atb.ShapeError, "heads")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_linear_activation(dtype, act):
    x, wt, b = rand((3, 5, 24), dtype, 1), rand((40, 24), dtype, 2, 0.2), rand((40,), dtype, 3)
    got = check_op("LinearActivation", {"activation_type": act}, [x, wt, b])
    fns = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
           "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
    tx, tw, tb = (torch.from_numpy(a.astype(np.float64)) for a in (x, wt, b))
    gold = fns[act](F.linear(tx, tw, tb)).numpy().astype(x.dtype)
    atb.assert_close(got[0], gold, dtype, f"LinearActivation {act} vs torch")


def test_linear_activation_bad_params():
    x, wt = rand((3, 24)), rand((40, 24))
    check_error("LinearActivation", {"activation_type": "swiglu"}, [x, wt], atb.ParamsError,
                "gated", build_error=True)
    check_error("LinearActivation", {"activation_type": "silu"}, [x, rand((40, 23))],
                atb.ShapeError, "in_features")
