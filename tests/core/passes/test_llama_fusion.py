"""Acceptance: a LLaMA decoder layer from primitive ops fuses at ``standard`` into
RmsNormLinear (merged QKV) + FlashAttention + Linear (residual in its epilogue) +
FusedFeedForward (its RmsNorm and residual inside), and computes what
Hugging Face's LlamaDecoderLayer computes, before and after fusion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.passes.pipeline import FusionConfig, run_pipeline
from interp import run_graph
from llama_graphs import build_llama_layer_primitive, fused_ops, llama_weights

B, S, HID, NH, INTER = 2, 8, 64, 4, 128


def x_in(dtype="fp32", seed=1):
    return np.random.default_rng(seed).standard_normal((B, S, HID)).astype(
        atb.Dtype.of(dtype).numpy)


def fused(rope=True, mask="const", dtype="fp32", **cfg):
    g = build_llama_layer_primitive(B, S, HID, NH, INTER, dtype=dtype, rope=rope, mask=mask)
    out, reports = run_pipeline(g, FusionConfig(verify=True, **cfg))
    return g, out, reports


@pytest.mark.parametrize("rope", [True, False])
def test_standard_fuses_the_layer_to_four_nodes(rope):
    g, out, _ = fused(rope)
    assert len(g.nodes) == (38 if rope else 37)
    assert [n.op for n in out.nodes] == fused_ops(rope)
    qkv, attn, o, ffn = out.nodes
    assert qkv.inputs[:2] == ("x", "input_layernorm.weight")  # the norm inside the matmul
    w = out.weight_map[qkv.inputs[2]]
    ref = llama_weights(HID, NH, INTER)
    np.testing.assert_array_equal(w, np.concatenate([ref[f"self_attn.{p}_proj.weight"]
                                                     for p in "qkv"]))
    assert attn.inputs == (qkv.outputs[0],)          # packed QKV, no split
    assert attn.params.causal and attn.params.scale == pytest.approx(1 / np.sqrt(HID // NH))
    assert ffn.params.gate_up_merged and ffn.params.has_residual
    assert ffn.params.activation_type == "swiglu"
    assert o.inputs[4] == "x"                         # the residual add in o_proj's GEMM
    # the post-attention norm inside the FFN's first matmul; o_proj's sum its residual
    assert ffn.params.norm_eps == pytest.approx(1e-6)
    assert ffn.inputs[0] == o.outputs[0] == ffn.inputs[-2]
    assert ffn.inputs[-1] == "post_attention_layernorm.weight"
    # the weights the fused graph no longer needs are gone
    assert "self_attn.q_proj.weight" not in out.weight_map and "rms_eps" not in out.weight_map


def test_fused_equals_unfused():
    g, out, _ = fused()
    x = x_in()
    atb.assert_close(run_graph(out, [x])[0], run_graph(g, [x])[0], "fp32", "fused vs unfused")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_fusion_loses_no_accuracy(dtype):
    # A whole layer in a half type drifts from fp32 by more than one op's §5 bound
    # either way (every op rounds). What fusion must not do is make it worse: both
    # graphs are measured against the fp32 run of the same (rounded) weights/input.
    g, out, _ = fused(dtype=dtype)
    x = x_in(dtype)
    g32 = g.replace(weights=tuple((k, np.asarray(v).astype(np.float32)) for k, v in g.weights),
                    descs=tuple((k, d.replace(dtype="fp32")) for k, d in g.descs))
    gold = run_graph(g32, [x.astype(np.float32)])[0].astype(np.float64)
    err_unfused = np.abs(run_graph(g, [x])[0].astype(np.float64) - gold).mean()
    err_fused = np.abs(run_graph(out, [x])[0].astype(np.float64) - gold).mean()
    assert err_fused <= err_unfused, (err_fused, err_unfused)


def test_mask_input_stays_an_input_of_the_attention():
    g, out, _ = fused(rope=False, mask="input")
    attn = out.nodes[1]
    assert attn.op == "FlashAttention" and attn.inputs[-1] == "mask" and not attn.params.causal
    mask = np.triu(np.full((S, S), -1e9, np.float32), 1)
    atb.assert_close(run_graph(out, [x_in(), mask])[0], run_graph(g, [x_in(), mask])[0],
                     what="mask input")


@torch.no_grad()
def test_primitive_and_fused_layer_match_hugging_face():
    from transformers import LlamaConfig
    from hf_masks import eager_mask
    from transformers.masking_utils import causal_mask_function
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=HID, num_attention_heads=NH, num_key_value_heads=NH,
                      intermediate_size=INTER, rms_norm_eps=1e-6, attn_implementation="eager")
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    layer.load_state_dict({k: torch.from_numpy(v) for k, v in llama_weights(HID, NH, INTER).items()})
    x = torch.from_numpy(x_in())
    pos = torch.arange(S)[None].expand(B, S)
    emb = LlamaRotaryEmbedding(cfg)(x, pos)
    gold = layer(x, attention_mask=eager_mask(B, S, S, mask_function=causal_mask_function),
                 position_embeddings=emb)
    gold = gold[0] if isinstance(gold, tuple) else gold
    g, out, _ = fused()
    atb.assert_close(run_graph(g, [x.numpy()])[0], gold, "fp32", "primitive graph vs HF")
    atb.assert_close(run_graph(out, [x.numpy()])[0], gold, "fp32", "fused graph vs HF")


@pytest.mark.parametrize("switches,kept", [
    (("enable_qkv_fusion",), ["Linear", "Linear", "Linear", "Linear"]),
    (("enable_mha_fusion",), ["Softmax", "MatMul"]),
    # the attention residual rides in o_proj's GEMM unless that fusion is off (the norm
    # after it is inside the FFN either way, so no add+norm fusion is left to make)
    (("enable_linear_act_fusion",), ["Elewise"]),
    (("enable_ffn_fusion",), ["LinearActivation", "Elewise"]),
    (("enable_rope_fusion",), ["RoPE", "FlashAttention"]),
    (("enable_norm_fusion",), ["ReduceMean"]),
])
def test_each_switch_turns_its_fusion_off(switches, kept):
    _, out, reports = fused(**dict.fromkeys(switches, False))
    ops = [n.op for n in out.nodes]
    for op in set(kept):
        assert ops.count(op) >= kept.count(op), (switches, ops)
    assert len(out.nodes) > 4


def test_conservative_fuses_nothing_and_reports_every_pass():
    g, out, reports = fused(fusion_level="conservative")
    names = [r.name for r in reports]
    assert names[:4] == ["plugin:atb_graph_after_build", "fold_views", "cse", "dce"]
    assert not any(n.startswith("fuse:") for n in names)
    assert names[-1] == "plugin:atb_graph_before_plan"
    assert all(n.op in {n0.op for n0 in g.nodes} for n in out.nodes)
    # the only change: the key transpose folded into the score matmul
    assert len(out.nodes) == len(g.nodes) - 1


def test_standard_reports_each_rule_in_pipeline_order():
    _, _, reports = fused()
    fuse_reports = [r for r in reports if r.name.startswith("fuse:")]
    changed = [r.name[5:] for r in fuse_reports if r.changed]
    assert changed == ["rmsnorm", "ffn", "ffn_residual", "linear_residual", "norm_ffn",
                       "attention", "attention_bsnd", "attention_bsh", "qkv", "norm_linear",
                       "rope_attention", "packed_qkv"]
    qkv = next(r for r in reports if r.name == "fuse:qkv")
    assert "q_proj, k_proj, v_proj -> q_proj+k_proj+v_proj (Linear)" in qkv.detail
