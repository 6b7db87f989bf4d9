"""The one-row matmul on panels (decode GEMV: two panels at a time, bf16 widened by
shift and mask) against float64 NumPy: odd sizes (a lone last panel, a partial one,
K not a multiple of the 128-k blocks), 1 and 2 threads bit-equal, and each output's
sum the same bits as that row inside a many-row call. int8 weights (w8) read x as int8
blocks of 32: the reference quantizes x the same way."""

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.numerics import assert_close
from atbcore.ops.linear_quant import act_q8

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("k,n", [(1, 33), (129, 64), (300, 97), (512, 1536), (1376, 515),
                                 (77, 4001)])
def test_gemv_panels_one_row(wdt, k, n):
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(k * 7 + n)
    x = torch.randn(5, k, generator=g)
    s = None
    if wdt == torch.int8:
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, generator=g) / 100
    else:
        w = torch.randn(n, k, generator=g).to(wdt)
    p = pack_panels(w)
    ys = [linear_rows(x[2:3], w, scale=s, panels=p, threads=t) for t in (1, 2)]
    assert torch.equal(ys[0], ys[1])
    xr = x[2:3].double().numpy()
    if s is not None:  # w8 reads x as int8 blocks of 32 (panel_q8.c)
        xr = act_q8(x[2:3].numpy())
    ref = xr @ w.double().numpy().T
    if s is not None:
        ref = ref * s.double().numpy()
    assert_close(ys[0], ref.astype(np.float32), "fp32", f"{wdt} gemv {k}x{n}")
    many = linear_rows(x, w, scale=s, panels=p, threads=2)
    assert torch.equal(many[2:3], ys[0])
