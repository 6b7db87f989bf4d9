"""The C w4 matmul (group-wise 4-bit weights, int8 activation blocks) against float64
NumPy references: the exact one (the kernel's activation quantization replayed in
float32, then float64 sums of the dequantized weights) and the plain one (fp32 x)."""

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.errors import InputError, ShapeError
from atbcore.numerics import assert_close

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


def _np_quant_x(x: np.ndarray, kp: int) -> np.ndarray:
    """x [M, K] fp32 as the kernel quantizes it, dequantized to float64 [M, kp]: per row
    and block of 32, dx = absmax / 127, q = rint(x * (127 / absmax)) (fp32 ops)."""
    m, k = x.shape
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = x
    b = xp.reshape(m, kp // 32, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((b * inv).astype(np.float32)), -127, 127)
    dx = (amax / np.float32(127)).astype(np.float32)
    return (q.astype(np.float64) * dx.astype(np.float64)).reshape(m, kp)


def _np_weight(codes, scales, zeros, group) -> np.ndarray:
    """The float64 weight [N, K'] of codes [N, K'], scales [N, K'/group], zeros or 8."""
    q = codes.numpy().astype(np.float64)
    s = np.repeat(scales.float().numpy().astype(np.float64), group, axis=1)
    z = 8.0 if zeros is None else np.repeat(zeros.numpy().astype(np.float64), group, axis=1)
    return (q - z) * s


@pytest.mark.parametrize("m,k,n,group", [(1, 100, 70, 32), (3, 64, 33, 64), (2, 320, 129, 128),
                                         (5, 31, 1, 32), (1, 4096, 96, 128), (70, 160, 40, 32)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_linear_w4_against_numpy(m, k, n, group, symmetric):
    from atbcore.backends.cpu_kernels.torch_linear_w4 import linear_w4, pack_w4, quantize_w4

    g = torch.Generator().manual_seed(m * 7919 + k * 31 + n + group + symmetric)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g) * 3
    codes, scales, zeros, grp = quantize_w4(w, group, symmetric)
    assert (zeros is None) == symmetric and int(codes.max()) <= 15
    w4 = pack_w4(codes, scales, zeros, grp, k=k)
    wref = _np_weight(codes, scales, zeros, grp)
    np.testing.assert_array_equal(w4.dequantize().double().numpy(), wref[:, :k])
    y = linear_w4(x, w4)
    assert y.shape == (m, n) and y.dtype == torch.float32
    exact = _np_quant_x(x.numpy(), wref.shape[1]) @ wref.T
    assert_close(y, exact.astype(np.float32), "fp32", "w4 vs replayed int8 activations")
    plain = x.double().numpy() @ wref[:, :k].T      # int8 activations: ~1 % of a row's norm
    err = np.linalg.norm(y.double().numpy() - plain) / np.linalg.norm(plain)
    assert err < 0.02, err


def test_quantize_w4_rules():
    """Symmetric: the group's largest magnitude is exact (code 0), every weight within
    half a step except those clamped at code 15 (within a step, as in Q4_0);
    asymmetric: within a step (the zero point is rounded too)."""
    from atbcore.backends.cpu_kernels.torch_linear_w4 import quantize_w4

    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=g)
    codes, s, z, grp = quantize_w4(w, 32, True)
    wd = (codes.float() - 8) * s.float().repeat_interleave(32, 1)
    step = s.float().abs().repeat_interleave(32, 1)
    err = (wd - w).abs()
    assert ((err <= step * 0.5 * (1 + 1e-3) + 1e-6) | ((codes == 15) & (err <= step))).all()
    big = w.view(40, 3, 32).abs().argmax(-1)
    assert (codes.view(40, 3, 32).gather(-1, big[..., None]) == 0).all()
    codes, s, z, grp = quantize_w4(w, 32, False)
    wd = (codes.float() - z.float().repeat_interleave(32, 1)) * s.float().repeat_interleave(32, 1)
    step = s.float().repeat_interleave(32, 1)
    assert ((wd - w).abs() <= step * 1.0 + 1e-6).all()


@pytest.mark.parametrize("m", [1, 4, 9, 100])
def test_linear_w4_threads_bit_equal(m):
    from atbcore.backends.cpu_kernels.torch_linear_w4 import linear_w4, pack_w4, quantize_w4

    g = torch.Generator().manual_seed(m)
    w4 = pack_w4(*quantize_w4(torch.randn(1000, 544, generator=g), 32, False), k=544)
    x = torch.randn(m, 544, generator=g)
    one = linear_w4(x, w4, threads=1)
    two = linear_w4(x, w4, threads=2)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_linear_w4_half_rows_bias_accumulate_norm(dt):
    from atbcore.backends.cpu_kernels.torch_linear_w4 import (linear_w4, linear_w4_bound,
                                                              pack_w4, quantize_w4)

    g = torch.Generator().manual_seed(11)
    k, n = 200, 77
    codes, s, z, grp = quantize_w4(torch.randn(n, k, generator=g), 64, True)
    w4 = pack_w4(codes, s, z, grp, k=k)
    wref = _np_weight(codes, s, z, grp)
    x = torch.randn(2, 3, k, generator=g).to(dt)
    b = torch.randn(n, generator=g).to(dt)
    y = linear_w4(x, w4, bias=b)
    xs = x.float().reshape(-1, k).numpy()
    ref = _np_quant_x(xs, wref.shape[1]) @ wref.T + b.double().numpy()
    tag = "bf16" if dt == torch.bfloat16 else "fp16"
    assert y.shape == (2, 3, n) and y.dtype == dt
    assert_close(y.reshape(-1, n), ref.astype(np.float32), tag, "w4 half rows + bias")
    acc = torch.randn(2, 3, n, generator=g).to(dt)
    y2 = linear_w4(x, w4, bias=b, out=acc.clone(), accumulate=True)
    assert_close(y2.reshape(-1, n), (ref + acc.double().reshape(-1, n).numpy()).astype(np.float32),
                 tag, "w4 accumulate")
    # RmsNorm inside: the same as normalising first with the norm kernel's rounding
    nw = torch.rand(k, generator=g).to(dt) + 0.5
    xn = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()).to(dt)
    y3 = linear_w4(x, w4, rms_norm_eps=1e-6, rms_norm_weight=nw)
    assert_close(y3.float(), linear_w4(xn, w4).float(), tag, "w4 with RmsNorm")
    out = torch.empty(2, 3, n, dtype=dt)
    call = linear_w4_bound(x, w4, out, bias=b)
    call()
    assert torch.equal(out, y)


