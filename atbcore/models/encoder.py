"""An encoder's atb layers (BERT, sentence-transformers' BERT models), from a
framework-neutral :class:`~.arch.ModelSpec` and its weights (NumPy arrays or any
framework's tensors): what ``atb_torch.models.lower_encoder`` lowers a Hugging Face
encoder to.

    layers = encoder_layers(spec, weights)            # embeddings ... [pooler]
    op = GraphOp(layers, name="bert", dim_names=encoder_dim_names())
    hidden, pooled = op(ids, pos_type, seq_lens, first_rows)
    # ids [T] (the real tokens, packed), pos_type [T], seq_lens [B], first_rows [B]

The model runs token-major over the packed real tokens ``[T, H]`` (see
:mod:`atbcore.graph.layers_encoder` for the inputs): embeddings (word + position +
token type, LayerNorm); per post-norm block the merged QKV Linear, attention
within each sequence (``UnpadFlashAttention``), the output projection, a residual
add and LayerNorm, the FFN (``up``, activation, ``down``, biases) and a residual add
and LayerNorm; the optional pooler. The one pass pipeline fuses it: the residual
adds ride in the GEMM epilogues of the output projection and the FFN's down
projection, the embeddings' sum goes into their LayerNorm (``AddLayerNorm``).
``quantize="w8a8"`` puts the blocks' Linears on int8 weights with rows quantized on
the fly (the C w8a8 matmul).
Covered: post-norm LayerNorm encoders with learned absolute positions, token
types and a plain (non-gated) activation; anything else raises
``CapabilityError`` naming what is missing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import CapabilityError
from ..graph import layers as L
from ..graph.layers_encoder import (FIRST_ROWS, POS_TYPE, SEQ_LENS, EncoderEmbeddings, Pooler,
                                    UnpadAttention, summed_position_types)
from ..graph.op_layer import OpLayer
from ..graph.sequential import BLOCK_INPUT
from ..ops.linear import quantize_w8
from .arch import ModelSpec, ModelWeights
from .decoder import host_weight

__all__ = ["encoder_layers", "why_not_encoder", "encoder_dim_names", "ENCODER_FUSION"]

# The pipeline's settings for an encoder: its FFN stays up (+ activation) / down
# Linears (the ``ffn`` rule would merge them into one FusedFeedForward, whose CPU
# kernel keeps the [T, I] intermediate in fp32 and runs the activation as a separate
# pass; LinearActivation puts it in the up GEMM's epilogue, rounding once).
ENCODER_FUSION = {"disable": ("ffn",)}


def encoder_dim_names(inputs_embeds: bool = False) -> dict[str, tuple[str | None, ...]]:
    """The plan cache's dim names of an encoder GraphOp: the T packed tokens bucket
    as a sequence length, the B sequences as a batch (plans are reused across
    batches of similar sizes)."""
    return {BLOCK_INPUT: ("seq_len", None) if inputs_embeds else ("seq_len",),
            POS_TYPE: ("seq_len",), SEQ_LENS: ("batch_size",), FIRST_ROWS: ("batch_size",)}


def why_not_encoder(spec: ModelSpec) -> str:
    """Why ``spec`` cannot be lowered by :func:`encoder_layers` ("" when it can)."""
    checks = [
        (spec.kind != "encoder", f"a {spec.kind} model (encoders only)"),
        (spec.norm != "layer", f"{spec.norm} norms (LayerNorm only)"),
        (not spec.post_norm, "pre-norm blocks (post-norm only)"),
        (spec.position != "learned", f"{spec.position} positions (learned absolute only)"),
        (spec.gated, "gated MLPs"),
        (spec.moe is not None, "routed experts"),
        (spec.qk_norm, "q/k norms"),
        (any(w is not None for w in spec.windows), "sliding windows"),
    ]
    return "; ".join(why for bad, why in checks if bad)


def _cast(dtype: Dtype | None):
    def to(t: Any) -> np.ndarray | None:
        a = host_weight(t)
        if a is None or dtype is None or Dtype.of(a.dtype) == dtype:
            return a
        return a.astype(dtype.numpy)
    return to


def _linear(name: str, weight: np.ndarray, bias: np.ndarray, quantize: str | None) -> Any:
    """``x @ weight.T + bias``: a float Linear, or with ``quantize="w8a8"`` a Linear
    on the int8 weight (per-output-channel fp32 scale) whose rows of x are
    quantized on the fly."""
    if quantize is None:
        return L.Linear(name, out_features=weight.shape[0]).load_weights(
            {"weight": weight, "bias": bias})
    wq, scale = quantize_w8(weight.astype(np.float32))
    return OpLayer(name, op="Linear", kind="linear", cast=False,
                   params={"quant": quantize, "bias": True},
                   weights={"weight": wq, "bias": bias, "scale": scale.astype(np.float32)})


def _mlp(i: int, spec: ModelSpec, lw: Any, a: Any, quantize: str | None) -> list[Any]:
    """The block's FFN as up / activation / down Linears: the pipeline fuses the
    activation into the up projection (``LinearActivation``: one oneDNN GEMM with a
    GELU post-op on the CPU) and the residual add into the down projection's
    epilogue."""
    return [_linear(f"l{i}.up", a(lw.up), a(lw.up_b), quantize),
            L.Activation(f"l{i}.act", activation_type=spec.activation),
            _linear(f"l{i}.mlp", a(lw.down), a(lw.down_b), quantize)]


def encoder_layers(spec: ModelSpec, w: ModelWeights, dtype: Any = None,
                   inputs_embeds: bool = False, quantize: str | None = None) -> list[Any]:
    """The atb layers computing the encoder (see the module docstring); ``dtype``
    (e.g. ``"bf16"``; None = the weights') is the compute and weight dtype. With
    ``inputs_embeds`` the block input is word vectors ``[T, H]`` instead of ids.
    ``quantize="w8a8"``: the blocks' Linears take int8 weights (symmetric, per
    output channel) and quantize their input rows on the fly (the C w8a8 matmul);
    embeddings, norms, attention and the pooler stay in ``dtype``."""
    why = why_not_encoder(spec)
    if quantize not in (None, "w8a8"):
        why = "; ".join(filter(None, [why, f"quantize={quantize!r} (None or 'w8a8')"]))
    if why:
        raise CapabilityError("lower_encoder", why, "a BERT-style encoder", spec.arch)
    a = _cast(None if dtype is None else Dtype.of(dtype))
    if w.pos_embed is None or w.type_embed is None or w.embed_norm is None:
        raise CapabilityError("lower_encoder", "embeddings without position, token-type "
                              "tables or their LayerNorm", "BERT embeddings", spec.arch)
    table = summed_position_types(a(w.pos_embed), a(w.type_embed))
    layers: list[Any] = [EncoderEmbeddings("embed", eps=spec.norm_eps,
                                                     inputs_embeds=inputs_embeds).load_weights(
        {"word": a(w.embed), "pos_type": table, "norm.weight": a(w.embed_norm),
         "norm.bias": a(w.embed_norm_b)})]
    prev = "embed"
    for i, lw in enumerate(w.layers):
        layers += [
            _linear(f"l{i}.qkv", np.concatenate([a(lw.q), a(lw.k), a(lw.v)]),
                    np.concatenate([a(lw.q_b), a(lw.k_b), a(lw.v_b)]), quantize),
            UnpadAttention(f"l{i}.attn", num_heads=spec.num_heads,
                           num_kv_heads=spec.num_kv_heads, scale=spec.scales[i]),
            _linear(f"l{i}.o", a(lw.o), a(lw.o_b), quantize),
            L.ResidualAdd(f"l{i}.attn_out", residual=prev),
            L.LayerNorm(f"l{i}.attn_norm", eps=spec.norm_eps).load_weights(
                {"weight": a(lw.attn_norm), "bias": a(lw.attn_norm_b)}),
            *_mlp(i, spec, lw, a, quantize),
            L.ResidualAdd(f"l{i}.mlp_out", residual=f"l{i}.attn_norm"),
            L.LayerNorm(f"l{i}.mlp_norm", eps=spec.norm_eps).load_weights(
                {"weight": a(lw.mlp_norm), "bias": a(lw.mlp_norm_b)})]
        prev = f"l{i}.mlp_norm"
    if w.pooler is not None:
        layers.append(Pooler("pooler").load_weights({"weight": a(w.pooler),
                                                     "bias": a(w.pooler_b)}))
    return layers
