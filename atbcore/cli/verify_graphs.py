"""Graphs spelled from primitive ops that ``atb verify`` fuses to check every
fusion rule: a LLaMA decoder layer (RMSNorm written out, separate q/k/v, RoPE,
attention as MatMul/Softmax/MatMul, gated MLP) and a BERT-style MLP block
(Linear + bias add, exact GELU, residual + LayerNorm), a FusedFeedForward on
separate gate/up weights, adds feeding norms (no Linear before them to take the
residual) and a RoPE whose k a ReshapeAndCache writes into a paged cache (the
cache a constant the graph writes in place). Between them every built-in rule
fires; ``atb verify`` reports which graph exercised which rule.

Weights are drawn in float64, rounded once to the dtype, and the same rounded
values build a float32 twin of the graph: the twin's NumPy run is the golden
result both the fused and the unfused graph are measured against.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..dtypes import Dtype
from ..graph.builder import GraphBuilder
from ..graph.ir import Graph
from ..graph.primitives import LLAMA_WEIGHT_NAMES, llama_layer_primitive
from ..tensor import TensorDesc

__all__ = ["GRAPHS", "build"]

B, S, HID, HEADS, INTER = 2, 8, 32, 4, 64


def _weights(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]], dt: Dtype,
             scale: float = 0.2) -> dict[str, np.ndarray]:
    # rounded to dt, held as float32 so both twins carry identical values
    return {k: (rng.standard_normal(s) * scale).astype(dt.numpy).astype(np.float32)
            for k, s in shapes.items()}


_HF = dict(zip(("ln1", "wq", "wk", "wv", "wo", "ln2", "wg", "wu", "wd"), LLAMA_WEIGHT_NAMES))


def llama_layer(dt: Dtype, w: dict[str, np.ndarray]) -> Graph:
    """One LLaMA decoder layer from primitives (causal mask as a constant)."""
    mask = np.triu(np.full((S, S), -np.inf), 1)
    return llama_layer_primitive({_HF[k]: v for k, v in w.items()}, batch=B, seq=S, heads=HEADS,
                                 dtype=dt, eps=1e-6, mask=mask, name="verify_llama_layer")


def llama_weights(rng: np.random.Generator, dt: Dtype) -> dict[str, np.ndarray]:
    w = _weights(rng, {"wq": (HID, HID), "wk": (HID, HID), "wv": (HID, HID), "wo": (HID, HID),
                       "wg": (INTER, HID), "wu": (INTER, HID), "wd": (HID, INTER)}, dt)
    w["ln1"] = (1 + 0.1 * rng.standard_normal(HID)).astype(dt.numpy).astype(np.float32)
    w["ln2"] = (1 + 0.1 * rng.standard_normal(HID)).astype(dt.numpy).astype(np.float32)
    return w


def mlp_block(dt: Dtype, w: dict[str, np.ndarray]) -> Graph:
    """BERT-style: Linear + bias add -> exact GELU -> Linear -> residual add -> LayerNorm."""
    b = GraphBuilder("verify_mlp_block")
    x = b.add_input("x", TensorDesc((B, S, HID), dt))
    ids = {k: b.add_weight(k, v.astype(dt.numpy)) for k, v in w.items()}
    h, = b.add_node("Linear", [x, ids["w1"]], name="fc1")
    h, = b.add_node("Elewise", [h, ids["b1"]], {"elewise_type": "add"}, name="fc1_bias")
    h, = b.add_node("Gelu", [h], name="gelu")
    y, = b.add_node("Linear", [h, ids["w2"]], name="fc2")
    r, = b.add_node("Elewise", [x, y], {"elewise_type": "add"}, name="residual")
    out, = b.add_node("LayerNorm", [r, ids["ln_w"], ids["ln_b"]], name="norm")
    b.mark_output(out)
    return b.build()


def mlp_weights(rng: np.random.Generator, dt: Dtype) -> dict[str, np.ndarray]:
    w = _weights(rng, {"w1": (INTER, HID), "b1": (INTER,), "w2": (HID, INTER), "ln_b": (HID,)}, dt)
    w["ln_w"] = (1 + 0.1 * rng.standard_normal(HID)).astype(dt.numpy).astype(np.float32)
    return w


def ffn_block(dt: Dtype, w: dict[str, np.ndarray]) -> Graph:
    """A gated FusedFeedForward given separate gate/up weights (the FusedFeedForward
    layer's form), plus a residual add."""
    b = GraphBuilder("verify_ffn_block")
    x = b.add_input("x", TensorDesc((B, S, HID), dt))
    ids = [b.add_weight(k, w[k].astype(dt.numpy)) for k in ("wg", "wu", "wd")]
    h, = b.add_node("FusedFeedForward", [x, *ids], {
        "hidden_size": HID, "intermediate_size": INTER, "activation_type": "swiglu"}, name="ffn")
    y, = b.add_node("ResidualAdd", [h, x], name="residual")
    b.mark_output(y)
    return b.build()


def ffn_weights(rng: np.random.Generator, dt: Dtype) -> dict[str, np.ndarray]:
    return _weights(rng, {"wg": (INTER, HID), "wu": (INTER, HID), "wd": (HID, INTER)}, dt)


def add_norm_block(dt: Dtype, w: dict[str, np.ndarray]) -> Graph:
    """x + GELU(x) -> LayerNorm; that + GELU(x) -> RmsNorm (the add+norm fusions)."""
    b = GraphBuilder("verify_add_norm_block")
    x = b.add_input("x", TensorDesc((B, S, HID), dt))
    ids = {k: b.add_weight(k, v.astype(dt.numpy)) for k, v in w.items()}
    h, = b.add_node("Gelu", [x], name="gelu")
    r, = b.add_node("Elewise", [x, h], {"elewise_type": "add"}, name="add1")
    a, = b.add_node("LayerNorm", [r, ids["ln_w"], ids["ln_b"]], name="ln")
    r2, = b.add_node("ResidualAdd", [a, h], name="add2")
    out, = b.add_node("RmsNorm", [r2, ids["rms_w"]], {"eps": 1e-6}, name="rms")
    b.mark_output(out)
    return b.build()


def add_norm_weights(rng: np.random.Generator, dt: Dtype) -> dict[str, np.ndarray]:
    w = _weights(rng, {"ln_b": (HID,)}, dt)
    for k in ("ln_w", "rms_w"):
        w[k] = (1 + 0.1 * rng.standard_normal(HID)).astype(dt.numpy).astype(np.float32)
    return w


def rope_cache_block(dt: Dtype, w: dict[str, np.ndarray]) -> Graph:
    """q/k/v projections, RoPE, k and v written into a paged cache (slots a permutation
    of its rows); out = rotated q + the cache read back in token order."""
    d = HID // HEADS
    b = GraphBuilder("verify_rope_cache_block")
    x = b.add_input("x", TensorDesc((B, S, HID), dt))
    ids = {k: b.add_weight(k, v.astype(dt.numpy)) for k, v in w.items() if k[0] == "w"}
    zeros = np.zeros((B, S, HEADS, d), dt.numpy)  # B blocks of S rows
    kc, vc = b.add_weight("key_cache", zeros), b.add_weight("value_cache", zeros.copy())
    pos = b.add_weight("pos", np.tile(np.arange(S, dtype=np.int64), (B, 1)))
    slots = b.add_weight("slots", np.random.default_rng(7).permutation(B * S).astype(np.int32))
    q, = b.add_node("Linear", [x, ids["wq"]], name="q")
    k, = b.add_node("Linear", [x, ids["wk"]], name="k")
    v, = b.add_node("Linear", [x, ids["wv"]], name="v")
    qr, kr = b.add_node("RoPE", [q, k, pos], {"num_heads": HEADS, "head_dim": d}, name="rope")
    kh, = b.add_node("Reshape", [kr], {"shape": (-1, HEADS, d)}, name="k_heads")
    vh, = b.add_node("Reshape", [v], {"shape": (-1, HEADS, d)}, name="v_heads")
    kc2, _ = b.add_node("ReshapeAndCache", [kh, vh, kc, vc, slots], name="write")
    flat, = b.add_node("Reshape", [kc2], {"shape": (B * S, HEADS, d)}, name="rows")
    back, = b.add_node("Gather", [flat, slots], name="read")          # token order
    out, = b.add_node("Elewise", [qr, b.add_node("Reshape", [back], {"shape": (B, S, HID)},
                                                 name="back")[0]],
                      {"elewise_type": "add"}, name="out")
    b.mark_output(out)
    return b.build()


def rope_cache_weights(rng: np.random.Generator, dt: Dtype) -> dict[str, np.ndarray]:
    return _weights(rng, {"wq": (HID, HID), "wk": (HID, HID), "wv": (HID, HID)}, dt)


# name -> (graph builder, weights, fusion level that exercises its rules)
GRAPHS: dict[str, tuple[Callable[[Dtype, dict], Graph], Callable[..., dict], str]] = {
    "llama_layer": (llama_layer, llama_weights, "standard"),
    "mlp_block": (mlp_block, mlp_weights, "standard"),
    "mlp_block_aggressive": (mlp_block, mlp_weights, "aggressive"),
    "ffn_block": (ffn_block, ffn_weights, "standard"),
    "add_norm_block": (add_norm_block, add_norm_weights, "standard"),
    "rope_cache_block": (rope_cache_block, rope_cache_weights, "standard"),
}


def build(name: str, dtype: str, seed: int = 0) -> tuple[Graph, Graph, np.ndarray, str]:
    """(graph in ``dtype``, its float32 twin, input x as float32 holding values
    exact in ``dtype``, fusion level)."""
    make, weights, level = GRAPHS[name]
    dt = Dtype.of(dtype)
    rng = np.random.default_rng(seed)
    w = weights(rng, dt)
    x = rng.standard_normal((B, S, HID)).astype(dt.numpy).astype(np.float32)
    return make(dt, w), make(Dtype.FP32, w), x, level


def run_graph(graph: Graph, x: Any, backend: str) -> list:
    """Outputs of ``graph`` node by node on ``backend`` (one Operation per node), so a
    fused op is checked on the kernel that backend runs for it."""
    from ..graph.analysis import topo_order
    from ..operation import Builder
    from ..tensor import convert, to_numpy

    from ..backends import get_backend

    native = get_backend(backend).native
    env: dict[str, Any] = {w: convert(np.array(to_numpy(a), copy=True), native)
                           for w, a in graph.weights}
    env[graph.inputs[0]] = convert(np.array(x, copy=True), native)
    builder = Builder(backend=backend)
    for n in topo_order(graph):
        ins = [env[t] if t else None for t in n.inputs]
        while ins and ins[-1] is None:
            ins.pop()
        env.update(zip(n.outputs, builder.build_operation(n.op, n.params).execute(ins)))
    return [env[o] for o in graph.outputs]