def test_linear_w4_errors():
    from atbcore.backends.cpu_kernels.torch_linear_w4 import linear_w4, pack_w4, quantize_w4

    w4 = pack_w4(*quantize_w4(torch.randn(8, 64)))
    with pytest.raises(ShapeError, match="linear_w4"):
        linear_w4(torch.randn(2, 63), w4)
    with pytest.raises(InputError, match="group"):
        quantize_w4(torch.randn(8, 64), 48)
    with pytest.raises(InputError, match="accumulate"):
        linear_w4(torch.randn(2, 64), w4, accumulate=True)
    with pytest.raises(ShapeError, match="pack_w4"):
        pack_w4(torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.float16),
                None, 32)


_GENERIC = r"""
import sys, torch
from atbcore.backends.cpu_kernels import bindings
from atbcore.backends.cpu_kernels.torch_linear_w4 import linear_w4, pack_w4
assert bindings.build_info().isa == "generic", bindings.build_info()
d = torch.load(sys.argv[1])
w4 = pack_w4(d["codes"], d["scales"], d["zeros"], 64, k=d["x"].shape[1])
torch.save(linear_w4(d["x"], w4, threads=2), sys.argv[2])
"""


def test_linear_w4_generic_build_matches(tmp_path):
    """The plain C path (a build without AVX-512, as on other CPUs) does the same
    integer sums; its fp32 steps round apart (no FMA in the baseline ISA), so it is held
    to the same float64 reference as the VNNI kernel."""
    import os
    import subprocess
    import sys

    from atbcore.backends.cpu_kernels.torch_linear_w4 import linear_w4, pack_w4, quantize_w4

    g = torch.Generator().manual_seed(9)
    codes, scales, zeros, grp = quantize_w4(torch.randn(45, 150, generator=g), 64, False)
    x = torch.randn(3, 150, generator=g)
    torch.save({"codes": codes, "scales": scales, "zeros": zeros, "x": x}, tmp_path / "in.pt")
    env = dict(os.environ, ATB_CPU_ISA="generic", ATB_CPU_KERNELS_CACHE=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-c", _GENERIC, str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt")], env=env, check=True, timeout=300)
    generic = torch.load(tmp_path / "out.pt")
    wref = _np_weight(codes, scales, zeros, grp)
    exact = _np_quant_x(x.numpy(), wref.shape[1]) @ wref.T
    assert_close(generic, exact.astype(np.float32), "fp32", "w4 generic C vs numpy")
    vnni = linear_w4(x, pack_w4(codes, scales, zeros, grp, k=150))
    assert_close(generic, vnni, "fp32", "w4 generic C vs the VNNI kernel")


@pytest.mark.parametrize("m,k,n,dt", [(1, 100, 70, torch.float32), (3, 544, 97, torch.float32),
                                      (2, 200, 33, torch.bfloat16), (1, 64, 1000, torch.float32)])
