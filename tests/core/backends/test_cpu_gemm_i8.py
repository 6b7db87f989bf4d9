"""The w8a8 matmul (csrc/gemm_i8.c: per-row int8 activations x int8 weights, VNNI
where the CPU has it) against float64 NumPy references: the packed layout, the
activation quantization, odd sizes and K tails, bias / residual / accumulate /
RmsNorm'd rows, and 1 vs 2 threads bit-equal."""

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.errors import ShapeError
from atbcore.numerics import assert_close

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


def _quantize_np(x):
    """The kernel's row quantization in NumPy fp32: (u - z as float64, sx)."""
    from atbcore.ops.linear_quant import quantize_w8a8_rows

    u, sx, z = quantize_w8a8_rows(x.float().numpy())
    return u.astype(np.float64) - z[:, None], sx


def _ref(x, wq, s, bias=None, add=None):
    """float64 ((u - z) sx) (wq s)^T + bias + add."""
    q, sx = _quantize_np(x)
    y = (q.astype(np.float64) @ wq.double().numpy().T) * sx[:, None].astype(np.float64)
    y = y * s.double().numpy()
    if bias is not None:
        y = y + bias.double().numpy()
    if add is not None:
        y = y + add.double().numpy()
    return y


def _weights(g, n, k):
    from atbcore.ops.linear import quantize_w8

    wq, s = quantize_w8(torch.randn(n, k, generator=g))
    return wq, s.float()


def test_pack_w8a8_layout():
    from atbcore.backends.cpu_kernels.torch_w8a8 import pack_w8a8, w8a8_shape

    g = torch.Generator().manual_seed(0)
    n, k = 45, 10
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    p = pack_w8a8(w)
    assert p.shape == w8a8_shape(n, k) == (2, 4, 32, 4)
    wn, pn = w.numpy(), p.numpy()
    for i, q, j, t in [(0, 0, 0, 0), (0, 2, 31, 1), (1, 1, 12, 3), (1, 2, 12, 1)]:
        assert pn[i, q, j, t] == wn[32 * i + j, 4 * q + t]
    assert not pn[1, :3, 13:].any() and not pn[:, 2, :, 2:].any()  # zeros past N and K
    sums = pn[:, 3].copy().view(np.int32).reshape(-1)             # the last row: int32 sums
    np.testing.assert_array_equal(sums[:n], wn.astype(np.int64).sum(axis=1))
    assert not sums[n:].any()


@pytest.mark.parametrize("m,k,n", [(1, 33, 45), (3, 257, 97), (9, 1, 31), (70, 130, 64),
                                   (131, 515, 33)])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_w8a8_against_float64(m, k, n, xdt):
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8

    g = torch.Generator().manual_seed(m * 31 + k + n)
    x = torch.randn(m, k, generator=g).to(xdt)
    if m > 1:
        x[m // 2] = 0  # a zero row: scale 0, outputs = bias
    wq, s = _weights(g, n, k)
    b = torch.randn(n, generator=g)
    y = linear_w8a8(x, pack_w8a8(wq), s, bias=b, out=torch.empty(m, n))
    assert_close(y, _ref(x, wq, s, bias=b).astype(np.float32), "fp32", "w8a8")
    yx = linear_w8a8(x, pack_w8a8(wq), s, bias=b)
    assert yx.dtype == xdt
    if xdt == torch.bfloat16:
        assert_close(yx, _ref(x, wq, s, bias=b).astype(np.float32), "bf16", "w8a8 bf16 out")
    # the quantization error against the unquantized product stays small
    full = x.double().numpy() @ (wq.double() * s.double()[:, None]).numpy().T
    yd = y.double().numpy() - b.double().numpy()
    cos = (yd * full).sum() / (np.linalg.norm(yd) * np.linalg.norm(full))
    assert cos > 0.999


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 13])
def test_w8a8_full_int8_range_exact(m):
    """Weights at -128 and 127 against activations at +-127 (the extremes of every
    tile's products: an int16 pair sum of the AVX2 tile reaches 2 x 128 x 127; rows
    spanning [-127, 127] quantize to u = x + 128, z = 128, sx = 1): the int32 sums are
    exact, so y / (sx scale) is the integer product in float64, for every row count of
    a tile's tail."""
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8

    g = torch.Generator().manual_seed(40 + m)
    n, k = 50, 263
    wq = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    wq[:, ::3] = -128
    wq[::2, 1::3] = 127
    x = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0) * 127
    x[:, ::5] = torch.randint(-127, 128, (m, len(range(0, k, 5))), generator=g).float()
    s = torch.ones(n)
    y = linear_w8a8(x, pack_w8a8(wq), s, threads=2).double().numpy()
    exact = x.double().numpy() @ wq.double().numpy().T   # sx = 1: x already on the grid
    np.testing.assert_array_equal(y, exact.astype(np.float32).astype(np.float64))


