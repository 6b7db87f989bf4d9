"""Dense fp32 Linears on the CPU run on the C matmul at every row count (residual in
its epilogue), LinearActivation of many rows as one oneDNN GEMM: a GraphOp's bound plan
equals the NumPy reference and the unbound kernel bit for bit, and explain() names the
layout."""

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
    # one path at every row count: the layout pass packed the weight for the C matmul
    assert "oneDNN" not in text
    assert "weight weight: 32-output panels" in text
    # the unbound kernel (what an unbound plan runs) computes the same bits
    from atbcore.backends.torch.linear import linear
    from atbcore.ops.registry import get_op

    p = get_op("Linear").Params(bias=True)
    again, = linear(p, {"x": x, "weight": torch.from_numpy(w), "bias": torch.from_numpy(b),
                        "residual": r})
    assert torch.equal(out, again)


def _linear_gelu_graph(w, b, x):
    gb = GraphBuilder("lin_gelu")
    x = gb.add_input("x", x)
    wt, bt = gb.add_weight("w", w), gb.add_weight("b", b)
    y, = gb.add_node("Linear", [x, wt, bt], {"bias": True}, name="lin")
    out, = gb.add_node("Activation", [y], {"activation_type": "gelu"}, name="act")
    gb.mark_output(out)
    return gb.build()


