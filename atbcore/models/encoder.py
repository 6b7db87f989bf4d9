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
``quantize`` ("w8", "w8a8", "w4") makes the blocks' Linears quantized Linears as a
decoder's are (:mod:`.quant`: int8 weights, with ``"w8a8"`` rows quantized on the fly;
4-bit codes), run by the C matmuls.
Covered: post-norm LayerNorm encoders with learned absolute positions, token
types and a plain (non-gated) activation; anything else raises
``CapabilityError`` naming what is missing.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import CapabilityError
from ..graph import layers as L
from ..graph.layers_encoder import (FIRST_ROWS, POS_TYPE, SEQ_LENS, EncoderEmbeddings, Pooler,
                                    UnpadAttention, summed_position_types)
from ..graph.sequential import BLOCK_INPUT
from ..ops.linear_quant import W8A8_FAST_LEVELS
from .arch import ModelSpec, ModelWeights
from .decoder import host_weight
from .quant import check_quantize, linear_layer

# an encoder's w8a8 weights within [-64, 64]: its many-row GEMMs take the AVX2 offset
# tile (atbcore.ops.linear_quant.W8A8_FAST_LEVELS)
_linear = functools.partial(linear_layer, w8a8_levels=W8A8_FAST_LEVELS)

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


def _mlp(i: int, spec: ModelSpec, lw: Any, a: Any, quantize: str | None) -> list[Any]:
    """The block's FFN as up / activation / down Linears: the pipeline fuses the
    activation into the up projection (``LinearActivation``: one oneDNN GEMM, then the
    C activation in place, on the CPU) and the residual add into the down projection's
    epilogue."""
    return [_linear(f"l{i}.up", [lw.up], [lw.up_b], quantize, a),
            L.Activation(f"l{i}.act", activation_type=spec.activation),
            _linear(f"l{i}.mlp", [lw.down], [lw.down_b], quantize, a)]


def encoder_layers(spec: ModelSpec, w: ModelWeights, dtype: Any = None,
                   inputs_embeds: bool = False, quantize: str | None = None) -> list[Any]:
    """The atb layers computing the encoder (see the module docstring); ``dtype``
    (e.g. ``"bf16"``; None = the weights') is the compute and weight dtype. With
    ``inputs_embeds`` the block input is word vectors ``[T, H]`` instead of ids.
    ``quantize`` ("w8", "w8a8", "w4"; :mod:`.quant`): the blocks' Linears are
    quantized; embeddings, norms, attention and the pooler stay in ``dtype``."""
    quantize = check_quantize(quantize)
    why = why_not_encoder(spec)
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
            _linear(f"l{i}.qkv", [lw.q, lw.k, lw.v], [lw.q_b, lw.k_b, lw.v_b], quantize, a),
            UnpadAttention(f"l{i}.attn", num_heads=spec.num_heads,
                           num_kv_heads=spec.num_kv_heads, scale=spec.scales[i]),
            _linear(f"l{i}.o", [lw.o], [lw.o_b], quantize, a),
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