@pytest.mark.parametrize("m", [1, 5, 130])
def test_w8a8_threads_residual_accumulate(m):
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8

    g = torch.Generator().manual_seed(m)
    k, n = 300, 257
    x = torch.randn(m, k, generator=g)
    wq, s = _weights(g, n, k)
    p = pack_w8a8(wq)
    r = torch.randn(m, n, generator=g)
    y1 = linear_w8a8(x, p, s, residual=r, threads=1)
    y2 = linear_w8a8(x, p, s, residual=r, threads=2)
    assert torch.equal(y1, y2)
    assert_close(y1, _ref(x, wq, s, add=r).astype(np.float32), "fp32", "w8a8 + residual")
    out = r.clone()
    assert linear_w8a8(x, p, s, out=out, accumulate=True) is out
    assert torch.equal(out, y1)


def test_w8a8_rms_normed_rows():
    from atbcore.backends.cpu_kernels import torch_ops as ck
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8

    g = torch.Generator().manual_seed(5)
    m, k, n = 6, 96, 70
    x = torch.randn(m, k, generator=g)
    nw = torch.rand(k, generator=g)
    wq, s = _weights(g, n, k)
    y = linear_w8a8(x, pack_w8a8(wq), s, rms_norm_eps=1e-6, rms_norm_weight=nw)
    normed = ck.rms_norm(x, nw, k, 1e-6)[0]
    assert_close(y, _ref(normed, wq, s).astype(np.float32), "fp32", "w8a8 of normed rows")


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_w8a8_rms_normed_rows_split_over_threads(xdt):
    """Enough rows that the RmsNorm and the quantization split over the threads (each
    thread norms its own rows): 1 and 2 threads bit-equal, both the product of the
    separately normed rows (odd K: a quad tail)."""
    from atbcore.backends.cpu_kernels import torch_ops as ck
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8

    g = torch.Generator().manual_seed(6)
    m, k, n = 300, 515, 70
    x = (torch.randn(m, k, generator=g) * 3).to(xdt)
    nw = torch.rand(k, generator=g).to(xdt)
    wq, s = _weights(g, n, k)
    p = pack_w8a8(wq)
    y1, y2 = (linear_w8a8(x, p, s, rms_norm_eps=1e-6, rms_norm_weight=nw, threads=t,
                          out=torch.empty(m, n)) for t in (1, 2))
    assert torch.equal(y1, y2)
    normed = ck.rms_norm(x, nw, k, 1e-6)[0]
    assert normed.dtype == xdt
    assert torch.equal(y1, linear_w8a8(normed, p, s, threads=2, out=torch.empty(m, n)))
    assert_close(y1, _ref(normed, wq, s).astype(np.float32), "fp32", "w8a8 of normed rows")


def test_quantize_rows_reference_matches_numpy():
    from atbcore.backends.cpu_kernels.torch_w8a8 import quantize_rows_reference

    from atbcore.ops.linear_quant import quantize_w8a8_rows

    x = torch.randn(7, 50, generator=torch.Generator().manual_seed(2))
    x[1] = x[1].abs()          # one-signed rows: z 1 (all >= 0) and 255 (all <= 0)
    x[2] = -x[2].abs()
    x[3] = 0
    u, sx, z = quantize_rows_reference(x)
    un, sxn, zn = quantize_w8a8_rows(x.numpy())
    np.testing.assert_array_equal(u.numpy(), un)
    np.testing.assert_array_equal(sx.numpy(), sxn)
    np.testing.assert_array_equal(z.numpy(), zn)
    assert (z[1], z[2], z[3], sx[3]) == (1, 255, 128, 0)
    assert int(u[1].max()) == 255 and int(u[2].min()) == 1
    # the range's codes: within half a step of x, 0 exactly on the grid
    err = (u.double() - z.double()[:, None]) * sx.double()[:, None] - x.double()
    assert (err.abs() <= sx.double()[:, None] * (0.5 + 1e-4)).all()