def test_linear_w4_residual_epilogue(m, k, n, dt):
    """y = x W^T + bias + residual with the residual read in the epilogue (fp32 sum, one
    rounding): against float64 NumPy; in place (residual is out); bound and bound_io
    calls bit-equal to the plain call; 1 and 2 threads bit-equal."""
    from atbcore.backends.cpu_kernels.torch_linear_w4 import (linear_w4, linear_w4_bound,
                                                              linear_w4_bound_io, pack_w4,
                                                              quantize_w4)

    g = torch.Generator().manual_seed(m * 131 + k + n)
    codes, s, z, grp = quantize_w4(torch.randn(n, k, generator=g), 32, m != 3)
    w4 = pack_w4(codes, s, z, grp, k=k)
    wref = _np_weight(codes, s, z, grp)
    x = torch.randn(m, k, generator=g).to(dt)
    b = torch.randn(n, generator=g).to(dt)
    r = torch.randn(m, n, generator=g).to(dt)
    y = linear_w4(x, w4, bias=b, residual=r, threads=1)
    ref = _np_quant_x(x.float().numpy(), wref.shape[1]) @ wref.T + b.double().numpy() + \
        r.double().numpy()
    tag = "fp32" if dt == torch.float32 else "bf16"
    assert_close(y, ref.astype(np.float32), tag, "w4 + residual")
    assert torch.equal(linear_w4(x, w4, bias=b, residual=r, threads=2), y)
    # the old two-step form (copy, then accumulate) gives the same bits
    assert torch.equal(linear_w4(x, w4, bias=b, out=r.clone(), accumulate=True), y)
    inplace = r.clone()
    assert linear_w4(x, w4, bias=b, out=inplace, residual=inplace) is inplace
    assert torch.equal(inplace, y)
    out = torch.empty(m, n, dtype=dt)
    call = linear_w4_bound(x, w4, out, bias=b, residual=r)
    call()
    assert torch.equal(out, y)
    io = linear_w4_bound_io(torch.empty_like(x), w4, torch.empty(m, n, dtype=dt), bias=b,
                            residual_like=torch.empty_like(r))
    out2 = torch.full((m, n), 7.0, dtype=dt)
    io(x, out2, r)
    assert torch.equal(out2, y)
    plain = linear_w4_bound_io(torch.empty_like(x), w4, torch.empty(m, n, dtype=dt), bias=b)
    out3 = torch.empty(m, n, dtype=dt)
    plain(x, out3)
    assert torch.equal(out3, linear_w4(x, w4, bias=b))


def test_linear_w4_residual_errors():
    from atbcore.backends.cpu_kernels.torch_linear_w4 import (linear_w4, linear_w4_bound_io,
                                                              pack_w4, quantize_w4)

    w4 = pack_w4(*quantize_w4(torch.randn(8, 64)))
    x = torch.randn(2, 64)
    with pytest.raises(ShapeError, match="residual"):
        linear_w4(x, w4, residual=torch.randn(2, 7))
    with pytest.raises(InputError, match="residual"):
        linear_w4(x, w4, out=torch.zeros(2, 8), accumulate=True, residual=torch.zeros(2, 8))
    io = linear_w4_bound_io(x, w4, torch.empty(2, 8), residual_like=torch.empty(2, 8))
    with pytest.raises(InputError, match="linear_w4"):
        io(x, torch.empty(2, 8))
    with pytest.raises(ShapeError, match="out"):
        io(x, torch.empty(3, 8), torch.empty(2, 8))


@pytest.mark.parametrize("symmetric", [True, False])
def test_linear_w4_activation_ties(symmetric):
    """x whose blocks have max 127 and every other input a tie (.5): quantized as w8's
    blocks are (one quantizer), ties to even, and the zero-point term's block sums of
    the same q; against the float64 replay."""
    from atbcore.backends.cpu_kernels.torch_linear_w4 import linear_w4, pack_w4, quantize_w4

    k, n = 101, 45
    g = torch.Generator().manual_seed(5 + symmetric)
    x = torch.randint(-126, 126, (3, k), generator=g).float() + 0.5
    x[:, ::32] = 127.0
    x[2, :32] = 0.0
    codes, scales, zeros, grp = quantize_w4(torch.randn(n, k, generator=g), 32, symmetric)
    w4 = pack_w4(codes, scales, zeros, grp, k=k)
    wref = _np_weight(codes, scales, zeros, grp)
    y = linear_w4(x, w4)
    assert np.array_equal(_np_quant_x(x.numpy(), wref.shape[1])[:, :k], np.rint(x.numpy()))
    exact = _np_quant_x(x.numpy(), wref.shape[1]) @ wref.T
    assert_close(y, exact.astype(np.float32), "fp32", "w4 activation ties")
