"""The bf16 prefill GEMM (csrc/gemm_bf16.c: VDPBF16PS on bf16 panels, where the CPU
has AVX512_BF16) against a float64 NumPy reference: odd sizes, K tails, bias,
residual, RmsNorm'd rows, and 1 vs 2 threads bit-equal."""

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.numerics import assert_close

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")

# more x rows than one 64-row block: the many-row GEMM (fewer stay on panel.c's path)
ROWS = (65, 130, 203)


def _ref(x, w, bias=None, res=None):
    y = x.double().numpy() @ w.double().numpy().T
    if bias is not None:
        y = y + bias.double().numpy()
    if res is not None:
        y = y + res.double().numpy()
    return y


@pytest.mark.parametrize("m,k,n", [(65, 33, 45), (130, 257, 97), (203, 1, 31), (77, 384, 64),
                                   (129, 130, 33)])
def test_bf16_gemm_against_float64(m, k, n):
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    p = pack_panels(w)
    # fp32 output: the sums themselves (products of bf16 are exact; fp32 sums in K blocks)
    y32 = linear_rows(x, w, panels=p, bias=b, out=torch.empty(m, n))
    ref = _ref(x, w, bias=b)
    assert_close(y32, ref.astype(np.float32), "fp32", "bf16 GEMM sums")
    y = linear_rows(x, w, panels=p, bias=b)
    assert y.dtype == torch.bfloat16
    assert_close(y, ref.astype(np.float32), "bf16", "bf16 GEMM")


@pytest.mark.parametrize("m", ROWS)
def test_bf16_gemm_threads_bit_equal_and_residual(m):
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(m)
    k, n = 301, 161
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    r = torch.randn(m, n, generator=g).bfloat16()
    p = pack_panels(w)
    y1 = linear_rows(x, w, panels=p, residual=r, threads=1)
    y2 = linear_rows(x, w, panels=p, residual=r, threads=2)
    assert torch.equal(y1, y2)
    assert_close(y1, _ref(x, w, res=r).astype(np.float32), "bf16", "bf16 GEMM + residual")


def test_bf16_gemm_rms_normed_rows():
    """RmsNorm'd rows are rounded to bf16 first (as the norm kernel stores them), then
    multiplied: the same as the norm kernel followed by the GEMM."""
    from atbcore.backends.cpu_kernels import torch_ops as ck
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(3)
    m, k, n = 150, 96, 70
    x = torch.randn(m, k, generator=g).bfloat16()
    nw = torch.rand(k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    p = pack_panels(w)
    y = linear_rows(x, w, panels=p, rms_norm_eps=1e-6, rms_norm_weight=nw,
                    out=torch.empty(m, n))
    normed = ck.rms_norm(x, nw, k, 1e-6)[0]
    assert normed.dtype == torch.bfloat16
    assert_close(y, _ref(normed, w).astype(np.float32), "fp32", "bf16 GEMM of normed rows")
