"""Graphs spelled from primitive ops that ``atb verify`` fuses to check every
fusion rule: a LLaMA decoder layer (RMSNorm written out, separate q/k/v, RoPE,
attention as MatMul/Softmax/MatMul, gated MLP) and a BERT-style MLP block
(Linear + bias add, exact GELU, residual + LayerNorm), and a FusedFeedForward on
separate gate/up weights. Between them every
built-in rule fires; :func:`rule_graphs` says which graph exercises which rule.

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


# name -> (graph builder, weights, fusion level that exercises its rules)
GRAPHS: dict[str, tuple[Callable[[Dtype, dict], Graph], Callable[..., dict], str]] = {
    "llama_layer": (llama_layer, llama_weights, "standard"),
    "mlp_block": (mlp_block, mlp_weights, "standard"),
    "mlp_block_aggressive": (mlp_block, mlp_weights, "aggressive"),
    "ffn_block": (ffn_block, ffn_weights, "standard"),
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
