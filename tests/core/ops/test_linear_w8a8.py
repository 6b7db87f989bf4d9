"""Linear ``quant="w8a8"``: the C w8a8 matmul (rows of x quantized on the fly) vs the
NumPy reference (the same per-row quantization in fp32, float64 sums), with bias and
residual, fp32 and bf16 activations; the bound plan equal to the unbound call; the
NumPy reference against an independent torch formulation; errors naming the op."""

import numpy as np
import pytest
import torch

from atbcore.errors import InputError
from atbcore.graph.builder import GraphBuilder
from atbcore.graph.graph_op import GraphOp
from atbcore.ops.linear import quantize_w8
from atbcore.ops.linear_quant import quantize_w8a8_rows
from atbcore.tensor import TensorDesc
from oracle import check_error, check_op, rand


def _w(n=48, k=64, seed=2):
    wq, s = quantize_w8(rand((n, k), "fp32", seed, 0.2))
    return wq, s.astype(np.float32)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 37, 130])
def test_against_reference(dtype, rows):
    wq, s = _w()
    x, b, r = rand((rows, 64), dtype, 1), rand((48,), dtype, 3), rand((rows, 48), dtype, 4)
    check_op("Linear", {"quant": "w8a8", "bias": True}, [x, wq, b, s])
    check_op("Linear", {"quant": "w8a8", "bias": True}, [x, wq, b, s, r])
    check_op("Linear", {"quant": "w8a8"}, [x, wq, s])


def test_reference_rows_match_torch_quantization():
    from atbcore.backends.cpu_kernels.torch_w8a8 import quantize_rows_reference

    x = rand((9, 33), "fp32", 7, 3.0)
    x[4] = 0.0                                                           # an all-zero row stays zero
    x[5] = np.abs(x[5])                                                  # zero point 1
    u, sx, z = quantize_rows_reference(torch.from_numpy(x))
    got_u, got_s, got_z = quantize_w8a8_rows(x)
    deq = (got_u.astype(np.float64) - got_z[:, None]) * np.asarray(got_s, np.float64)[:, None]
    np.testing.assert_array_equal(deq, ((u.double() - z.double()[:, None])
                                        * sx.double()[:, None]).numpy())
    assert not deq[4].any() and got_z[5] == 1


def test_bound_plan_equals_unbound_call():
    wq, s = _w()
    b = GraphBuilder("w8a8")
    x = b.add_input("x", TensorDesc((37, 64), "fp32"))
    ids = [b.add_weight(n, a) for n, a in (("w", wq), ("b", rand((48,), "fp32", 3)), ("s", s))]
    y, = b.add_node("Linear", [x, *ids], {"quant": "w8a8", "bias": True}, name="lin")
    b.mark_output(y)
    op = GraphOp(b.build())
    xs = torch.from_numpy(rand((37, 64), "fp32", 1))
    bound = op(xs)
    assert "w8a8" in op.explain()
    from atbcore.operation import Builder

    plain, = Builder().build_operation("Linear", {"quant": "w8a8", "bias": True}).execute(
        [xs, torch.from_numpy(wq), torch.from_numpy(rand((48,), "fp32", 3)), torch.from_numpy(s)])
    assert torch.equal(bound, plain)


def test_missing_scale_is_named():
    wq, _ = _w()
    check_error("Linear", {"quant": "w8a8", "bias": True}, [rand((3, 64), "fp32"), wq,
                                                           rand((48,), "fp32")],
                InputError, "Linear", "scale")
