"""A LLaMA decoder layer spelled with primitive ops: the graph the fusion rules were
written for (``atb verify`` checks every rule on it; the fusion tests use it too).

RMSNorm as ``w * (x * rsqrt(mean(x*x) + eps))`` (Elewise mul / ReduceMean / Elewise
add of an eps constant / Elewise rsqrt), separate q/k/v Linears, RoPE on q and k
(optional), explicit softmax attention (Reshape + Transpose to ``[B, N, S, D]``,
``MatMul(q, Transpose(k))``, ``Elewise muls`` by ``1/sqrt(D)``, ``+ mask``,
``Softmax``, ``MatMul(p, v)``, back to ``[B, S, H]``), the output projection and
residual add, the post-attention RMSNorm, and a SwiGLU MLP with its residual add.
Weights are given by Hugging Face ``LlamaDecoderLayer`` parameter name.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ParamsError, ShapeError
from ..tensor import TensorDesc
from .builder import GraphBuilder
from .ir import Graph

__all__ = ["llama_layer_primitive", "LLAMA_WEIGHT_NAMES"]

LLAMA_WEIGHT_NAMES = ("input_layernorm.weight", "self_attn.q_proj.weight",
                      "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                      "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _rms(b: GraphBuilder, x: str, w: str, eps: str, name: str) -> str:
    sq, = b.add_node("Elewise", [x, x], {"elewise_type": "mul"}, name=f"{name}.square")
    ms, = b.add_node("ReduceMean", [sq], {"dim": -1, "keepdim": True}, name=f"{name}.mean")
    ad, = b.add_node("Elewise", [ms, eps], {"elewise_type": "add"}, name=f"{name}.add_eps")
    rs, = b.add_node("Elewise", [ad], {"elewise_type": "rsqrt"}, name=f"{name}.rsqrt")
    xn, = b.add_node("Elewise", [x, rs], {"elewise_type": "mul"}, name=f"{name}.normalize")
    y, = b.add_node("Elewise", [w, xn], {"elewise_type": "mul"}, name=name)
    return y


def llama_layer_primitive(weights: Mapping[str, Any], *, batch: int, seq: int, heads: int,
                          dtype: Any = "fp32", eps: float = 1e-6, rope: bool = True,
                          rope_base: float = 10000.0, mask: Any = None,
                          name: str = "llama_layer") -> Graph:
    """The layer as a Graph (input ``x [B, S, H]``, output ``out``). ``weights``: the
    nine :data:`LLAMA_WEIGHT_NAMES` (cast to ``dtype``); ``mask``: None (no mask),
    ``"input"`` (graph input ``mask [S, S]``, additive) or an additive ``[S, S]``
    array (the weight ``causal_mask``)."""
    dt = Dtype.of(dtype)
    missing = [k for k in LLAMA_WEIGHT_NAMES if k not in weights]
    if missing:
        raise InputError(name, "weights", f"all of {list(LLAMA_WEIGHT_NAMES)}",
                         f"missing {missing}")
    hidden = int(np.shape(weights["self_attn.o_proj.weight"])[0])
    for what, v in (("batch", batch), ("seq", seq), ("heads", heads)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ParamsError(name, what, "a positive int", repr(v))
    if hidden % heads:
        raise ParamsError(name, "heads", f"a divisor of the hidden size {hidden}", heads)
    if mask is not None and not isinstance(mask, str) and np.shape(mask) != (seq, seq):
        raise ShapeError(name, "mask", [seq, seq], list(np.shape(mask)))
    if isinstance(mask, str) and mask != "input":
        raise ParamsError(name, "mask", "None, 'input' or an [S, S] array", repr(mask))
    d = hidden // heads
    b = GraphBuilder(name)
    x = b.add_input("x", TensorDesc((batch, seq, hidden), dt))
    m = None
    if isinstance(mask, str):
        m = b.add_input("mask", TensorDesc((seq, seq), dt))
    elif mask is not None:
        m = b.add_weight("causal_mask", np.asarray(mask).astype(dt.numpy))
    ids = {k: b.add_weight(k, np.asarray(weights[k]).astype(dt.numpy))
           for k in LLAMA_WEIGHT_NAMES}
    eps_id = b.add_weight("rms_eps", np.array([eps], dtype=dt.numpy))

    h = _rms(b, x, ids["input_layernorm.weight"], eps_id, "input_layernorm")
    q, = b.add_node("Linear", [h, ids["self_attn.q_proj.weight"]], name="q_proj")
    k, = b.add_node("Linear", [h, ids["self_attn.k_proj.weight"]], name="k_proj")
    v, = b.add_node("Linear", [h, ids["self_attn.v_proj.weight"]], name="v_proj")
    if rope:
        q, k = b.add_node("RoPE", [q, k], {"num_heads": heads, "num_kv_heads": heads,
                                           "base": rope_base, "rotary_type": "half"}, name="rope")
    heads_t = []
    for nm, t in (("q", q), ("k", k), ("v", v)):
        t4 = b.reshape(t, (batch, -1, heads, d), name=f"{nm}_heads")            # [B, S, N, D]
        tt, = b.add_node("Transpose", [t4], {"perm": (0, 2, 1, 3)}, name=f"{nm}_bnsd")
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
