"""atb's C kernels on Paddle CPU tensors: views without a copy (Paddle's data_ptr
equals its DLPack view), the seed MLP GraphOp bound to C calls (against Paddle's own
kernels and the NumPy reference), strided inputs, fallbacks with their reasons."""

import numpy as np
import pytest

pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import paddle  # noqa: E402
from oracle import rand  # noqa: E402
from paddle_cases import to_paddle  # noqa: E402

import atbcore  # noqa: E402
from atbcore.backends.cpu_kernels import available  # noqa: E402
from atbcore.backends.cpu_kernels.native import dlpack_view, view_of  # noqa: E402
from atbcore.backends.cpu_kernels.native_kernels import native_off  # noqa: E402
from atbcore.dtypes import Dtype  # noqa: E402
from atbcore.numerics import assert_close  # noqa: E402
from atbcore.tensor import to_numpy  # noqa: E402

import atb_paddle as atb  # noqa: E402
from atb_paddle.backend.common import PATHS, reset_paths  # noqa: E402

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels did not build here")
H, I = 64, 96


def test_views_are_zero_copy_and_match_dlpack():
    t = to_paddle(rand((3, 8), "bf16", 1))
    v, d = view_of(t), dlpack_view(t)
    assert v.address == d.address == t.data_ptr()
    assert v.shape == d.shape == (3, 8) and v.strides == d.strides == (8, 1)
    assert v.dtype is d.dtype is Dtype.BF16
    s = t.T
    assert view_of(s).address == t.data_ptr() and view_of(s).strides == (1, 8)


def _mlp():
    return atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=I), atb.SiLU(),
                        atb.Linear(out_features=H), atb.ResidualAdd()])


def test_mlp_graph_op_runs_bound_c_calls():
    mlp = _mlp()
    with paddle.no_grad():
        mlp(to_paddle(rand((1, 1, H), "fp32", 0)))
        core = mlp.core
        ref = atbcore.GraphOp(core.graph, backend="numpy")          # same graph and weights
        for rows in (1, 5):
            x = rand((1, rows, H), "fp32", rows)
            got = mlp(to_paddle(x))
            assert_close(to_numpy(got), ref(x), "fp32", f"MLP {rows} rows vs NumPy reference")
        prog = list(core.last_plan.programs.values())[-1]
        assert all(prog.bound.values()), prog.bound
        assert all(c.backend == "paddle" for c in core.last_plan.calls)
        plain = atbcore.GraphOp(core.graph, backend="paddle")
        with native_off():                                          # Paddle's own kernels
            y = plain(to_paddle(x))
        assert not any(list(plain.last_plan.programs.values())[-1].bound.values())
        assert_close(to_numpy(got), to_numpy(y), "fp32", "C kernels vs Paddle's kernels")
        strided = to_paddle(np.ascontiguousarray(np.swapaxes(x, 1, 2))).transpose([0, 2, 1])
        assert not strided.is_contiguous()
        assert_close(to_numpy(mlp(strided)), ref(x), "fp32", "strided input")


def test_fallbacks_are_counted_and_correct():
    reset_paths()
    x = rand((300, 24), "fp32", 1)                      # more rows than the C matmul takes
    w = rand((16, 24), "fp32", 2)
    op = atbcore.Builder().build_operation("Linear", {})
    y, = op.execute([to_paddle(x), to_paddle(w)])
    assert PATHS[("Linear", "native")] == 0 and op.last_backend == "paddle"
    assert_close(to_numpy(y), x.astype(np.float64) @ w.T.astype(np.float64), "fp32", "Linear")
    y, = op.execute([to_paddle(x[:4]), to_paddle(w)])
    assert PATHS[("Linear", "native")] == 1
    assert_close(to_numpy(y), x[:4].astype(np.float64) @ w.T.astype(np.float64), "fp32",
                 "Linear, 4 rows")


@pytest.mark.parametrize("rows", [1, 3])
def test_split_of_a_planned_buffer_and_row_gather_bind_once(rows):
    """The qkv Split binds its parts once (views of the planned buffer for one row,
    bound copies for several) and Gather along axis 0 runs the C row gather; every
    run's outputs are its own (the first run's survive the second)."""
    from split_gather_graph import H as HID, split_gather_graph

    reset_paths()
    g = split_gather_graph(rows, 2)
    ref, op = atbcore.GraphOp(g, backend="numpy"), atbcore.GraphOp(g, backend="paddle")
    runs = []
    for seed in (1, 2):
        x, idx = rand((rows, HID), "fp32", seed), np.array([rows - 1, 0], np.int64)
        runs.append((x, idx, op(to_paddle(x), to_paddle(idx))))
    for x, idx, got in runs:
        for a, b in zip(got, ref(x, idx)):
            assert_close(to_numpy(a), b, "fp32", f"{rows} rows vs the NumPy reference")
    prog = list(op.last_plan.programs.values())[-1]
    assert all(prog.bound.values()), prog.bound
    assert PATHS[("Split", "native")] >= 1 and PATHS[("Gather", "native")] >= 1
    assert PATHS[("Gather", "composed")] == 0
