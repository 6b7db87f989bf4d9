"""ReduceMean / ReduceSum: torch kernel vs NumPy reference, torch.mean/sum as an
independent oracle, bad input."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim,keepdim", [(-1, True), (0, False), ((0, 2), True), ((1, -1), False)])
def test_reductions_match_reference_and_torch(dtype, dim, keepdim):
    x = rand((3, 5, 769), dtype, seed=1)
    for op, fn in (("ReduceMean", torch.mean), ("ReduceSum", torch.sum)):
        ref = check_op(op, {"dim": dim, "keepdim": keepdim}, [x])
        gold = fn(torch.from_numpy(x.astype(np.float64)), dim=dim, keepdim=keepdim)
        atb.assert_close(ref[0], gold.numpy().astype(x.dtype), dtype, f"{op} vs torch")


def test_aliases_and_shapes():
    op = atb.Builder().build_operation("Mean", {"axes": [1], "keep_dims": True})
    assert op.infer_shape([atb.TensorDesc((2, 3, 4))]) == [atb.TensorDesc((2, 1, 4))]
    assert atb.Builder().build_operation("Sum", {"dim": -1}).infer_shape(
        [atb.TensorDesc((2, 3))]) == [atb.TensorDesc((2,))]


def test_bad_input():
    x = rand((2, 3))
    check_error("ReduceMean", {"dim": 2}, [x], atb.ShapeError, "dim 2 out of range")
    check_error("ReduceMean", {"dim": (1, -1)}, [x], atb.ShapeError, "one axis twice")
    check_error("ReduceMean", {}, [np.ones((2, 3), np.int32)], atb.DtypeError, "dtype")
    check_error("ReduceMean", {"dim": []}, [x], atb.ParamsError, "dim", build_error=True)
    check_error("ReduceSum", {"keepdim": "yes"}, [x], atb.ParamsError, "keepdim",
                build_error=True)
