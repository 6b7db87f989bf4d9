"""The built-in Hugging Face families: Llama, Mistral, Qwen2, Qwen3 (q/k norm),
Mixtral (MoE), GPT-2 (learned positions, LayerNorm, Conv1D ``[in, out]`` weights,
fused ``c_attn``) and BERT (encoder, post-LN, token types).

Each family's ``describe`` reads the config and refuses, by name, every option whose
result atb would not reproduce (see :func:`unsupported`); ``extract`` returns the
model's own tensors (no copies, except views that transpose GPT-2's Conv1D weights).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .arch import (ArchSpec, LayerWeights, ModelSpec, ModelWeights, MoESpec, RopeSpec,
                   register_architecture, unsupported)

__all__ = ["hf_activation", "rope_spec", "LLAMA_TYPES"]

# Hugging Face ACT2FN names -> atb activation registry names (same math).
_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "quick_gelu": "quick_gelu",
        "relu": "relu"}


def hf_activation(name: Any) -> str:
    """The atb activation for a Hugging Face ``hidden_act``: the table above, then the
    atb registry (plugins registering activations included), then the plugins'
    ``atb_activation`` hook; CapabilityError naming it otherwise."""
    if not isinstance(name, str):
        raise unsupported("hidden_act", "an activation name", type(name).__name__)
    if name in _ACT:
        return _ACT[name]
    from ..errors import AtbError
    from ..ops.activation import get_activation

    try:
        get_activation(name)
        return name
    except AtbError:
        pass
    try:
        from atbcore.plugin import resolve_activation

        resolve_activation(name)
        return name
    except (ImportError, AtbError):
        raise unsupported("hidden_act", f"one of {sorted(_ACT)} or an activation a plugin "
                          "provides", repr(name)) from None


def _common_checks(config: Any) -> None:
    for opt in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, opt, None) is not None:
            raise unsupported(opt, "None (logit soft-capping is not implemented)",
                              getattr(config, opt))
    if getattr(config, "is_encoder_decoder", False):
        raise unsupported("is_encoder_decoder", "False (decoder-only or encoder-only)", True)
    if getattr(config, "add_cross_attention", False):
        raise unsupported("add_cross_attention", "False (cross-attention is not implemented)",
                          True)


def rope_spec(config: Any, head_dim: int) -> RopeSpec:
    """RoPE frequencies from the plugins (``atb_rope_frequencies``), which raise
    CapabilityError naming an unknown ``rope_type``. Length-dependent schedules
    (dynamic NTK, LongRoPE) get ``max_len``: their frequencies change past it."""
    from atbcore.plugin import rope_frequencies, rope_settings

    s = rope_settings(config)
    if s.dim != head_dim:
        raise unsupported("partial_rotary_factor", "1.0 for this architecture",
                          s.dim / head_dim)
    inv_freq, factor = rope_frequencies(config, s.rope_type)
    # Hugging Face keeps inv_freq in fp32: round the same way so positions match it.
    inv = np.asarray(inv_freq, dtype=np.float64).astype(np.float32).astype(np.float64)
    max_len = None
    if s.rope_type == "dynamic":
        max_len = s.max_position_embeddings
    elif s.rope_type == "longrope":
        max_len = s.original_max_position_embeddings
    return RopeSpec(rotary_dim=s.dim, inv_freq=tuple(float(x) for x in inv),
                    attention_factor=float(factor), rope_type=s.rope_type, max_len=max_len)


def _windows(config: Any, n: int) -> tuple[int | None, ...]:
    types = getattr(config, "layer_types", None)
    sw = getattr(config, "sliding_window", None)
    if types is None:
        return (sw,) * n
    out = []
    for t in types[:n]:
        if t == "full_attention":
            out.append(None)
        elif t == "sliding_attention":
            out.append(sw)
        else:
            raise unsupported("layer_types", "full_attention or sliding_attention", repr(t))
    return tuple(out)


# ----------------------------------------------------------------------------- Llama family
LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")


def _llama_describe(config: Any) -> ModelSpec:
    _common_checks(config)
    mtype = config.model_type
    h, nh = config.hidden_size, config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nh
    hd = getattr(config, "head_dim", None) or h // nh
    n = config.num_hidden_layers
    moe = None
    if mtype == "mixtral":
        moe = MoESpec(config.num_local_experts, config.num_experts_per_tok, True)
    return ModelSpec(
        arch=mtype, kind="decoder", hidden_size=h, num_layers=n, num_heads=nh,
        num_kv_heads=nkv, head_dim=hd, intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size, norm="rms", norm_eps=float(config.rms_norm_eps),
        activation=hf_activation(config.hidden_act), gated=True, position="rope",
        windows=_windows(config, n), scales=(hd ** -0.5,) * n, rope=rope_spec(config, hd),
        qk_norm=(mtype == "qwen3"), moe=moe,
        max_positions=getattr(config, "max_position_embeddings", None))


def _bias(mod: Any) -> Any:
    return getattr(mod, "bias", None)


def _llama_moe(mlp: Any, lw: LayerWeights, spec: ModelSpec) -> None:
    import torch

    lw.router = mlp.gate.weight                                  # [E, H]
    ex = mlp.experts
    if hasattr(ex, "gate_up_proj"):                              # transformers 5: 3-D params
        lw.experts_gate_up, lw.experts_down = ex.gate_up_proj, ex.down_proj
    else:                                                        # per-expert w1 (gate), w3 (up), w2
        lw.experts_gate_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in ex])
        lw.experts_down = torch.stack([e.w2.weight for e in ex])
    e, two_i, hid = lw.experts_gate_up.shape
    if (e, two_i, hid) != (spec.moe.num_experts, 2 * spec.intermediate_size, spec.hidden_size):
        raise unsupported("experts.gate_up_proj shape", [spec.moe.num_experts,
                          2 * spec.intermediate_size, spec.hidden_size], list(lw.experts_gate_up.shape))


def _llama_extract(model: Any, spec: ModelSpec) -> ModelWeights:
    base = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
    layers = []
    for blk in base.layers:
        at = blk.self_attn
        lw = LayerWeights(q=at.q_proj.weight, k=at.k_proj.weight, v=at.v_proj.weight,
                          o=at.o_proj.weight, q_b=_bias(at.q_proj), k_b=_bias(at.k_proj),
                          v_b=_bias(at.v_proj), o_b=_bias(at.o_proj),
                          attn_norm=blk.input_layernorm.weight,
                          mlp_norm=blk.post_attention_layernorm.weight)
        if spec.qk_norm:
            lw.q_norm, lw.k_norm = at.q_norm.weight, at.k_norm.weight
        if spec.moe is not None:
            _llama_moe(blk.mlp, lw, spec)
        else:
            m = blk.mlp
            lw.gate, lw.up, lw.down = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
            lw.gate_b, lw.up_b, lw.down_b = _bias(m.gate_proj), _bias(m.up_proj), _bias(m.down_proj)
        layers.append(lw)
    head = getattr(model, "lm_head", None)
    return ModelWeights(embed=base.embed_tokens.weight, layers=layers, final_norm=base.norm.weight,
                        lm_head=None if head is None else head.weight,
                        lm_head_b=None if head is None else _bias(head))


# ----------------------------------------------------------------------------- GPT-2
def _gpt2_describe(config: Any) -> ModelSpec:
    _common_checks(config)
    h, nh, n = config.n_embd, config.n_head, config.n_layer
    hd = h // nh
    base = hd ** -0.5 if config.scale_attn_weights else 1.0
    scales = tuple(base / (i + 1) if config.scale_attn_by_inverse_layer_idx else base
                   for i in range(n))
    return ModelSpec(
        arch="gpt2", kind="decoder", hidden_size=h, num_layers=n, num_heads=nh, num_kv_heads=nh,
        head_dim=hd, intermediate_size=config.n_inner or 4 * h, vocab_size=config.vocab_size,
        norm="layer", norm_eps=float(config.layer_norm_epsilon),
        activation=hf_activation(config.activation_function), gated=False, position="learned",
        windows=(None,) * n, scales=scales, max_positions=config.n_positions)


def _gpt2_extract(model: Any, spec: ModelSpec) -> ModelWeights:
    base = model.transformer if hasattr(model, "transformer") else model
    h = spec.hidden_size
    layers = []
    for blk in base.h:
        # Conv1D keeps weights [in, out]: transposed views give torch's [out, in]
        w = blk.attn.c_attn.weight.t()                   # [3H, H], rows q | k | v
        b = blk.attn.c_attn.bias
        layers.append(LayerWeights(
            q=w[:h], k=w[h:2 * h], v=w[2 * h:], q_b=b[:h], k_b=b[h:2 * h], v_b=b[2 * h:],
            o=blk.attn.c_proj.weight.t(), o_b=blk.attn.c_proj.bias,
            attn_norm=blk.ln_1.weight, attn_norm_b=blk.ln_1.bias,
            mlp_norm=blk.ln_2.weight, mlp_norm_b=blk.ln_2.bias,
            up=blk.mlp.c_fc.weight.t(), up_b=blk.mlp.c_fc.bias,
            down=blk.mlp.c_proj.weight.t(), down_b=blk.mlp.c_proj.bias))
    head = getattr(model, "lm_head", None)
    return ModelWeights(embed=base.wte.weight, pos_embed=base.wpe.weight, layers=layers,
                        final_norm=base.ln_f.weight, final_norm_b=base.ln_f.bias,
                        lm_head=None if head is None else head.weight,
                        lm_head_b=None if head is None else _bias(head))


# ----------------------------------------------------------------------------- BERT
def _bert_describe(config: Any) -> ModelSpec:
    _common_checks(config)
    if getattr(config, "is_decoder", False):
        raise unsupported("is_decoder", "False (BERT runs as an encoder)", True)
    pet = getattr(config, "position_embedding_type", "absolute")
    if pet not in (None, "absolute"):
        raise unsupported("position_embedding_type", "'absolute'", repr(pet))
    h, nh, n = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    hd = h // nh
    return ModelSpec(
        arch="bert", kind="encoder", hidden_size=h, num_layers=n, num_heads=nh, num_kv_heads=nh,
        head_dim=hd, intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        norm="layer", norm_eps=float(config.layer_norm_eps),
        activation=hf_activation(config.hidden_act), gated=False, position="learned",
        windows=(None,) * n, scales=(1.0 / math.sqrt(hd),) * n, post_norm=True,
        max_positions=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
        embed_norm=True)


def _bert_extract(model: Any, spec: ModelSpec) -> ModelWeights:
    base = model.bert if hasattr(model, "bert") else model
    emb = base.embeddings
    layers = []
    for blk in base.encoder.layer:
        sa, so = blk.attention.self, blk.attention.output
        layers.append(LayerWeights(
            q=sa.query.weight, k=sa.key.weight, v=sa.value.weight, q_b=sa.query.bias,
            k_b=sa.key.bias, v_b=sa.value.bias, o=so.dense.weight, o_b=so.dense.bias,
            attn_norm=so.LayerNorm.weight, attn_norm_b=so.LayerNorm.bias,
            up=blk.intermediate.dense.weight, up_b=blk.intermediate.dense.bias,
            down=blk.output.dense.weight, down_b=blk.output.dense.bias,
            mlp_norm=blk.output.LayerNorm.weight, mlp_norm_b=blk.output.LayerNorm.bias))
    pooler = getattr(base, "pooler", None)
    return ModelWeights(
        embed=emb.word_embeddings.weight, pos_embed=emb.position_embeddings.weight,
        type_embed=emb.token_type_embeddings.weight, embed_norm=emb.LayerNorm.weight,
        embed_norm_b=emb.LayerNorm.bias, layers=layers,
        pooler=None if pooler is None else pooler.dense.weight,
        pooler_b=None if pooler is None else pooler.dense.bias)


register_architecture(ArchSpec("llama", LLAMA_TYPES, "decoder", _llama_describe, _llama_extract))
register_architecture(ArchSpec("gpt2", ("gpt2",), "decoder", _gpt2_describe, _gpt2_extract))
register_architecture(ArchSpec("bert", ("bert",), "encoder", _bert_describe, _bert_extract))
