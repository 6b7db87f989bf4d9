"""A decoder's atb layers, from a framework-neutral :class:`~.arch.ModelSpec` and its
weights (NumPy arrays or any framework's tensors): what every front-end lowers a
Hugging Face decoder to (``atb_torch.models.lower.lower_decoder`` from a torch model,
``atb_mindspore.LLM`` / ``atb_paddle.LLM`` from a safetensors checkpoint).

    layers = decoder_layers(spec, weights)       # embedding ... final norm, LM head
    op = GraphOp(layers, name=spec.arch)         # ids [B, S] -> logits [B, S, V]
    logits, cache = op(ids, kv_cache=atbcore.memory.KVCache(...))

The model becomes a list of atb layers (embedding; per block RmsNorm, the merged QKV
Linear, RoPE, FlashAttention with a KV cache, the output projection, a residual
add, RmsNorm, the gated FFN, a residual add; final RmsNorm and LM head); the one pass
pipeline fuses them (norms into the following matmuls, residual adds into GEMM
epilogues, RoPE with the cache write). Covered: pre-norm RmsNorm decoders with
default RoPE (full rotary), gated SiLU MLPs or top-k routed experts (one ``MoE``
node per block), GQA, q/k/v biases and sliding windows (Llama, Qwen2, Mistral,
Mixtral); anything else raises ``CapabilityError`` naming what is missing. With
``last_token`` the final norm and LM head run each sequence's last token only
(:class:`~atbcore.graph.layers_block.LastToken`: logits ``[B, 1, V]``, what
generation reads). With ``quantize`` ("w8", "w8a8", "w4") every projection is a
quantized Linear (:mod:`.quant`), the FFN runs as gate|up Linear, SwiGLU, down
Linear (the fused FFN op is float only) and MoE experts are quantized in their node.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import CapabilityError
from ..graph import layers as L
from ..graph.layers import host_array
from ..graph.layers_attention import FlashAttention, FusedFeedForward, RoPE
from ..graph.layers_block import LastToken
from ..graph.op_layer import OpLayer
from .arch import ModelSpec, ModelWeights
from .quant import check_quantize, linear_layer, quantized_experts

__all__ = ["decoder_layers", "why_not_lowered", "host_weight", "moe_layer"]

_FLOATS = (Dtype.FP32, Dtype.FP16, Dtype.BF16)


def why_not_lowered(spec: ModelSpec) -> str:
    """Why ``spec`` cannot be lowered by :func:`decoder_layers` ("" when it can)."""
    r = spec.rope
    checks = [
        (spec.kind != "decoder", f"a {spec.kind} model (decoders only)"),
        (spec.norm != "rms", f"{spec.norm} norms (RmsNorm only)"),
        (spec.post_norm, "post-norm blocks"),
        (spec.qk_norm, "q/k norms"),
        (spec.position != "rope" or r is None, f"{spec.position} positions (RoPE only)"),
        (r is not None and (r.rope_type != "default" or r.rotary_dim != spec.head_dim
                            or r.attention_factor != 1.0),
         "RoPE scaling or partial rotary (default full RoPE only)"),
        (not spec.gated or spec.activation != "silu",
         f"{'gated ' if spec.gated else ''}{spec.activation} MLPs (gated SiLU only)"),
    ]
    return "; ".join(why for bad, why in checks if bad)


def host_weight(t: Any) -> np.ndarray | None:
    """A weight as a host array in the model's float dtype (fp32/fp16/bf16; a view
    of a contiguous CPU tensor, of any framework, where NumPy has the dtype)."""
    if t is None:
        return None
    if not isinstance(t, np.ndarray):
        if hasattr(t, "detach"):
            t = t.detach()
        if hasattr(t, "is_contiguous") and not t.is_contiguous():
            t = t.contiguous()
    a = host_array(t)
    if Dtype.of(a.dtype) not in _FLOATS:
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


_a = host_weight  # short for the layer list below


def _base(spec: ModelSpec) -> float:
    """The RoPE base whose default frequencies are the spec's ``inv_freq``."""
    inv = spec.rope.inv_freq
    return float(inv[1] ** (-spec.rope.rotary_dim / 2.0)) if len(inv) > 1 else 10000.0


