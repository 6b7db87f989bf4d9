"""A decoder's atb layers, from a framework-neutral :class:`~.arch.ModelSpec` and its
weights (NumPy arrays or any framework's tensors): what every front-end lowers a
Hugging Face decoder to (``atb_torch.models.lower.lower_decoder`` from a torch model,
``atb_mindspore.LLM`` / ``atb_paddle.LLM`` from a safetensors checkpoint).

    layers = decoder_layers(spec, weights)       # embedding ... final norm, LM head
    op = GraphOp(layers, name=spec.arch)         # ids [B, S] -> logits [B, S, V]
    logits, cache = op(ids, kv_cache=atbcore.memory.KVCache(...))

The model becomes a list of atb layers (embedding, plus learned positions for
GPT-2; per block the norm (RmsNorm, or LayerNorm with bias), the merged QKV Linear,
RoPE, FlashAttention with a KV cache (q/k RmsNorm per head for Qwen3), the output
projection, a residual add, the norm, the FFN or MoE, a residual add; final norm
and LM head); the one pass pipeline fuses them (RmsNorms into the following
matmuls, residual adds into GEMM epilogues and Add+LayerNorm, RoPE with the cache
write). The per-feature layers are :mod:`.decoder_parts`. Covered: pre-norm
decoders with RmsNorm or LayerNorm, RoPE of any frequencies (default by base;
llama3, linear, yarn, dynamic NTK within its length ... as a cos/sin table of the
spec's ``inv_freq`` and ``attention_factor``), partial rotary, or learned absolute
positions; gated or plain MLPs of any registered activation, with or without
biases, or top-k routed experts (one ``MoE`` node per block); GQA, q/k/v biases,
q/k norms, sliding windows (Llama, Qwen2, Qwen3, Mistral, Mixtral, GPT-2); anything
else raises ``CapabilityError`` naming what is missing (:func:`why_not_lowered`).
With ``last_token`` the final norm and LM head run each sequence's last token only
(:class:`~atbcore.graph.layers_block.LastToken`: logits ``[B, 1, V]``, what
generation reads). With ``quantize`` ("w8", "w8a8", "w4") every projection is a
quantized Linear (:mod:`.quant`), the FFN runs as (gate|)up Linear, its activation,
down Linear (the fused FFN op is float only) and MoE experts are quantized in their
node.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import AtbError, CapabilityError
from ..graph import layers as L
from ..graph.layers import host_array
from ..graph.layers_block import LastToken
from ..graph.op_layer import OpLayer
from . import decoder_parts as P
from .arch import ModelSpec, ModelWeights
from .quant import check_quantize, linear_layer, quantized_experts

__all__ = ["decoder_layers", "why_not_lowered", "host_weight", "moe_layer", "ffn_activation"]

_FLOATS = (Dtype.FP32, Dtype.FP16, Dtype.BF16)


def why_not_lowered(spec: ModelSpec) -> str:
    """Why ``spec`` cannot be lowered by :func:`decoder_layers` ("" when it can)."""
    r = spec.rope
    checks = [
        (spec.kind != "decoder", f"a {spec.kind} model (decoders only)"),
        (spec.norm not in ("rms", "layer"), f"{spec.norm} norms (RmsNorm or LayerNorm)"),
        (spec.post_norm, "post-norm blocks"),
        (spec.embed_norm or spec.type_vocab_size, "embedding norms or token types"),
        (spec.position not in ("rope", "learned") or (spec.position == "rope") != (r is not None),
         f"{spec.position} positions (RoPE or learned)"),
        (spec.moe is not None and not spec.gated, "MoE experts without a gate (gated only)"),
    ]
    why = [w for bad, w in checks if bad]
    try:
        ffn_activation(spec)
    except AtbError as e:
        why.append(f"the {spec.activation} MLP activation ({e})")
    return "; ".join(why)


def ffn_activation(spec: ModelSpec) -> str:
    """The FusedFeedForward activation of ``spec``'s MLP (``silu`` gated ->
    ``swiglu``; any registered activation, plugins' included)."""
    from ..ops.activation_fns import gated_activation, get_activation

    if spec.gated:
        return gated_activation(spec.activation, "lower_decoder")
    return get_activation(spec.activation, "lower_decoder").name


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


