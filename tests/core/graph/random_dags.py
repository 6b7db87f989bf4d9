"""A hypothesis strategy for random, valid graphs of small ops on ``[2, 3]`` tensors:
elementwise ops, residual adds, Linears (sometimes three on one input, sometimes a
bias add after), RmsNorm, SiLU, and exact duplicates of earlier nodes — enough to
give every clean-up pass and several fusion rules something to do."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from atbcore.graph.ir import Graph
from graphs import G, N

SHAPE = (2, 3)
_rng = np.random.default_rng(42)
WEIGHTS = {
    "c0": _rng.standard_normal(SHAPE).astype(np.float32),
    "b0": _rng.standard_normal(3).astype(np.float32),
    "g0": (1 + 0.1 * _rng.standard_normal(3)).astype(np.float32),
    **{f"wl{i}": (_rng.standard_normal((3, 3)) / 2).astype(np.float32) for i in range(3)},
}
KINDS = ["add", "mul", "sub", "neg", "tanh", "muls", "residual", "linear", "linear_bias",
         "qkv", "rmsnorm", "silu", "dup", "transposes", "reshapes"]


@st.composite
def dags(draw, max_nodes: int = 12) -> Graph:
    """A random valid graph (see the module docstring)."""
    n_in = draw(st.integers(1, 3))
    inputs = [f"in{i}" for i in range(n_in)]
    data = inputs + ["c0"]
    nodes = []
    k = 0

    def pick() -> str:
        # half the time the newest tensor: chains (Linear -> SiLU, add -> RmsNorm) form
        return data[-1] if draw(st.booleans()) else draw(st.sampled_from(data))

    def add(op, ins, data_out=True, **kw):
        nonlocal k
        name = f"n{k}"
        k += 1
        nodes.append(N(name, op, ins, **kw))
        if data_out:  # a [2, 3] tensor later nodes may read
            data.append(name)
        return name

    for _ in range(draw(st.integers(1, max_nodes))):
        kind = draw(st.sampled_from(KINDS))
        if kind in ("add", "mul", "sub"):
            add("Elewise", [pick(), pick()], elewise_type=kind)
        elif kind in ("neg", "tanh"):
            add("Elewise", [pick()], elewise_type=kind)
        elif kind == "muls":
            add("Elewise", [pick()], elewise_type="muls", scalar=0.5)
        elif kind == "residual":
            add("ResidualAdd", [pick(), pick()])
        elif kind == "linear":
            add("Linear", [pick(), f"wl{draw(st.integers(0, 2))}"])
        elif kind == "linear_bias":
            lin = add("Linear", [pick(), f"wl{draw(st.integers(0, 2))}"])
            add("Elewise", [lin, "b0"], elewise_type="add")
        elif kind == "qkv":
            x = pick()
            for i in range(3):
                add("Linear", [x, f"wl{i}"])
        elif kind == "rmsnorm":
            add("RmsNorm", [pick(), "g0"])
        elif kind == "transposes":   # [2, 3] -> [3, 2] -> [2, 3]
            t = add("Transpose", [pick()], data_out=False, perm=(1, 0))
            add("Transpose", [t], perm=(1, 0))
        elif kind == "reshapes":
            r = add("Reshape", [pick()], data_out=False, shape=(3, 2))
            add("Reshape", [r], shape=(2, 3))
        elif kind == "silu":
            add("SiLU", [pick()])
        elif kind == "dup" and any(n.outputs[0] in data for n in nodes):
            src = draw(st.sampled_from([n for n in nodes if n.outputs[0] in data]))
            name = f"n{k}"
            k += 1
            nodes.append(src.replace(name=name, outputs=(name,)))
            data.append(name)
    if not any(t.startswith("n") for t in data):
        add("Elewise", [pick()], elewise_type="neg")
    outs = draw(st.lists(st.sampled_from([t for t in data if t.startswith("n")]), min_size=1,
                         max_size=3,
                         unique=True))
    used = {t for n in nodes for t in n.inputs}
    weights = {k: v for k, v in WEIGHTS.items() if k in used}
    return G(nodes, {i: SHAPE for i in inputs}, outs, weights)


def inputs_for(g: Graph, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in g.inputs]
