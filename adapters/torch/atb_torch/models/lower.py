"""A Hugging Face decoder as one core GraphOp (the lowering ``compile()`` is moving to).

    from atb_torch.models.lower import lower_decoder
    op = lower_decoder(hf_model)                      # atbcore GraphOp: ids -> logits
    cache = atbcore.memory.KVCache(L, batch, max_len, kv_heads, head_dim, dtype="fp32")
    logits, cache = op(input_ids, kv_cache=cache)     # prefill [B, S] -> [B, S, V]
    logits, cache = op(next_ids[:, None], kv_cache=cache)   # one decode step

The model becomes a list of atb layers (embedding; per block RmsNorm, the merged QKV
Linear, RoPE, FlashAttention with a KV cache, the output projection, a residual
add, RmsNorm, the gated FFN, a residual add; final RmsNorm and LM head) lowered and
fused by the one pass pipeline: each norm goes into the matmul that follows it (QKV,
the FFN's gate|up, the LM head), the attention's residual add into the output
projection's GEMM and the FFN's into its down projection, RoPE and the KV cache write
become one kernel writing the paged rows, and q/k/v are views of the QKV output. It
runs with an ``atb.KVCache`` in the in-place cache form (the cache written by the
plan, one bound program per decode step; 58 launches for the default model's step).
``explain()`` shows what it became.

Covered: pre-norm RmsNorm decoders with default RoPE (full rotary), gated SiLU MLPs,
GQA, q/k/v biases, sliding windows and top-k MoE blocks (Llama, Qwen2, Mistral,
Mixtral: :mod:`.lower_moe`); anything else raises
``CapabilityError`` naming what is missing. ``compile()`` still runs its own decode
plan (:mod:`.plan`): on this machine that plan is still faster (0.83-0.86x, see
``benchmarks/graph_decode.py``) and serves paged batches, padding and CUDA graphs,
which this form does not yet; ``compile(model, tensor_parallel=N)`` runs this form
(:mod:`.compile_tp`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from atbcore.errors import CapabilityError
from atbcore.graph import layers as L
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.layers import host_array
from atbcore.graph.layers_attention import FlashAttention, FusedFeedForward, RoPE
from atbcore.graph.layers_block import LastToken

from ..graph_layers import OpLayer
from .arch import ModelSpec, ModelWeights, resolve_architecture
from .lower_moe import moe_layer

__all__ = ["lower_decoder", "decoder_layers"]


def _why_not(spec: ModelSpec) -> str:
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


def _a(t: Any) -> np.ndarray | None:
    """A weight as a host array in the model's float dtype (fp32/fp16/bf16; a view
    of a contiguous CPU tensor where NumPy has the dtype)."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        t = t.float()
    return host_array(t.cpu().contiguous())


def _base(spec: ModelSpec) -> float:
    """The RoPE base whose default frequencies are the spec's ``inv_freq``."""
    inv = spec.rope.inv_freq
    return float(inv[1] ** (-spec.rope.rotary_dim / 2.0)) if len(inv) > 1 else 10000.0


def decoder_layers(spec: ModelSpec, w: ModelWeights, last_token: bool = False) -> list[Any]:
    """The atb layers computing the model (see the module docstring); ``last_token``:
    the final norm and LM head run each sequence's last token only (logits
    ``[B, 1, V]``, what generation reads)."""
    why = _why_not(spec)
    if why:
        raise CapabilityError("lower_decoder", why, "a Llama-family decoder", spec.arch)
    base = _base(spec)
    layers: list[Any] = [OpLayer("embed", op="Embedding", kind="embedding",
                                 weights={"weight": _a(w.embed)}, x_index=1)]
    prev = "embed"
    for i, lw in enumerate(w.layers):
        bias = lw.q_b is not None
        qkv = {"weight": np.concatenate([_a(lw.q), _a(lw.k), _a(lw.v)])}
        if bias:
            qkv["bias"] = np.concatenate([_a(lw.q_b), _a(lw.k_b), _a(lw.v_b)])
        o = {"weight": _a(lw.o), **({"bias": _a(lw.o_b)} if lw.o_b is not None else {})}
        layers += [
            L.RmsNorm(f"l{i}.attn_norm", eps=spec.norm_eps).load_weights(
                {"weight": _a(lw.attn_norm)}),
            L.Linear(f"l{i}.qkv", out_features=qkv["weight"].shape[0], bias=bias
                     ).load_weights(qkv),
            RoPE(f"l{i}.rope", base=base),
            FlashAttention(f"l{i}.attn", num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                           head_dim=spec.head_dim, causal=True, kv_cache=True,
                           scale=spec.scales[i], window=spec.windows[i]),
            L.Linear(f"l{i}.o", out_features=spec.hidden_size, bias="bias" in o).load_weights(o),
            L.ResidualAdd(f"l{i}.attn_out", residual=prev),
            L.RmsNorm(f"l{i}.mlp_norm", eps=spec.norm_eps).load_weights(
                {"weight": _a(lw.mlp_norm)}),
            moe_layer(f"l{i}.mlp", spec, lw, _a) if spec.moe is not None else
            FusedFeedForward(f"l{i}.mlp", intermediate_size=spec.intermediate_size,
                             activation_type="swiglu").load_weights(
                {"gate_proj.weight": _a(lw.gate), "up_proj.weight": _a(lw.up),
                 "down_proj.weight": _a(lw.down)}),
            L.ResidualAdd(f"l{i}.out", residual=f"l{i}.attn_out")]
        prev = f"l{i}.out"
    if last_token:
        layers.append(LastToken("last_token"))
    layers.append(L.RmsNorm("final_norm", eps=spec.norm_eps).load_weights(
        {"weight": _a(w.final_norm)}))
    head = {"weight": _a(w.lm_head)}
    if w.lm_head_b is not None:
        head["bias"] = _a(w.lm_head_b)
    layers.append(L.Linear("lm_head", out_features=spec.vocab_size, bias="bias" in head
                           ).load_weights(head))
    return layers


def lower_decoder(model: Any, last_token: bool = False, **graph_op_kwargs: Any) -> GraphOp:
    """The Hugging Face causal LM ``model`` as one core GraphOp (ids ``[B, S]`` ->
    logits ``[B, S, V]``, or ``[B, 1, V]`` of each row's last token with
    ``last_token``); call it with ``kv_cache=`` an ``atb.KVCache``."""
    arch = resolve_architecture(model.config)
    spec = arch.describe(model.config)
    why = _why_not(spec)
    if why:
        raise CapabilityError("lower_decoder", why, "a Llama-family decoder", spec.arch)
    weights = arch.extract(model, spec)
    if weights.lm_head is None:
        raise CapabilityError("lower_decoder", "a base model (no LM head)", "a causal LM",
                              type(model).__name__)
    return GraphOp(decoder_layers(spec, weights, last_token), name=spec.arch, **graph_op_kwargs)