def test_w8a8_bad_packed_shape():
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8

    wq = torch.zeros(40, 12, dtype=torch.int8)
    with pytest.raises(ShapeError, match="packed"):
        linear_w8a8(torch.randn(2, 16), pack_w8a8(wq), torch.ones(40))


def test_w8a8_bound_call_matches():
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, linear_w8a8_bound, pack_w8a8

    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 70, generator=g)
    wq, s = _weights(g, 50, 70)
    p, b = pack_w8a8(wq), torch.randn(50, generator=g)
    out = torch.zeros(3, 50)
    call = linear_w8a8_bound(x, p, s, out, bias=b)
    x.mul_(2)  # the call reads the buffers as they are when it runs
    call()
    assert torch.equal(out, linear_w8a8(x, p, s, bias=b))
    strided = torch.randn(3, 140, generator=g)[:, ::2]  # not read in place: no bound call
    assert linear_w8a8_bound(strided, p, s, out) is None


def _u7_case(g, m, k, n):
    """Weights in [-64, 64] (the models' w8a8 codes) with many at +-64 against rows at
    +-127: the offset tile's largest int16 pair sums (2 x 255 x 64)."""
    wq = torch.randint(-64, 65, (n, k), generator=g, dtype=torch.int8)
    wq[:, ::3] = 64
    wq[::2, 1::3] = -64
    x = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0) * 127
    x[:, ::5] = torch.randint(-127, 128, (m, len(range(0, k, 5))), generator=g).float()
    return x, wq


@pytest.mark.parametrize("m", [16, 17, 29, 64, 131])
def test_w8a8_7bit_weights_exact_any_threads(m):
    """Many rows and weights within [-64, 64]: the AVX2 build's offset tile (x stored
    u = xq + 128, the column sums taking 128 sum w back out) gives the exact integer
    product at 1 and 2 threads, for odd K (a quad tail) and N (a panel tail)."""
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8

    g = torch.Generator().manual_seed(70 + m)
    n, k = 50, 263
    x, wq = _u7_case(g, m, k, n)
    p, s = pack_w8a8(wq), torch.ones(n)
    exact = x.double().numpy() @ wq.double().numpy().T
    for t in (1, 2):
        y = linear_w8a8(x, p, s, threads=t).double().numpy()
        np.testing.assert_array_equal(y, exact.astype(np.float32).astype(np.float64))


def test_w8a8_7bit_tile_equals_few_row_tile():
    """The same rows through one many-row call (the offset tile) and one call per row
    (the signed tile: too few rows to scan the weights) give the same bits, with
    per-channel scales, a bias and a residual; one weight of 65 sends the many-row call
    back to the signed tile, still exact."""
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8
    from atbcore.ops.linear_quant import quantize_w8a8

    g = torch.Generator().manual_seed(11)
    m, k, n = 40, 131, 97
    x = torch.randn(m, k, generator=g)
    wq, s = (torch.from_numpy(a) for a in quantize_w8a8(torch.randn(n, k, generator=g), 64))
    assert int(wq.abs().max()) <= 64
    b, r = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    p = pack_w8a8(wq)
    many = linear_w8a8(x, p, s, bias=b, residual=r, threads=2)
    rows = torch.cat([linear_w8a8(x[i:i + 1], p, s, bias=b, residual=r[i:i + 1])
                      for i in range(m)])
    assert torch.equal(many, rows)
    assert_close(many, _ref(x, wq, s, bias=b, add=r).astype(np.float32), "fp32", "w8a8 7-bit")
    xe, we = _u7_case(g, m, k, n)
    we[n // 2, k // 2] = 65
    exact = xe.double().numpy() @ we.double().numpy().T
    y = linear_w8a8(xe, pack_w8a8(we), torch.ones(n), threads=2).double().numpy()
    np.testing.assert_array_equal(y, exact.astype(np.float32).astype(np.float64))
