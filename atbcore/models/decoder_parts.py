"""The per-feature layers of :func:`~.decoder.decoder_layers`: the norm kind
(RmsNorm, or LayerNorm with bias), RoPE from the spec's frequencies (a base for
default RoPE, else a cos/sin table of the scaled frequencies; partial rotary),
the attention (with Qwen3's per-head q/k RmsNorm), the MLP (gated or not, any
activation, biases) and GPT-2's learned positions."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..graph import layers as L
from ..graph.layers_attention import FlashAttention, FusedFeedForward, RoPE
from ..graph.layers_position import PositionEmbedding
from .arch import LayerWeights, ModelSpec, ModelWeights

__all__ = ["norm", "rope", "attention", "mlp", "position_embedding", "rope_base"]


def _a(t: Any) -> np.ndarray | None:
    from .decoder import host_weight

    return host_weight(t)


def norm(name: str, spec: ModelSpec, weight: Any, bias: Any = None) -> L.Layer:
    """The spec's norm kind over the hidden size: RmsNorm, or LayerNorm (bias zeros
    when the model has none)."""
    if spec.norm == "rms":
        return L.RmsNorm(name, eps=spec.norm_eps).load_weights({"weight": _a(weight)})
    w = _a(weight)
    b = _a(bias) if bias is not None else np.zeros_like(w)
    return L.LayerNorm(name, eps=spec.norm_eps).load_weights({"weight": w, "bias": b})


def rope_base(spec: ModelSpec) -> float | None:
    """The base whose default frequencies are the spec's ``inv_freq`` (None when
    they are scaled: llama3, linear, yarn, dynamic ... or an attention factor)."""
    r = spec.rope
    if r.rope_type != "default" or r.attention_factor != 1.0:
        return None
    inv = np.asarray(r.inv_freq, dtype=np.float64)
    if len(inv) < 2:
        return 10000.0
    base = float(inv[1] ** (-r.rotary_dim / 2.0))
    want = base ** (-np.arange(0, r.rotary_dim, 2, dtype=np.float64) / r.rotary_dim)
    return base if np.allclose(inv, want, rtol=1e-6, atol=0.0) else None


def rope(name: str, spec: ModelSpec) -> list[Any]:
    """The RoPE layer before the attention (none for learned positions): by base
    for default RoPE, else a table of the spec's frequencies and attention factor,
    no longer than ``rope.max_len`` (dynamic NTK, LongRoPE: refused past it, as the
    runner does)."""
    r = spec.rope
    if r is None:
        return []
    base = rope_base(spec)
    if base is not None:
        return [RoPE(name, base=base, rotary_dim=r.rotary_dim)]
    return [RoPE(name, rotary_dim=r.rotary_dim, inv_freq=r.inv_freq,
                 attention_factor=r.attention_factor, max_positions=r.max_len)]


def attention(name: str, spec: ModelSpec, lw: LayerWeights, i: int) -> FlashAttention:
    """Block ``i``'s attention over the packed QKV (GQA, window, scale; q/k norms)."""
    fa = FlashAttention(name, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                        head_dim=spec.head_dim, causal=True, kv_cache=True,
                        scale=spec.scales[i], window=spec.windows[i],
                        qk_norm_eps=spec.norm_eps if spec.qk_norm else None)
    if spec.qk_norm:
        fa.load_weights({"q_norm.weight": _a(lw.q_norm), "k_norm.weight": _a(lw.k_norm)})
    return fa


def mlp(name: str, spec: ModelSpec, lw: LayerWeights, activation: str) -> FusedFeedForward:
    """The dense MLP: ``down(act(gate) * up)`` or ``down(act(up))``, with biases
    when the model has them (GPT-2's Conv1D MLP, Llama's ``mlp_bias``)."""
    projs = {"gate_proj": (lw.gate, lw.gate_b), "up_proj": (lw.up, lw.up_b),
             "down_proj": (lw.down, lw.down_b)}
    if not spec.gated:
        del projs["gate_proj"]
    bias = lw.down_b is not None
    weights = {f"{p}.weight": _a(wt) for p, (wt, _) in projs.items()}
    if bias:
        weights.update({f"{p}.bias": _a(b) if b is not None else
                        np.zeros(_a(wt).shape[0], _a(wt).dtype) for p, (wt, b) in projs.items()})
    return FusedFeedForward(name, intermediate_size=spec.intermediate_size,
                            activation_type=activation, bias=bias).load_weights(weights)


def position_embedding(name: str, w: ModelWeights) -> PositionEmbedding:
    """Learned absolute positions added to the token embeddings (GPT-2)."""
    return PositionEmbedding(name).load_weights({"weight": _a(w.pos_embed)})