@pytest.mark.parametrize("rows", [DNNL_MIN_ROWS // 2, DNNL_MIN_ROWS + 1, 300])
def test_bf16_linear_gelu_by_row_count(rows):
    """bf16 Linear + GELU (an encoder's FFN up projection) fused into one
    LinearActivation: above DNNL_MIN_ROWS one oneDNN GEMM (with the GELU post-op in
    bf16 where oneDNN has a bf16 inner product, else on operands widened to fp32 and
    the C GELU after it); fewer rows the composite. Either way fp32 sums and one rounding: the float64
    reference of the bf16 values within bf16's tolerance, bound equal to unbound."""
    from math import erf

    g = np.random.default_rng(rows + 7)
    w = torch.from_numpy(g.standard_normal((72, 40)).astype(np.float32) * 0.2).bfloat16()
    b = torch.from_numpy(g.standard_normal(72).astype(np.float32)).bfloat16()
    x = torch.from_numpy(g.standard_normal((rows, 40)).astype(np.float32)).bfloat16()
    op = atbcore.GraphOp(_linear_gelu_graph(w, b, x))
    out = op(x)
    assert out.dtype == torch.bfloat16
    pre = x.double().numpy() @ w.double().numpy().T + b.double().numpy()
    ref = pre * 0.5 * (1.0 + np.vectorize(erf)(pre / np.sqrt(2.0)))
    assert_close(out, torch.from_numpy(ref).bfloat16(), "bf16", f"bf16 linear + gelu, {rows} rows")
    text = op.explain()
    after = text[text.index("After fusion"):]
    assert "LinearActivation" in after and "Activation(" not in after.replace(
        "LinearActivation(", "")
    many = rows > DNNL_MIN_ROWS and dnnl_available()
    assert ("[out, in] rows (oneDNN)" in text) == many
    from atbcore.backends.torch.fused import linear_activation
    from atbcore.ops.registry import get_op

    p = get_op("LinearActivation").Params(bias=True, activation_type="gelu")
    again, = linear_activation(p, {"x": x, "weight": w, "bias": b})
    assert torch.equal(out, again)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("rows", [DNNL_MIN_ROWS + 1, 257])
def test_fp32_linear_activation_many_rows_matches_reference_and_unfused(act, rows):
    """fp32 Linear + activation of many rows (the FFN up projection of an encoder
    batch): the oneDNN GEMM, then the C activation in place. The float64 reference
    of the formula within fp32's tolerance; with +-inf and NaN among the inputs, the
    same values as the unfused graph (the GEMM and the activation op run apart)
    wherever the Linear's own result is finite or +-inf, NaN where it is NaN."""
    from math import erf, tanh

    g = np.random.default_rng(rows)
    w = g.standard_normal((72, 40)).astype(np.float32) * 0.2
    b = g.standard_normal(72).astype(np.float32)
    x = torch.from_numpy(g.standard_normal((rows, 40)).astype(np.float32))
    gb = GraphBuilder("lin_act")
    xi = gb.add_input("x", x)
    wt, bt = gb.add_weight("w", w), gb.add_weight("b", b)
    y, = gb.add_node("Linear", [xi, wt, bt], {"bias": True}, name="lin")
    out, = gb.add_node("Activation", [y], {"activation_type": act}, name="act")
    gb.mark_output(out)
    graph = gb.build()
    fused = atbcore.GraphOp(graph)
    unfused = atbcore.GraphOp(graph, fusion_config={"fusion_level": "conservative"})
    pre = x.double().numpy() @ w.T.astype(np.float64) + b
    formula = {"gelu": np.vectorize(lambda v: 0.5 * v * (1.0 + erf(v / np.sqrt(2.0)))),
               "gelu_tanh": np.vectorize(lambda v: 0.5 * v * (1.0 + tanh(
                   np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3)))),
               "relu": lambda v: np.maximum(v, 0.0)}[act]
    got = fused(x)
    assert_close(got, torch.from_numpy(formula(pre)).float(), "fp32", f"{act}, {rows} rows")
    text = fused.explain()
    assert "LinearActivation" in text[text.index("After fusion"):]
    assert ("[out, in] rows (oneDNN)" in text) == dnnl_available()
    x_bad = x.clone()
    x_bad[3, 0], x_bad[5, 1], x_bad[7, 2] = float("inf"), float("-inf"), float("nan")
    w_big = x_bad.clone()
    w_big[9] = 1e30  # a finite input whose products overflow to +-inf
    for xb in (x_bad, w_big):
        a, r = fused(xb), unfused(xb)
        assert torch.equal(a.isnan(), r.isnan()), act
        fin = ~r.isnan()
        assert torch.equal(a[fin].isinf(), r[fin].isinf()), act
        np.testing.assert_allclose(a[fin].numpy(), r[fin].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not dnnl_available(), reason="torch built without oneDNN (mkldnn)")
def test_onednn_linear_runs_on_torch_threads_beside_few_row_c_matmuls(monkeypatch):
    """A program whose C matmuls are all few-row runs parks torch's pool at one thread;
    a oneDNN GEMM in it (a many-row LinearActivation) runs on torch's pool, so the
    program must not park (parked, the compiled MiniLM's oneDNN GEMMs ran on one
    thread: 0.5x HF's time)."""
    import atbcore.backends.torch.linear_dnnl as ld

    g = np.random.default_rng(3)
    w1, w2 = (g.standard_normal((48, 40)).astype(np.float32) for _ in range(2))
    x = torch.from_numpy(g.standard_normal((300, 40)).astype(np.float32))
    y = torch.from_numpy(g.standard_normal((2, 40)).astype(np.float32))
    gb = GraphBuilder("many_and_few")
    xi, yi = gb.add_input("x", x), gb.add_input("y", y)
    a, = gb.add_node("LinearActivation", [xi, gb.add_weight("w1", w1)],
                     {"bias": False, "activation_type": "relu"}, name="many")
    b, = gb.add_node("Linear", [yi, gb.add_weight("w2", w2)], {"bias": False}, name="few")
    gb.mark_output(a)
    gb.mark_output(b)
    op = atbcore.GraphOp(gb.build())
    seen = []
    orig = ld.dnnl_linear_activation

    def spy(*args, **kw):
        seen.append(torch.get_num_threads())
        return orig(*args, **kw)
    monkeypatch.setattr(ld, "dnnl_linear_activation", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(3):
            out_a, out_b = op(x, y)
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2, 2]
    ref_a = np.maximum(x.double().numpy() @ w1.T.astype(np.float64), 0.0)
    assert_close(out_a, torch.from_numpy(ref_a).float(), "fp32", "oneDNN LinearActivation")
    assert_close(out_b, torch.from_numpy(y.double().numpy() @ w2.T.astype(np.float64)).float(),
                 "fp32", "C Linear")
