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
generation reads).
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


def moe_layer(name: str, spec: ModelSpec, lw: Any, to_array: Any = host_weight) -> OpLayer:
    """Block ``lw``'s experts as one ``MoE`` node named ``name`` (router ``[E, H]``,
    experts' gate|up ``[E, 2I, H]`` gate rows first, down ``[E, H, I]``: fp32 softmax
    routing over all experts, top-k renormalised when the spec says so, the chosen
    experts' gated FFNs (SwiGLU for SiLU) weighted and summed, as Hugging Face's
    Mixtral block)."""
    m = spec.moe
    return OpLayer(name, op="MoE", kind="moe",
                   params={"num_experts": m.num_experts, "top_k": m.top_k,
                           "norm_topk_prob": m.norm_topk_prob,
                           "activation_type": ffn_activation(spec)},
                   weights={"router_w": to_array(lw.router),
                            "w_gate_up": to_array(lw.experts_gate_up),
                            "w_down": to_array(lw.experts_down)})


def decoder_layers(spec: ModelSpec, w: ModelWeights, last_token: bool = False) -> list[Any]:
    """The atb layers computing the model (see the module docstring). ``w``'s
    tensors may be NumPy arrays or any framework's CPU tensors."""
    why = why_not_lowered(spec)
    if why:
        raise CapabilityError("lower_decoder", why, "a decoder atb lowers", spec.arch)
    layers: list[Any] = [OpLayer("embed", op="Embedding", kind="embedding",
                                 weights={"weight": _a(w.embed)}, x_index=1)]
    prev = "embed"
    if spec.position == "learned":
        layers.append(P.position_embedding("pos_embed", w))
        prev = "pos_embed"
    for i, lw in enumerate(w.layers):
        bias = lw.q_b is not None
        qkv = {"weight": np.concatenate([_a(lw.q), _a(lw.k), _a(lw.v)])}
        if bias:
            qkv["bias"] = np.concatenate([_a(lw.q_b), _a(lw.k_b), _a(lw.v_b)])
        o = {"weight": _a(lw.o), **({"bias": _a(lw.o_b)} if lw.o_b is not None else {})}
        layers += [
            P.norm(f"l{i}.attn_norm", spec, lw.attn_norm, lw.attn_norm_b),
            L.Linear(f"l{i}.qkv", out_features=qkv["weight"].shape[0], bias=bias
                     ).load_weights(qkv),
            *P.rope(f"l{i}.rope", spec),
            P.attention(f"l{i}.attn", spec, lw, i),
            L.Linear(f"l{i}.o", out_features=spec.hidden_size, bias="bias" in o).load_weights(o),
            L.ResidualAdd(f"l{i}.attn_out", residual=prev),
            P.norm(f"l{i}.mlp_norm", spec, lw.mlp_norm, lw.mlp_norm_b),
            moe_layer(f"l{i}.mlp", spec, lw) if spec.moe is not None else
            P.mlp(f"l{i}.mlp", spec, lw, ffn_activation(spec)),
            L.ResidualAdd(f"l{i}.out", residual=f"l{i}.attn_out")]
        prev = f"l{i}.out"
    if last_token:
        layers.append(LastToken("last_token"))
    layers.append(P.norm("final_norm", spec, w.final_norm, w.final_norm_b))
    if w.lm_head is None:  # a base model: the final hidden states
        return layers
    head = {"weight": _a(w.lm_head)}
    if w.lm_head_b is not None:
        head["bias"] = _a(w.lm_head_b)
    layers.append(L.Linear("lm_head", out_features=spec.vocab_size, bias="bias" in head
                           ).load_weights(head))
    return layers