def moe_layer(name: str, spec: ModelSpec, lw: Any, to_array: Any = host_weight,
              quantize: str | None = None) -> OpLayer:
    """Block ``lw``'s experts as one ``MoE`` node named ``name`` (router ``[E, H]``,
    experts' gate|up ``[E, 2I, H]`` gate rows first, down ``[E, H, I]``: fp32 softmax
    routing over all experts, top-k renormalised when the spec says so, the chosen
    experts' gated FFNs (SwiGLU for SiLU) weighted and summed, as Hugging Face's
    Mixtral block); ``quantize``: the experts' weights quantized as Linears are
    (:mod:`.quant`)."""
    m = spec.moe
    params = {"num_experts": m.num_experts, "top_k": m.top_k,
              "norm_topk_prob": m.norm_topk_prob, "activation_type": ffn_activation(spec)}
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
    quantized (gate|)up Linear, the activation and the down Linear."""
    if spec.moe is not None:
        return [moe_layer(f"l{i}.mlp", spec, lw, quantize=quantize)]
    act = ffn_activation(spec)
    if quantize is None:
        return [P.mlp(f"l{i}.mlp", spec, lw, act)]
    ups = ([lw.gate, lw.up], [lw.gate_b, lw.up_b]) if spec.gated else ([lw.up], [lw.up_b])
    return [linear_layer(f"l{i}.gate_up", *ups, quantize, _a),
            L.Activation(f"l{i}.act", activation_type=act),
            linear_layer(f"l{i}.down", [lw.down], [lw.down_b], quantize, _a)]


def decoder_layers(spec: ModelSpec, w: ModelWeights, last_token: bool = False,
                   quantize: str | None = None) -> list[Any]:
    """The atb layers computing the model (see the module docstring). ``w``'s
    tensors may be NumPy arrays or any framework's CPU tensors; ``quantize``: None,
    "w8", "w8a8" or "w4" (:mod:`.quant`)."""
    why = why_not_lowered(spec)
    if why:
        raise CapabilityError("lower_decoder", why, "a decoder atb lowers", spec.arch)
    quantize = check_quantize(quantize)
    layers: list[Any] = [OpLayer("embed", op="Embedding", kind="embedding",
                                 weights={"weight": _a(w.embed)}, x_index=1)]
    prev = "embed"
    if spec.position == "learned":
        layers.append(P.position_embedding("pos_embed", w))
        prev = "pos_embed"
    for i, lw in enumerate(w.layers):
        layers += [
            P.norm(f"l{i}.attn_norm", spec, lw.attn_norm, lw.attn_norm_b),
            linear_layer(f"l{i}.qkv", [lw.q, lw.k, lw.v], [lw.q_b, lw.k_b, lw.v_b], quantize, _a),
            *P.rope(f"l{i}.rope", spec),
            P.attention(f"l{i}.attn", spec, lw, i),
            linear_layer(f"l{i}.o", [lw.o], [lw.o_b], quantize, _a),
            L.ResidualAdd(f"l{i}.attn_out", residual=prev),
            P.norm(f"l{i}.mlp_norm", spec, lw.mlp_norm, lw.mlp_norm_b),
            *_ffn(i, spec, lw, quantize),
            L.ResidualAdd(f"l{i}.out", residual=f"l{i}.attn_out")]
        prev = f"l{i}.out"
    if last_token:
        layers.append(LastToken("last_token"))
    layers.append(P.norm("final_norm", spec, w.final_norm, w.final_norm_b))
    if w.lm_head is None:  # a base model: the final hidden states
        return layers
    layers.append(linear_layer("lm_head", [w.lm_head], [w.lm_head_b], quantize, _a))
    return layers
