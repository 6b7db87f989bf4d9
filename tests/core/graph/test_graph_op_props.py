"""Property: on random DAGs made of patterns the fusion rules know (primitive RMSNorm,
residual add + norm, Linear + bias + activation, three Linears on one input), the
GraphOp at ``standard`` fusion gives the same results as the unfused graph run on
the NumPy reference (G1's interpreter, independent of the runtime)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import atbcore as atb
from atbcore.graph.builder import GraphBuilder
from atbcore.graph.graph_op import GraphOp
from atbcore.tensor import TensorDesc
from interp import run_graph

H = 16


@st.composite
def fusable_dag(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    b = GraphBuilder("rand")
    pool = [b.add_input("x", TensorDesc((2, 3, H))), b.add_input("r", TensorDesc((2, 3, H)))]
    eps = b.add_weight("eps", np.array([1e-6], np.float32))
    k = 0

    def w(*shape, scale=None):
        nonlocal k
        k += 1
        s = scale if scale is not None else 1 / np.sqrt(shape[-1])
        return b.add_weight(f"w{k}", (rng.standard_normal(shape) * s).astype(np.float32))

    def pick():
        return draw(st.sampled_from(pool))

    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["prim_rms", "add_rms", "linear_act", "qkv", "silu"]))
        t = pick()
        if kind == "prim_rms":  # x * rsqrt(mean(x*x) + eps) * w
            sq, = b.add_node("Elewise", [t, t], {"elewise_type": "mul"})
            ms, = b.add_node("ReduceMean", [sq], {"dim": -1, "keepdim": True})
            ad, = b.add_node("Elewise", [ms, eps], {"elewise_type": "add"})
            rs, = b.add_node("Elewise", [ad], {"elewise_type": "rsqrt"})
            xn, = b.add_node("Elewise", [t, rs], {"elewise_type": "mul"})
            out, = b.add_node("Elewise", [w(H, scale=0.1), xn], {"elewise_type": "mul"})
            pool.append(out)
        elif kind == "add_rms":
            s, = b.add_node("ResidualAdd", [t, pick()])
            pool += [s, b.add_node("RmsNorm", [s, w(H, scale=0.1)])[0]]
        elif kind == "linear_act":
            y, = b.add_node("Linear", [t, w(H, H), w(H, scale=0.1)])
            pool.append(b.add_node(draw(st.sampled_from(["SiLU", "Gelu", "Relu"])), [y])[0])
        elif kind == "qkv":
            q, kk, v = (b.add_node("Linear", [t, w(H, H)])[0] for _ in range(3))
            pool += [b.add_node("ResidualAdd", [q, kk])[0], v]
        else:
            pool.append(b.add_node("SiLU", [t])[0])
    outs = draw(st.lists(st.sampled_from(pool[2:]), min_size=1, max_size=3, unique=True))
    b.mark_output(*outs)
    return b.build()


@settings(max_examples=25, deadline=None)
@given(fusable_dag(), st.integers(0, 1000))
def test_fused_and_unfused_graphs_agree(g, seed):
    rng = np.random.default_rng(seed)
    x, r = (rng.standard_normal((2, 3, H)).astype(np.float32) for _ in range(2))
    op = GraphOp(g)
    got = op.execute([x, r])
    assert len(op.graph.nodes) <= len(g.nodes)
    want = run_graph(g, [x, r])
    for i, (a, e) in enumerate(zip(got, want)):
        atb.assert_close(a, e, what=f"output {i} ({g.outputs[i]}) fused vs unfused")
