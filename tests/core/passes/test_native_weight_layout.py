"""The weight-layout pass for NumPy tensors on the C kernels (``numpy_c``): the seed
MLP holds panels only and matches float64 NumPy (tests/native_layout_cases.py), and
a saved graph holds the logical weights (packed again when loaded)."""

import numpy as np
import pytest

from atbcore.backends.cpu_kernels import available
from atbcore.graph import layers as L
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.packed import PackedWeight
from native_layout_cases import H, I, check_packed_mlp
from oracle import rand

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels did not build here")


def _layers():
    return [L.LayerNorm("layer_norm", eps=1e-5).load_weights(
                {"weight": 1 + 0.1 * rand((H,), "fp32", 1), "bias": rand((H,), "fp32", 2)}),
            L.Linear("linear", out_features=I).load_weights(
                {"weight": rand((I, H), "fp32", 3, 0.2), "bias": rand((I,), "fp32", 4)}),
            L.SiLU("silu"),
            L.Linear("linear_1", out_features=H).load_weights(
                {"weight": rand((H, I), "fp32", 5, 0.2), "bias": rand((H,), "fp32", 6)}),
            L.ResidualAdd("residual_add")]


def test_numpy_c_mlp_holds_panels_only():
    op = GraphOp(_layers(), backend="numpy_c")
    check_packed_mlp(op, lambda x: x, "numpy_c")


def test_numpy_c_saved_graph_holds_logical_weights(tmp_path):
    from atbcore.graph.serialize import load_graph, save_graph

    layers = _layers()
    want = {f"{lay.name}.weight": lay.weights()["weight"].copy()
            for lay in layers if lay.name.startswith("linear")}
    op = GraphOp(layers, backend="numpy_c")
    x = rand((2, 3, H), "fp32", 9)
    y = op(x)
    save_graph(op.graph, tmp_path)
    g = load_graph(tmp_path)
    for t, w in want.items():
        assert type(op.graph.weight_map[t]) is PackedWeight
        np.testing.assert_array_equal(g.weight_map[t], w)
    np.testing.assert_array_equal(GraphOp(g, backend="numpy_c")(x), y)
