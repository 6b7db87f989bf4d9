"""The w8 matmul's int8 activations (csrc/panel_q8.c): each row of x quantized per
block of 32 inputs, integer dot products against the int8 panels, one fp32 FMA per
block. Against a float64 NumPy replay of the same quantization (np.rint, ties to even
as the kernel's nearbyintf), odd K and N (a partial last block and panel), 1 and 2
threads bit-equal, 1 and a few rows; the [N, K] rows layout reads x the same way."""

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.numerics import assert_close
from atbcore.ops.linear_quant import quantize_act_rows

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


def _replay(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> np.ndarray:
    """float64 sum over blocks of (exact int sum) * dx, times the channel scale."""
    q, dx = quantize_act_rows(x.float().numpy(), 32)             # [M, K'], [M, K'/32]
    k = x.shape[-1]
    kp = q.shape[1]
    wq = np.zeros((w.shape[0], kp), np.int64)
    wq[:, :k] = w.numpy()
    blocks = q.astype(np.int64).reshape(q.shape[0], -1, 32)        # [M, B, 32]
    sums = np.einsum("mbt,nbt->mbn", blocks, wq.reshape(w.shape[0], -1, 32))  # exact ints
    return (sums * dx.astype(np.float64)[..., None]).sum(1) * s.double().numpy()


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("k,n", [(1, 1), (31, 33), (33, 64), (67, 95), (300, 129), (1376, 70)])
def test_q8_panels_against_replay(m, k, n):
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(k * 13 + n + m)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4  # uneven blocks
    x[0, :min(k, 7)] = 0.0                                      # an all-zero block start
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w[0] = 127
    w[-1] = -127                                                # the int8 extremes
    s = torch.rand(n, generator=g) / 100
    p = pack_panels(w)
    ys = [linear_rows(x, w, scale=s, panels=p, threads=t) for t in (1, 2)]
    assert torch.equal(ys[0], ys[1])
    assert_close(ys[0], _replay(x, w, s).astype(np.float32), "fp32", f"q8 {m}x{k}x{n}")
    for i in range(m):  # a row alone: the same bits as inside the batch
        assert torch.equal(linear_rows(x[i:i + 1], w, scale=s, panels=p), ys[0][i:i + 1])
    # the [N, K] rows (no panels) read x as the same int8 blocks
    assert_close(linear_rows(x, w, scale=s), _replay(x, w, s).astype(np.float32), "fp32",
                 f"q8 rows layout {m}x{k}x{n}")


def test_q8_extremes_are_exact():
    """|x| at a block's max gives q = +-127 against w = +-127: the int16 pair sums of
    VPMADDUBSW (|w| times x with w's sign) stay exact at the extremes."""
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    k, n = 64, 32
    x = torch.full((1, k), -3.0)
    x[0, ::2] = 3.0
    w = torch.full((n, k), 127, dtype=torch.int8)
    w[:, ::2] = -127
    s = torch.ones(n)
    y = linear_rows(x, w, scale=s, panels=pack_panels(w))
    # every product is -127 * 127; dx = 3 / 127 per block: y = k * (-127) * 3
    np.testing.assert_allclose(y.numpy(), np.full((1, n), -127.0 * 3 * k, np.float32), rtol=1e-6)


@pytest.mark.parametrize("k", [64, 96, 77])
def test_q8_quantizer_rounds_ties_to_even(k):
    """Blocks whose max is 127 (so x * 127 / max is x exactly) and whose other inputs
    end in .5: every one a tie, rounded to even as np.rint does (the AVX2 quantizer's
    VCVTPS2DQ and the scalar tail's nearbyintf alike); unit scales keep every sum an
    exact integer, so the result is compared bit for bit."""
    from atbcore.backends.cpu_kernels.torch_decode import linear_rows, pack_panels

    g = torch.Generator().manual_seed(k)
    x = torch.randint(-126, 126, (2, k), generator=g).float() + 0.5
    x[:, ::32] = 127.0                                   # each block's max
    x[1, 32:64] = 0.0                                    # an all-zero block
    w = torch.randint(-127, 128, (37, k), generator=g, dtype=torch.int8)
    s = torch.ones(37)
    y = linear_rows(x, w, scale=s, panels=pack_panels(w), threads=1)
    q = np.rint(x.numpy()).astype(np.int64)             # ties to even
    exact = q @ w.numpy().astype(np.int64).T
    np.testing.assert_array_equal(y.numpy(), exact.astype(np.float32))
    np.testing.assert_array_equal(y.numpy(), _replay(x, w, s).astype(np.float32))