def moe_layer(name: str, spec: ModelSpec, lw: Any, to_array: Any = host_weight,
              quantize: str | None = None) -> OpLayer:
    """Block ``lw``'s experts as one ``MoE`` node named ``name`` (router ``[E, H]``,
    experts' gate|up ``[E, 2I, H]`` gate rows first, down ``[E, H, I]``: fp32 softmax
    routing over all experts, top-k renormalised when the spec says so, the chosen
    experts' SwiGLU FFNs weighted and summed, as Hugging Face's Mixtral block);
    ``quantize``: the experts' weights quantized as Linears are (:mod:`.quant`)."""
    m = spec.moe
    params = {"num_experts": m.num_experts, "top_k": m.top_k,
              "norm_topk_prob": m.norm_topk_prob, "activation_type": "swiglu"}
    if quantize is None:
        return OpLayer(name, op="MoE", kind="moe", params=params,
                       weights={"router_w": to_array(lw.router),
                                "w_gate_up": to_array(lw.experts_gate_up),
                                "w_down": to_array(lw.experts_down)})
    gu = quantized_experts(to_array(lw.experts_gate_up), quantize, "gate_up")
    dn = quantized_experts(to_array(lw.experts_down), quantize, "down")
    weights = {"router_w": to_array(lw.router), "w_gate_up": gu["w_gate_up"],
               "w_down": dn["w_down"], "gate_up_scale": gu["gate_up_scale"],
               "down_scale": dn["down_scale"]}
    if "gate_up_zeros" in gu and "down_zeros" in dn:
        weights.update(gate_up_zeros=gu["gate_up_zeros"], down_zeros=dn["down_zeros"])
    params.update(quant=quantize, group_size=32)
    return OpLayer(name, op="MoE", kind="moe", params=params, weights=weights, cast=False)


def _ffn(i: int, spec: ModelSpec, lw: Any, quantize: str | None) -> list[Any]:
    """Block ``i``'s MLP: one fused FFN node (float), the routed experts, or the
    quantized gate|up Linear, SwiGLU and down Linear."""
    if spec.moe is not None:
        return [moe_layer(f"l{i}.mlp", spec, lw, quantize=quantize)]
    if quantize is None:
        return [FusedFeedForward(f"l{i}.mlp", intermediate_size=spec.intermediate_size,
                                 activation_type="swiglu").load_weights(
            {"gate_proj.weight": _a(lw.gate), "up_proj.weight": _a(lw.up),
             "down_proj.weight": _a(lw.down)})]
    return [linear_layer(f"l{i}.gate_up", [lw.gate, lw.up], [None, None], quantize, _a),
            L.SwiGLU(f"l{i}.act"),
            linear_layer(f"l{i}.down", [lw.down], [None], quantize, _a)]


def decoder_layers(spec: ModelSpec, w: ModelWeights, last_token: bool = False,
                   quantize: str | None = None) -> list[Any]:
    """The atb layers computing the model (see the module docstring). ``w``'s
    tensors may be NumPy arrays or any framework's CPU tensors; ``quantize``: None,
    "w8", "w8a8" or "w4" (:mod:`.quant`)."""
    why = why_not_lowered(spec)
    if why:
        raise CapabilityError("lower_decoder", why, "a Llama-family decoder", spec.arch)
    quantize = check_quantize(quantize)
    base = _base(spec)
    layers: list[Any] = [OpLayer("embed", op="Embedding", kind="embedding",
                                 weights={"weight": _a(w.embed)}, x_index=1)]
    prev = "embed"
    for i, lw in enumerate(w.layers):
        layers += [
            L.RmsNorm(f"l{i}.attn_norm", eps=spec.norm_eps).load_weights(
                {"weight": _a(lw.attn_norm)}),
            linear_layer(f"l{i}.qkv", [lw.q, lw.k, lw.v], [lw.q_b, lw.k_b, lw.v_b], quantize, _a),
            RoPE(f"l{i}.rope", base=base),
            FlashAttention(f"l{i}.attn", num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                           head_dim=spec.head_dim, causal=True, kv_cache=True,
                           scale=spec.scales[i], window=spec.windows[i]),
            linear_layer(f"l{i}.o", [lw.o], [lw.o_b], quantize, _a),
            L.ResidualAdd(f"l{i}.attn_out", residual=prev),
            L.RmsNorm(f"l{i}.mlp_norm", eps=spec.norm_eps).load_weights(
                {"weight": _a(lw.mlp_norm)}),
            *_ffn(i, spec, lw, quantize),
            L.ResidualAdd(f"l{i}.out", residual=f"l{i}.attn_out")]
        prev = f"l{i}.out"
    if last_token:
        layers.append(LastToken("last_token"))
    layers.append(L.RmsNorm("final_norm", eps=spec.norm_eps).load_weights(
        {"weight": _a(w.final_norm)}))
    layers.append(linear_layer("lm_head", [w.lm_head], [w.lm_head_b], quantize, _a))
    return layers
