"""The C few-row matmul (decode GEMV) against a float64 NumPy reference and F.linear."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atbcore.backends.cpu_kernels import available
from atbcore.errors import InputError, ShapeError
from atbcore.numerics import assert_close
from atbcore.ops.linear_quant import act_q8

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
    xq = torch.from_numpy(act_q8(x.numpy()))  # w8 reads x as int8 blocks of 32
    assert_close(out, _ref(xq, w.float(), scale=s, acc=before).astype(np.float32), "fp32",
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
    with pytest.raises(InputError):
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


def test_pack_panels_layout():
    """Panel i holds outputs 32 i .. 32 i + 31 as [K, 32] columns, zeros past N."""
    from atbcore.backends.cpu_kernels.torch_decode import PANEL, pack_panels

    w = torch.randn(70, 9)
    p = pack_panels(w)
    assert PANEL == 32 and p.shape == (3, 9, 32) and p.is_contiguous()
    for n in range(70):
        assert torch.equal(p[n // 32, :, n % 32], w[n])
    assert not p[2, :, 70 - 64:].any()
    for dt in (torch.bfloat16, torch.float16, torch.int8):  # panels keep the dtype
        q = pack_panels(w.to(dt))
        assert q.dtype == dt and torch.equal(q[1, :, 3], w[35].to(dt))
    for bad in (w.double(), w[0]):
        with pytest.raises(ShapeError, match="pack_panels"):
            pack_panels(bad)
    with pytest.raises(ShapeError, match="out"):
        pack_panels(w, out=torch.empty(3, 9, 16))


@pytest.mark.parametrize("m,k,n", [(1, 512, 768), (3, 77, 50), (5, 1376, 129), (8, 16, 17),
                                   (9, 130, 2000), (16, 512, 64), (32, 512, 1030), (13, 8, 3)])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_linear_rows_panels(m, k, n, xdt):
    """The panel-packed weight: bias, the residual accumulated into out and the fused
    RmsNorm as with the [N, K] weight, against float64 NumPy and F.linear, over row
    counts around the 8-row tiles and N around the 32-output panels."""
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g).to(xdt)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    p = pack_panels(w)
    name = "fp32" if xdt == torch.float32 else "bf16"
    y = linear_rows(x, w, bias=b, panels=p)
    assert y.dtype == xdt and y.shape == (m, n)
    assert_close(y, _ref(x.float(), w, bias=b).astype(np.float32), name, "panels + bias")
    assert_close(y.float(), F.linear(x.float(), w, b), name, "panels vs F.linear")
    out = torch.randn(m, n, generator=g).to(xdt)
    before = out.clone()
    assert linear_rows(x, w, out=out, accumulate=True, panels=p) is out
    assert_close(out, _ref(x.float(), w, acc=before.float()).astype(np.float32), name,
                 "panels accumulate")
    nw = torch.rand(k, generator=g) + 0.5
    fused = linear_rows(x, w, rms_norm_eps=1e-6, rms_norm_weight=nw.to(xdt), panels=p)
    assert torch.equal(fused, linear_rows(x, w, rms_norm_eps=1e-6, rms_norm_weight=nw.to(xdt),
                                          panels=p))
    from atbcore.backends.cpu_kernels.torch_ops import rms_norm

    h, _ = rms_norm(x, nw.to(xdt), k, 1e-6)
    assert torch.equal(fused, linear_rows(h, w, panels=p))


@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("m", [1, 9, 70])
def test_linear_rows_panels_half_and_int8_weights(wdt, m):
    """bf16/fp16 panels (and int8 ones with a per-channel scale) widened in registers:
    equal to float64 NumPy on the same weights, bf16 activations included."""
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 200, generator=g)
    if wdt == torch.int8:
        w = torch.randint(-127, 128, (99, 200), generator=g, dtype=torch.int8)
        s = torch.rand(99, generator=g) / 100
    else:
        w, s = torch.randn(99, 200, generator=g).to(wdt), None
    b = torch.randn(99, generator=g)
    p = pack_panels(w)
    # w8 reads x as int8 blocks of 32: the reference quantizes it the same way
    xr = (lambda t: torch.from_numpy(act_q8(t.float().numpy()))) if s is not None else \
        (lambda t: t.float())
    y = linear_rows(x, w, scale=s, bias=b, panels=p)
    assert_close(y, _ref(xr(x), w.float(), scale=s, bias=b).astype(np.float32), "fp32",
                 f"{wdt} panels")
    assert torch.equal(y, linear_rows(x, w, scale=s, bias=b, panels=p.clone()))
    yb = linear_rows(x.bfloat16(), w, scale=s, bias=b.bfloat16(), panels=p)
    assert yb.dtype == torch.bfloat16
    assert_close(yb, _ref(xr(x.bfloat16()), w.float(), scale=s,
                          bias=b.bfloat16()).astype(np.float32), "bf16", f"{wdt} panels, bf16 x")


def test_linear_rows_panels_threads_and_bad_panels():
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 512, generator=g), torch.randn(3000, 512, generator=g)
    p = pack_panels(w)
    keep, ys = torch.get_num_threads(), []
    try:
        for th in (1, 2):
            torch.set_num_threads(th)
            ys.append(linear_rows(x, w, panels=p))
    finally:
        torch.set_num_threads(keep)
    assert torch.equal(ys[0], ys[1])  # each output's sum is one thread's, in one order
    assert_close(ys[0], _ref(x, w).astype(np.float32), "fp32", "panels, 1 and 2 threads")
    out = torch.zeros(16, 3000)
    for bad, wt in ((p[:-1], w), (p.bfloat16(), w), (p, w.bfloat16()), (p.transpose(1, 2), w)):
        with pytest.raises(ShapeError, match="panels"):
            linear_rows(x.to(wt.dtype), wt, panels=bad, out=out)
    assert not out.any()


@pytest.mark.parametrize("m,k,n", [(65, 512, 96), (200, 77, 1030), (130, 1376, 40)])
def test_linear_rows_panels_many_rows(m, k, n):
    """Prefill-sized calls on panels: rows in blocks of 64 (tails included) on the
    OpenMP team, the same bits with one or two threads, equal to float64 NumPy and
    F.linear, written into a given out."""
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(m + k + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    p = pack_panels(w)
    keep, ys = torch.get_num_threads(), []
    try:
        for th in (1, 2):
            torch.set_num_threads(th)
            out = torch.full((m, n), float("nan"))
            assert linear_rows(x, w, bias=b, out=out, panels=p) is out
            ys.append(out)
    finally:
        torch.set_num_threads(keep)
    assert torch.equal(ys[0], ys[1])
    assert_close(ys[1], _ref(x, w, bias=b).astype(np.float32), "fp32", "panels, many rows")
    assert_close(ys[1], F.linear(x, w, b), "fp32", "panels vs F.linear")


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("m", [3, 7, 9, 16, 20, 29])
def test_linear_rows_panels_row_independent_of_tile(wdt, m):
    """A row's outputs do not depend on which tile of the batch it lands in (the
    many-row tiles sum each output in the decode tile's order): every row of an m-row
    call equals that row alone, bit for bit, for each weight dtype. The row counts
    reach every AVX2 tile (half tiles of 3..6 rows, pairs) and group split: 3 (a 3-row
    half tile), 7 (5 + a pair), 9 (5 + 4), 16 (6 + 6 + 4), 20 (groups of 14 = 6 + 6 + 2
    and 6), 29 (18 = 6 + 6 + 6 and 11 = 6 + 5)."""
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(29)
    k, n = 300, 70
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    scale = None
    if wdt == torch.int8:
        w, scale = (w * 40).round().clamp(-127, 127).to(torch.int8), torch.rand(n, generator=g)
    else:
        w = w.to(wdt)
        x = x.to(wdt)
    p = pack_panels(w)
    y = linear_rows(x, w, scale=scale, panels=p, threads=2)
    for i in range(m):
        assert torch.equal(linear_rows(x[i:i + 1], w, scale=scale, panels=p), y[i:i + 1]), i
    xr = x.double().numpy() if scale is None else act_q8(x.numpy())  # w8: int8 blocks of x
    ref = xr @ w.double().numpy().T
    if scale is not None:
        ref = ref * scale.double().numpy()
    assert_close(y.float(), ref.astype(np.float32), "fp32" if wdt != torch.bfloat16 else "bf16",
                 "panels, rows of every tile")
