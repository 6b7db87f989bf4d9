"""A LLaMA decoder layer spelled with primitive ops, for the fusion acceptance.

``build_llama_layer_primitive(...)`` returns the library's
:func:`atbcore.graph.primitives.llama_layer_primitive` with seeded weights: a
verified :class:`Graph` with separate
q/k/v Linears, RMSNorm as ``x * rsqrt(mean(x*x) + eps) * w`` (Elewise mul /
ReduceMean / Elewise add of an eps constant / Elewise rsqrt), RoPE on q and k
(optional), explicit softmax attention (Reshape + Transpose to ``[B, N, S, D]``,
``MatMul(q, Transpose(k))``, ``Elewise muls`` by ``1/sqrt(D)``, ``+ mask``,
``Softmax``, ``MatMul(p, v)``, back to ``[B, S, H]``), the output projection and
residual add, the post-attention RMSNorm, and a SwiGLU MLP (gate/up Linears, SiLU,
Elewise mul, down Linear) with its residual add.

Inputs: ``x [B, S, H]`` (and ``mask [S, S]`` additive when ``mask="input"``).
Output: ``out [B, S, H]``. Weights are seeded NumPy arrays (``weights(...)`` gives
them by Hugging Face parameter name, for oracles). At ``fusion_level="standard"``
the pipeline turns it into ``RmsNorm -> Linear(qkv merged) -> RopeFlashAttention
(packed qkv; FlashAttention without RoPE) -> Linear(o_proj) -> AddRmsNorm ->
FusedFeedForward(gate|up merged, residual)`` (:data:`FUSED_OPS`).
"""

from __future__ import annotations

import numpy as np

from atbcore.dtypes import Dtype
from atbcore.graph.ir import Graph
from atbcore.graph.primitives import llama_layer_primitive

__all__ = ["build_llama_layer_primitive", "llama_weights", "fused_ops", "causal_mask"]


def fused_ops(rope: bool = True) -> list[str]:
    """The op sequence the standard pipeline makes of the layer."""
    return ["RmsNormLinear", "RopeFlashAttention" if rope else "FlashAttention", "Linear",
            "FusedFeedForward"]


def causal_mask(s: int, dtype="fp32") -> np.ndarray:
    """Additive causal mask ``[S, S]``: 0 on and below the diagonal, dtype min above."""
    np_dt = Dtype.of(dtype).numpy
    m = np.zeros((s, s), dtype=np.float64)
    m[np.triu_indices(s, 1)] = float(np.finfo(np.float32).min) if np_dt == np.float32 else -1e4
    return m.astype(np_dt)


def llama_weights(hidden: int = 64, heads: int = 4, intermediate: int = 128,
                  dtype="fp32", seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded weights by Hugging Face LlamaDecoderLayer parameter name."""
    rng = np.random.default_rng(seed)
    dt = Dtype.of(dtype).numpy

    def lin(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(dt)

    return {
        "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(hidden)).astype(dt),
        "self_attn.q_proj.weight": lin(hidden, hidden),
        "self_attn.k_proj.weight": lin(hidden, hidden),
        "self_attn.v_proj.weight": lin(hidden, hidden),
        "self_attn.o_proj.weight": lin(hidden, hidden),
        "post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(hidden)).astype(dt),
        "mlp.gate_proj.weight": lin(intermediate, hidden),
        "mlp.up_proj.weight": lin(intermediate, hidden),
        "mlp.down_proj.weight": lin(hidden, intermediate),
    }


def build_llama_layer_primitive(batch: int = 2, seq: int = 8, hidden: int = 64, heads: int = 4,
                                intermediate: int = 128, eps: float = 1e-6, dtype="fp32",
                                seed: int = 0, rope: bool = True, rope_base: float = 10000.0,
                                mask: str = "const") -> Graph:
    """The layer as a primitive-op Graph; see the module docstring.

    ``mask``: ``"const"`` (a causal-mask weight), ``"input"`` (graph input ``mask``)
    or ``"none"`` (bidirectional attention)."""
    w = llama_weights(hidden, heads, intermediate, dtype, seed)
    m = {"const": causal_mask(seq, dtype), "input": "input", "none": None}[mask]
    return llama_layer_primitive(w, batch=batch, seq=seq, heads=heads, dtype=dtype, eps=eps,
                                 rope=rope, rope_base=rope_base, mask=m)
