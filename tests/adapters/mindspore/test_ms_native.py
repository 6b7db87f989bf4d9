"""atb's C kernels on MindSpore CPU tensors: views without a copy, the seed MLP
GraphOp bound to C calls (against the MindSpore compositions and the NumPy
reference), inputs that are strided or fresh from a MindSpore op."""

import numpy as np
import pytest

pytest.importorskip("mindspore", reason="mindspore is not installed")

from ms_cases import to_ms  # noqa: E402
from oracle import rand  # noqa: E402

import atbcore  # noqa: E402
from atbcore.backends.cpu_kernels import available  # noqa: E402
from atbcore.backends.cpu_kernels.native import dlpack_view, view_of  # noqa: E402
from atbcore.backends.cpu_kernels.native_kernels import native_off  # noqa: E402
from atbcore.dtypes import Dtype  # noqa: E402
from atbcore.numerics import assert_close  # noqa: E402
from atbcore.tensor import to_numpy  # noqa: E402

import atb_mindspore as atb  # noqa: E402
from atb_mindspore.backend.common import PATHS  # noqa: E402

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels did not build here")
H, I = 64, 96


def test_views_are_zero_copy_and_match_dlpack():
    t = to_ms(rand((3, 8), "fp16", 1))
    v, d = view_of(t), dlpack_view(t)
    assert v.address == d.address == t.data_ptr()
    assert v.shape == d.shape == (3, 8) and v.strides == d.strides == (8, 1)
    assert v.dtype is d.dtype is Dtype.FP16
    s = t.transpose(1, 0)
    assert view_of(s).address == t.data_ptr() and view_of(s).strides == (1, 8)


def _mlp():
    return atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=I), atb.SiLU(),
                        atb.Linear(out_features=H), atb.ResidualAdd()])


def test_mlp_graph_op_runs_bound_c_calls():
    mlp = _mlp()
    mlp(to_ms(rand((1, 1, H), "fp32", 0)))
    ref = atbcore.GraphOp(mlp.core.graph, backend="numpy")      # same graph and weights
    for rows in (1, 5):
        x = rand((1, rows, H), "fp32", rows)
        got = mlp(to_ms(x))
        assert_close(to_numpy(got), ref(x), "fp32", f"MLP {rows} rows vs the NumPy reference")
    plan = mlp.core.last_plan
    prog = list(plan.programs.values())[-1]
    assert all(prog.bound.values()), prog.bound
    assert all(c.backend == "mindspore" for c in plan.calls)
    assert "bound" in PATHS["LayerNorm"][0] and "bound" in PATHS["FusedFeedForward"][0]
    plain = atbcore.GraphOp(mlp.core.graph, backend="mindspore")
    with native_off():                                   # the MindSpore compositions
        y = plain(to_ms(x))
    assert not any(list(plain.last_plan.programs.values())[-1].bound.values())
    assert_close(to_numpy(got), to_numpy(y), "fp32", "C kernels vs MindSpore compositions")


def test_strided_and_freshly_computed_inputs():
    ms = pytest.importorskip("mindspore")
    mlp = _mlp()
    x = rand((1, 3, H), "fp32", 7)
    mlp(to_ms(x))
    ref = atbcore.GraphOp(mlp.core.graph, backend="numpy")
    wide = to_ms(np.ascontiguousarray(np.swapaxes(x, 1, 2)))       # [1, H, 3]
    strided = wide.transpose(0, 2, 1)                                # [1, 3, H], not contiguous
    assert not strided.is_contiguous()
    assert_close(to_numpy(mlp(strided)), ref(x), "fp32", "strided input")
    fresh = ms.ops.mul(to_ms(x), 2.0)                                # straight from an op
    assert_close(to_numpy(mlp(fresh)), ref(2 * x), "fp32", "input fresh from an op")


def test_bf16_ops_on_mindspore_tensors():
    x, w = rand((4, 40), "bf16", 1), rand((40,), "bf16", 2)
    op = atbcore.Builder().build_operation("RmsNorm", {})
    y, = op.execute([to_ms(x), to_ms(w)])
    assert op.last_backend == "mindspore" and PATHS["RmsNorm"][0].startswith("C kernel")
    ref, = atbcore.Builder(backend="numpy").build_operation("RmsNorm", {}).execute([x, w])
    assert_close(to_numpy(y), ref, "bf16", "bf16 RmsNorm")


@pytest.mark.parametrize("rows", [1, 3])
def test_split_of_a_planned_buffer_and_row_gather_bind_once(rows):
    """The qkv Split binds its parts once (views of the planned buffer for one row,
    bound copies for several) and Gather along axis 0 runs the C row gather; every
    run's outputs are its own (the first run's survive the second)."""
    from split_gather_graph import H as HID, split_gather_graph

    g = split_gather_graph(rows, 2)
    ref, op = atbcore.GraphOp(g, backend="numpy"), atbcore.GraphOp(g, backend="mindspore")
    runs = []
    for seed in (1, 2):
        x, idx = rand((rows, HID), "fp32", seed), np.array([rows - 1, 0], np.int64)
        runs.append((x, idx, op(to_ms(x), to_ms(idx))))
    for x, idx, got in runs:
        for a, b in zip(got, ref(x, idx)):
            assert_close(to_numpy(a), b, "fp32", f"{rows} rows vs the NumPy reference")
    prog = list(op.last_plan.programs.values())[-1]
    assert all(prog.bound.values()), prog.bound
    assert PATHS["Split"][0].endswith("views of the planned input" if rows == 1
                                      else "copies into bound parts")
    assert PATHS["Gather"][0].startswith("C kernel atb_gather_rows")
