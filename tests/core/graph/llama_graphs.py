"""A LLaMA decoder layer spelled with primitive ops, for the fusion acceptance.

``build_llama_layer_primitive(...)`` returns a verified :class:`Graph` with separate
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
from atbcore.graph.builder import GraphBuilder
from atbcore.graph.ir import Graph
from atbcore.tensor import TensorDesc

__all__ = ["build_llama_layer_primitive", "llama_weights", "fused_ops", "causal_mask"]


def fused_ops(rope: bool = True) -> list[str]:
    """The op sequence the standard pipeline makes of the layer."""
    return ["RmsNormLinear", "RopeFlashAttention" if rope else "FlashAttention", "Linear",
            "AddRmsNorm", "FusedFeedForward"]


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


def _rms(b: GraphBuilder, x: str, w: str, eps: str, name: str) -> str:
    sq, = b.add_node("Elewise", [x, x], {"elewise_type": "mul"}, name=f"{name}.square")
    ms, = b.add_node("ReduceMean", [sq], {"dim": -1, "keepdim": True}, name=f"{name}.mean")
    ad, = b.add_node("Elewise", [ms, eps], {"elewise_type": "add"}, name=f"{name}.add_eps")
    rs, = b.add_node("Elewise", [ad], {"elewise_type": "rsqrt"}, name=f"{name}.rsqrt")
    xn, = b.add_node("Elewise", [x, rs], {"elewise_type": "mul"}, name=f"{name}.normalize")
    y, = b.add_node("Elewise", [w, xn], {"elewise_type": "mul"}, name=name)
    return y


def build_llama_layer_primitive(batch: int = 2, seq: int = 8, hidden: int = 64, heads: int = 4,
                                intermediate: int = 128, eps: float = 1e-6, dtype="fp32",
                                seed: int = 0, rope: bool = True, rope_base: float = 10000.0,
                                mask: str = "const") -> Graph:
    """The layer as a primitive-op Graph; see the module docstring.

    ``mask``: ``"const"`` (a causal-mask weight), ``"input"`` (graph input ``mask``)
    or ``"none"`` (bidirectional attention)."""
    d = hidden // heads
    dt = Dtype.of(dtype)
    w = llama_weights(hidden, heads, intermediate, dtype, seed)
    b = GraphBuilder("llama_layer")
    x = b.add_input("x", TensorDesc((batch, seq, hidden), dt))
    m = None
    if mask == "input":
        m = b.add_input("mask", TensorDesc((seq, seq), dt))
    elif mask == "const":
        m = b.add_weight("causal_mask", causal_mask(seq, dtype))
    ids = {k: b.add_weight(k, v) for k, v in w.items()}
    eps_id = b.add_weight("rms_eps", np.array([eps], dtype=dt.numpy))

    h = _rms(b, x, ids["input_layernorm.weight"], eps_id, "input_layernorm")
    q, = b.add_node("Linear", [h, ids["self_attn.q_proj.weight"]], name="q_proj")
    k, = b.add_node("Linear", [h, ids["self_attn.k_proj.weight"]], name="k_proj")
    v, = b.add_node("Linear", [h, ids["self_attn.v_proj.weight"]], name="v_proj")
    if rope:
        q, k = b.add_node("RoPE", [q, k], {"num_heads": heads, "num_kv_heads": heads,
                                           "base": rope_base, "rotary_type": "half"}, name="rope")
    heads_t = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        t4 = b.reshape(t, (batch, -1, heads, d), name=f"{name}_heads")          # [B, S, N, D]
        tt, = b.add_node("Transpose", [t4], {"perm": (0, 2, 1, 3)}, name=f"{name}_bnsd")
        heads_t.append(tt)                                                      # [B, N, S, D]
    qt, kt, vt = heads_t
    k_t, = b.add_node("Transpose", [kt], {"perm": (0, 1, 3, 2)}, name="k_transposed")
    s, = b.add_node("MatMul", [qt, k_t], name="scores")                         # [B, N, S, S]
    s, = b.add_node("Elewise", [s], {"elewise_type": "muls", "scalar": 1.0 / np.sqrt(d)},
                    name="scale")
    if m is not None:
        s, = b.add_node("Elewise", [s, m], {"elewise_type": "add"}, name="mask_add")
    p, = b.add_node("Softmax", [s], {"dim": -1}, name="softmax")
    o, = b.add_node("MatMul", [p, vt], name="context")                          # [B, N, S, D]
    o, = b.add_node("Transpose", [o], {"perm": (0, 2, 1, 3)}, name="context_bsnd")
    o = b.reshape(o, (batch, -1, hidden), name="context_bsh")                   # [B, S, H]
    a, = b.add_node("Linear", [o, ids["self_attn.o_proj.weight"]], name="o_proj")
    r1, = b.add_node("Elewise", [x, a], {"elewise_type": "add"}, name="attn_residual")

    h2 = _rms(b, r1, ids["post_attention_layernorm.weight"], eps_id, "post_attention_layernorm")
    g, = b.add_node("Linear", [h2, ids["mlp.gate_proj.weight"]], name="gate_proj")
    u, = b.add_node("Linear", [h2, ids["mlp.up_proj.weight"]], name="up_proj")
    ga, = b.add_node("SiLU", [g], name="act")
    mu, = b.add_node("Elewise", [ga, u], {"elewise_type": "mul"}, name="gate_mul")
    dn, = b.add_node("Linear", [mu, ids["mlp.down_proj.weight"]], name="down_proj")
    out, = b.add_node("Elewise", [r1, dn], {"elewise_type": "add"}, name="out")
    b.mark_output(out)
    return b.build()
