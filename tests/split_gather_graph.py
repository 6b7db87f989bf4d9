"""A graph whose Split reads a planned buffer and whose Gather picks rows along axis 0
(a decoder's qkv split and last-token pick, small): for the front-ends' tests of how
the C kernels bind them (parts as views of the buffer for one row, bound copies for
several), checked against the NumPy backend running the same graph."""

from __future__ import annotations

import numpy as np

from atbcore.dtypes import Dtype
from atbcore.graph.builder import GraphBuilder
from atbcore.graph.ir import Graph
from atbcore.tensor import TensorDesc

H, K = 16, 8


def split_gather_graph(rows: int, picks: int) -> Graph:
    """``x [rows, H]`` -> ``h = x W^T [rows, 3K]`` -> q, k, v = split(h);
    outputs ``gather(v, idx)`` ``[picks, K]`` and ``(q + k) U^T`` ``[rows, H]``."""
    rng = np.random.default_rng(3)
    b = GraphBuilder("split_gather")
    x = b.add_input("x", TensorDesc((rows, H), Dtype.FP32))
    idx = b.add_input("idx", TensorDesc((picks,), Dtype.INT64))
    w = b.add_weight("w", (rng.standard_normal((3 * K, H)) / 4).astype(np.float32))
    u = b.add_weight("u", (rng.standard_normal((H, K)) / 3).astype(np.float32))
    h, = b.add_node("Linear", [x, w], name="qkv")
    q, k, v = b.add_node("Split", [h], {"dim": -1, "num": 3}, name="split")
    picked, = b.add_node("Gather", [v, idx], {"axis": 0}, name="pick")
    s, = b.add_node("ResidualAdd", [q, k], name="sum")
    out, = b.add_node("Linear", [s, u], name="out")
    b.mark_output(picked)
    b.mark_output(out)
    return b.build()
