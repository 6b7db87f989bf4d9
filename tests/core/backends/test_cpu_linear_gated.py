"""The C matmul with a gated activation in its epilogue (``linear_rows(gated=...)``: a
gated FFN's merged gate|up projection and its activation in one pass) against the
plain matmul followed by the activation kernel (bit for bit: the unfused graph), a
float64 NumPy reference of the formula, and torch.nn.functional; and its refusals."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atbcore.backends.cpu_kernels import available
from atbcore.errors import InputError, ShapeError
from atbcore.numerics import assert_close

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")

_ACTS = {"silu": lambda v: v / (1.0 + np.exp(-v)),
         "gelu": np.vectorize(lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))),
         "gelu_tanh": lambda v: 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi)
                                                         * (v + 0.044715 * v ** 3))),
         "relu": lambda v: np.maximum(v, 0.0)}


def _case(m, k, inter, wdt, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(2 * inter, k, generator=g) / k ** 0.5).to(wdt)
    b = torch.randn(2 * inter, generator=g) if bias else None
    return x, w, b


# 1 row (gate and up panels read together), 3..20 (row groups), 65 and 130 (blocks of
# 64 rows on the many-row path)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 20, 65, 130])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", sorted(_ACTS))
def test_gated_equals_matmul_then_activation(m, wdt, act):
    from atbcore.backends.cpu_kernels.torch_ops import activation
    from atbcore.backends.cpu_kernels.torch_linear import linear_rows, pack_panels

    x, w, b = _case(m, 72, 96, wdt, bias=m % 2 == 1, seed=m)
    pan = pack_panels(w)
    nw = torch.rand(72, generator=torch.Generator().manual_seed(1)) + 0.5
    for norm in ({}, {"rms_norm_eps": 1e-6, "rms_norm_weight": nw}):
        gu = linear_rows(x, w, panels=pan, bias=b, **norm)                   # [M, 2I] fp32
        unfused = activation(gu, act, split=True)
        got = linear_rows(x, w, panels=pan, bias=b, gated=act, **norm)
        assert got.shape == (m, 96) and got.dtype == torch.float32
        assert torch.equal(got, unfused), (act, m, norm.keys())
    # the formula in float64 (no norm), and torch.nn.functional's SwiGLU
    ref = x.double().numpy() @ w.double().numpy().T
    if b is not None:
        ref = ref + b.double().numpy()
    want = _ACTS[act](ref[:, :96]) * ref[:, 96:]
    got = linear_rows(x, w, panels=pan, bias=b, gated=act)
    assert_close(got, torch.from_numpy(want).float(), "fp32", f"gated {act}")
    if act == "silu":
        gate, up = F.linear(x, w.float(), None if b is None else b).chunk(2, dim=-1)
        assert_close(got, F.silu(gate) * up, "fp32", "F.silu(gate) * up")


def test_gated_bound_and_threads_equal_unbound():
    """The bound form (a decode plan's packed call) and 1 or 2 threads: the same bits."""
    from atbcore.backends.cpu_kernels.torch_linear import (linear_rows, linear_rows_bound,
                                                           linear_rows_bound_io, pack_panels)

    x, w, b = _case(16, 128, 64, torch.float32, bias=True, seed=5)
    pan = pack_panels(w)
    ref = linear_rows(x, w, panels=pan, bias=b, gated="silu", threads=1)
    out = torch.full((16, 64), float("nan"))
    call = linear_rows_bound(x, w, out, panels=pan, bias=b, gated="silu")
    call()
    assert torch.equal(out, ref)
    io = linear_rows_bound_io(x, w, torch.empty(16, 64), panels=pan, bias=b, gated="silu")
    out2 = torch.empty(16, 64)
    io(x, out2)
    assert torch.equal(out2, ref)
    assert torch.equal(linear_rows(x, w, panels=pan, bias=b, gated="silu", threads=2), ref)


def test_gated_refusals_leave_out_untouched():
    from atbcore.backends.cpu_kernels.torch_linear import linear_rows, pack_panels

    x, w, b = _case(4, 64, 64, torch.float32, bias=True, seed=9)
    pan = pack_panels(w)
    out = torch.full((4, 64), 7.0)
    odd = torch.randn(2 * 48, 64)                      # I = 48: the up half starts mid-panel
    bad = [(dict(w=odd, panels=pack_panels(odd), gated="silu"), ShapeError, "multiple of 32"),
           (dict(w=w, gated="silu"), InputError, "panels"),
           (dict(w=w, panels=pan, gated="swish2"), InputError, "gated"),
           (dict(w=w, panels=pan, gated="none"), InputError, "gated"),
           (dict(w=w, panels=pan, gated="silu", residual=torch.zeros(4, 64)), InputError,
            "residual"),
           (dict(w=w, panels=pan, gated="silu", accumulate=True), InputError, "accumulate"),
           (dict(w=w, panels=pan, gated="silu", out=torch.empty(4, 128)), ShapeError, "out")]
    for kw, err, word in bad:
        kw = dict(kw)
        wt = kw.pop("w")
        o = kw.pop("out", out)
        with pytest.raises(err, match=word):
            linear_rows(x, wt, out=o, **kw)
        assert torch.equal(out, torch.full((4, 64), 7.0))
    q = torch.randint(-127, 128, (128, 64), dtype=torch.int8)
    with pytest.raises(InputError, match="float weights"):
        linear_rows(x, q, scale=torch.ones(128), panels=pack_panels(q), gated="silu")


def test_native_gated_step_equals_the_torch_binding():
    """The NumPy / MindSpore / Paddle path (``linear_steps(gated=...)``) computes the
    torch binding's bits."""
    from atbcore.backends.cpu_kernels.native import view_of
    from atbcore.backends.cpu_kernels.native_ops import compile_steps, linear_steps
    from atbcore.backends.cpu_kernels.native_panels import panel_view
    from atbcore.backends.cpu_kernels.torch_linear import linear_rows, pack_panels

    x, w, b = _case(5, 64, 32, torch.float32, bias=True, seed=11)
    want = linear_rows(x, w, panels=pack_panels(w), bias=b, gated="gelu")
    xa, wa, ba = x.numpy(), w.numpy().copy(), b.numpy()
    ya = np.full((5, 32), np.nan, dtype=np.float32)
    views = [view_of(a) for a in (xa, wa, ba, ya)]
    pan = panel_view(views[1])
    assert pan is not None
    compile_steps(linear_steps(views[0], views[1], views[2], views[3], panels=pan,
                               gated="gelu"))({})
    np.testing.assert_array_equal(ya, want.numpy())
    with pytest.raises(InputError, match="gated"):
        linear_steps(views[0], views[1], views[2], views[3], gated="gelu")     # no panels
