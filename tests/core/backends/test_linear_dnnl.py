"""Dense fp32 Linears of many rows on the CPU run as one oneDNN GEMM (residual as a
binary post-op), fewer rows on the C matmul: a GraphOp's bound plan equals the
NumPy reference and the unbound kernel bit for bit, and explain() names the layout."""

import numpy as np
import pytest
import torch

import atbcore
from atbcore.backends.torch.linear_dnnl import DNNL_MIN_ROWS, dnnl_available
from atbcore.graph.builder import GraphBuilder
from atbcore.numerics import assert_close


def _linear_residual_graph(w, b, x, r):
    gb = GraphBuilder("lin_res")
    x, r = gb.add_input("x", x), gb.add_input("r", r)
    wt, bt = gb.add_weight("w", w), gb.add_weight("b", b)
    y, = gb.add_node("Linear", [x, wt, bt], {"bias": True}, name="lin")
    out, = gb.add_node("ResidualAdd", [y, r], name="add")
    gb.mark_output(out)
    return gb.build()


@pytest.mark.parametrize("rows", [DNNL_MIN_ROWS // 2, DNNL_MIN_ROWS + 1, 300])
def test_linear_with_residual_by_row_count(rows):
    g = np.random.default_rng(rows)
    w = g.standard_normal((48, 40)).astype(np.float32)
    b = g.standard_normal(48).astype(np.float32)
    x = torch.from_numpy(g.standard_normal((rows, 40)).astype(np.float32))
    r = torch.from_numpy(g.standard_normal((rows, 48)).astype(np.float32))
    op = atbcore.GraphOp(_linear_residual_graph(w, b, x, r))
    out = op(x, r)
    ref = x.double().numpy() @ w.T.astype(np.float64) + b + r.double().numpy()
    assert_close(out, torch.from_numpy(ref).float(), "fp32", f"linear + residual, {rows} rows")
    text = op.explain()
    assert "ResidualAdd" not in text[text.index("After fusion"):]      # in the GEMM epilogue
    many = rows > DNNL_MIN_ROWS and dnnl_available()
    assert ("[out, in] rows (oneDNN)" in text) == many
    assert ("weight weight: 32-output panels" in text) == (not many)
    # the unbound kernel (what an unbound plan runs) computes the same bits
    from atbcore.backends.torch.linear import linear
    from atbcore.ops.registry import get_op

    p = get_op("Linear").Params(bias=True)
    again, = linear(p, {"x": x, "weight": torch.from_numpy(w), "bias": torch.from_numpy(b),
                        "residual": r})
    assert torch.equal(out, again)
