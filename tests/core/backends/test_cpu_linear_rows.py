"""The C few-row matmul (decode GEMV) against a float64 NumPy reference and F.linear."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atbcore.backends.cpu_kernels import available
from atbcore.errors import ShapeError
from atbcore.numerics import assert_close

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


def _ref(x, w, scale=None, bias=None, acc=None):
    y = x.double().numpy() @ w.double().numpy().T
    if scale is not None:
        y = y * scale.double().numpy()
    if bias is not None:
        y = y + bias.double().numpy()
    if acc is not None:
        y = y + acc.double().numpy()
    return y


@pytest.mark.parametrize("m,k,n", [(1, 512, 768), (3, 77, 50), (4, 1376, 129), (9, 16, 17),
                                   (2, 130, 2000), (16, 77, 64), (32, 512, 1030), (5, 8, 3)])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_rows_float_weights(m, k, n, wdt):
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows

    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g).to(wdt)
    w = torch.randn(n, k, generator=g).to(wdt)
    b = torch.randn(n, generator=g).to(wdt)
    y = linear_rows(x, w, bias=b)
    assert y.dtype == wdt and y.shape == (m, n)
    dt = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[wdt]
    assert_close(y, _ref(x, w, bias=b).astype(np.float32), dt, "linear_rows")
    assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), dt, "vs F.linear")


@pytest.mark.parametrize("m", [1, 4, 7, 20])
def test_linear_rows_int8_scale_and_accumulate(m):
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 300, generator=g)
    w = torch.randint(-127, 128, (257, 300), generator=g, dtype=torch.int8)
    s = torch.rand(257, generator=g) / 100
    out = torch.randn(m, 257, generator=g)
    before = out.clone()
    y = linear_rows(x, w, scale=s, out=out, accumulate=True)
    assert y is out
    assert_close(out, _ref(x, w.float(), scale=s, acc=before).astype(np.float32), "fp32",
                 "linear_rows int8 accumulate")


def test_linear_rows_strided_input_and_threads():
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows

    x = torch.randn(4, 2 * 200)[:, ::2]                   # rows not unit-stride: copied
    w = torch.randn(3000, 200)
    from atbcore.backends.cpu_kernels.bindings import pool_stats

    keep = torch.get_num_threads()
    try:
        for th in (1, 2):
            torch.set_num_threads(th)
            before = pool_stats()
            assert_close(linear_rows(x, w), _ref(x, w).astype(np.float32), "fp32", "strided")
            after = pool_stats()
            handed = [after[k] - before[k] for k in ("parallel_jobs", "backoff_jobs")]
            # one thread never reaches the pool; two split the 2.4 MB weight (or back
            # off to one thread on a busy machine, which the pool counts too)
            assert sum(handed) == (0 if th == 1 else 1), (th, before, after)
    finally:
        torch.set_num_threads(keep)
    with pytest.raises(ValueError):
        linear_rows(x, w, accumulate=True)


@pytest.mark.parametrize("dt,m", [(torch.float32, 1), (torch.bfloat16, 3), (torch.float32, 12)])
def test_linear_rows_fused_rms_norm(dt, m):
    """RmsNorm inside the matmul: equal to the separate C RmsNorm kernel then the
    matmul (the same rounding of the normalised rows), and to float64 NumPy."""
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows
    from atbcore.backends.cpu_kernels.torch_ops import rms_norm

    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 96, generator=g) * 3).to(dt)
    w = torch.randn(40, 96, generator=g).to(dt)
    nw = (torch.rand(96, generator=g) + 0.5).to(dt)
    y = linear_rows(x, w, rms_norm_eps=1e-5, rms_norm_weight=nw)
    h, _ = rms_norm(x, nw, 96, 1e-5)
    assert torch.equal(y, linear_rows(h, w))
    xd = x.double().numpy()
    hd = xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + 1e-5) * nw.double().numpy()
    hd = torch.from_numpy(hd).to(dt).double().numpy()  # the rows are stored at x's dtype
    name = "fp32" if dt == torch.float32 else "bf16"
    assert_close(y, (hd @ w.double().numpy().T).astype(np.float32), name, "fused RmsNorm matmul")
    with pytest.raises(ShapeError, match="rms_norm_weight"):
        linear_rows(x, w, rms_norm_eps=1e-5, rms_norm_weight=nw[:50])
