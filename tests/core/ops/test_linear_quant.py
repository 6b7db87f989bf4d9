"""Linear with quant="w4" / "w8a8" (and their RmsNormLinear form): the torch kernels (the
C w4 / w8a8 kernels on their packed layouts, and the torch-ops fallback) against the
float64 NumPy reference at odd sizes and group tails; the NumPy quantizer against the
torch one the hand-written runner uses; errors naming what is wrong."""

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.backends.cpu_kernels import available
from atbcore.errors import DtypeError, InputError, ParamsError, ShapeError
from atbcore.ops.linear import quantize_w8
from atbcore.ops.linear_quant import dequantize_w4, quantize_w4
from oracle import check_error, check_op, rand

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


def _w4_inputs(n, k, group, symmetric, seed, bias=False):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    codes, scales, zeros = quantize_w4(w, group, symmetric)
    x = (rng.standard_normal((3, k)) * 2).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    return x, codes, b, scales, zeros


@pytest.mark.parametrize("n,k,group", [(70, 100, 32), (33, 64, 64), (129, 320, 128),
                                       (1, 31, 32), (40, 161, 32)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_w4_kernel_matches_reference(n, k, group, symmetric):
    x, codes, b, s, z = _w4_inputs(n, k, group, symmetric, n + k + group, bias=n % 2 == 0)
    ins = [x, codes, b, s, None, z]
    check_op("Linear", {"quant": "w4", "group_size": group, "bias": b is not None}, ins)
    # quantization error of the op itself (4-bit weights, int8 activation blocks)
    plain = x.astype(np.float64) @ dequantize_w4(codes, s, z, group).T
    y, = atb.Builder().build_operation("Linear", {"quant": "w4", "group_size": group}).execute(
        [torch.from_numpy(x), torch.from_numpy(codes), None, torch.from_numpy(s), None,
         None if z is None else torch.from_numpy(z)])
    err = np.linalg.norm(y.double().numpy() - plain) / np.linalg.norm(plain)
    assert err < 0.02, err


def test_w4_numpy_quantizer_equals_the_runners():
    """The core's NumPy quantizer gives the torch one's codes and scales bit for bit
    (the lowered graph and the hand-written runner quantize alike)."""
    from atbcore.backends.cpu_kernels.torch_linear_w4 import quantize_w4 as torch_q

    w = torch.randn(48, 200, generator=torch.Generator().manual_seed(1)) * 0.05
    for symmetric in (True, False):
        codes, s, z = quantize_w4(w.numpy(), 32, symmetric)
        tc, ts, tz, _ = torch_q(w, 32, symmetric)
        np.testing.assert_array_equal(codes, tc[:, :200].numpy())
        np.testing.assert_array_equal(s, ts.numpy())
        if symmetric:
            assert z is None and tz is None
        else:
            np.testing.assert_array_equal(z, tz.numpy())


@pytest.mark.parametrize("rows,k,n", [(1, 64, 33), (5, 161, 70), (70, 96, 40)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_w8a8_kernel_matches_reference(rows, k, n, dtype):
    rng = np.random.default_rng(rows + k)
    wq, s = quantize_w8(rng.standard_normal((n, k)).astype(np.float32))
    x = rand((rows, k), dtype, seed=k)
    b = rand((n,), dtype, seed=n)
    check_op("Linear", {"quant": "w8a8"}, [x, wq, s])
    check_op("Linear", {"quant": "w8a8", "bias": True}, [x, wq, b, s])


@pytest.mark.parametrize("quant", ["w4", "w8a8"])
def test_rms_norm_linear_and_residual_quantized(quant):
    """The norm read inside the quantized matmul and the residual added in its
    epilogue, as the pass pipeline fuses them, against the reference."""
    rng = np.random.default_rng(7)
    k, n = 96, 45
    w = rng.standard_normal((n, k)).astype(np.float32)
    if quant == "w4":
        codes, s, z = quantize_w4(w, 32, False)
        wt, extra = codes, [z]
    else:
        wt, s = quantize_w8(w)
        extra = []
    x = rand((2, 3, k), "fp32", seed=1)
    nw = rand((k,), "fp32", seed=2)
    r = rand((2, 3, n), "fp32", seed=3)
    check_op("RmsNormLinear", {"quant": quant, "eps": 1e-5},
             [x, nw, wt, None, s, r, *extra])
    check_op("Linear", {"quant": quant}, [x, wt, None, s, r, *extra])


def test_fallback_without_the_c_kernels_matches_reference(monkeypatch):
    """fp32 scales for w4 are not the C kernel's fp16: the torch-ops path runs."""
    x, codes, b, s, z = _w4_inputs(20, 70, 32, False, 3)
    check_op("Linear", {"quant": "w4"}, [x, codes, None, s.astype(np.float32), None, z])
    rng = np.random.default_rng(4)
    wq, sc = quantize_w8(rng.standard_normal((9, 40)).astype(np.float32))
    check_op("Linear", {"quant": "w8a8"}, [rand((4, 40), "fp32", seed=5), wq,
                                           sc.astype(np.float16)])


def test_quantized_linear_errors_name_what_is_wrong():
    x, codes, _, s, z = _w4_inputs(8, 64, 32, False, 1)
    check_error("Linear", {"quant": "w4"}, [x, codes.astype(np.int8), None, s], DtypeError,
                "UINT8")
    check_error("Linear", {"quant": "w4"}, [x, codes, None, s[:, :1]], ShapeError, "scale")
    check_error("Linear", {"quant": "w4"}, [x, codes, None, s, None, z[:, :1]], ShapeError,
                "zeros")
    wq, sc = quantize_w8(np.ones((8, 64), np.float32))
    check_error("Linear", {"quant": "w8a8"}, [x, wq, None, sc, None, z], InputError, "zeros")
    check_error("Linear", {"quant": "w4", "group_size": 48}, [], ParamsError, "group_size",
                build_error=True)


@pytest.mark.parametrize("quant", ["w8", "w8a8", "w4"])
def test_quantized_moe_experts_match_reference(quant):
    """MoE with quantized experts (each projection a quantized Linear) against the
    float64 reference, with routing over 4 experts, top 2."""
    from atbcore.models.quant import quantized_experts

    rng = np.random.default_rng(11)
    e, h, inter = 4, 64, 96
    x = rand((5, h), "fp32", seed=12)
    router = rand((e, h), "fp32", seed=13)
    gu = quantized_experts(rng.standard_normal((e, 2 * inter, h)).astype(np.float32), quant,
                           "gate_up")
    dn = quantized_experts(rng.standard_normal((e, h, inter)).astype(np.float32) * 0.1, quant,
                           "down")
    assert gu["w_gate_up"].dtype == (np.uint8 if quant == "w4" else np.int8)
    check_op("MoE", {"top_k": 2, "quant": quant},
             [x, router, gu["w_gate_up"], dn["w_down"], gu["gate_up_scale"], dn["down_scale"]])


def test_quantize_w8a8_codes_scales_and_clip():
    """Codes within [-64, 64]; each row's scale is the clip of least squared error
    (never worse than max|w| / 64, better on a heavy-tailed row); a zero row gets
    scale 1; fp16 scales are fp16 values the codes were chosen against."""
    from atbcore.ops.linear_quant import W8A8_CLIPS, W8A8_FAST_LEVELS, quantize_w8a8

    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 1536)).astype(np.float32)
    w[1] = rng.standard_t(2, 1536)                  # heavy tails: clipping pays there
    w[4] = 0
    q, s = quantize_w8a8(w, W8A8_FAST_LEVELS)
    assert q.dtype == np.int8 and s.dtype == np.float32 and int(np.abs(q).max()) <= 64
    assert s[4] == 1 and not q[4].any()
    err = np.square(q * s[:, None].astype(np.float64) - w).sum(axis=1)
    for c in W8A8_CLIPS:                            # every tried clip, replayed in float64
        sc = (np.abs(w).max(axis=1) * np.float32(c) / np.float32(64)).astype(np.float32)
        qc = np.clip(np.rint(w / np.where(sc > 0, sc, 1)[:, None]), -64, 64)
        ec = np.square(qc * sc[:, None].astype(np.float64) - w).sum(axis=1)
        assert (err[:4] <= ec[:4] * (1 + 1e-6)).all() and err[5] <= ec[5] * (1 + 1e-6)
    plain = np.abs(w[1]).max() / 64
    assert s[1] < plain and err[1] < np.square(np.clip(np.rint(w[1] / plain), -64, 64) * plain
                                               - w[1]).sum()
    q16, s16 = quantize_w8a8(w, W8A8_FAST_LEVELS, scale_dtype=np.float16)
    np.testing.assert_array_equal(s16, s16.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(q16[:4], np.clip(np.rint(w[:4] / s16[:4, None]), -64, 64))
    with pytest.raises(InputError, match="levels"):
        quantize_w8a8(w, levels=128)
    with pytest.raises(ShapeError, match="rank 2"):
        quantize_w8a8(w[0])


@pytest.mark.parametrize("name", ["w8_numpy", "w8_torch", "w4", "w8a8"])
def test_weight_quantizers_refuse_empty_and_non_finite_weights(name):
    from atbcore.ops.linear_quant import quantize_w8a8
    fns = {"w8_numpy": quantize_w8, "w8_torch": lambda w: quantize_w8(torch.from_numpy(w)),
           "w4": quantize_w4, "w8a8": quantize_w8a8}
    fn = fns[name]
    good = rand((3, 40), seed=1).astype(np.float32)
    fn(good.copy())  # the valid weight goes through
    for bad, err in ((np.zeros((3, 0), np.float32), ShapeError),
                     (np.zeros(5, np.float32), ShapeError),
                     (np.where(np.arange(120).reshape(3, 40) == 7, np.nan, good), InputError),
                     (np.where(np.arange(120).reshape(3, 40) == 9, np.inf, good), InputError),
                     (np.full((2, 4), 1e39), InputError)):  # float64 past fp32: inf there
        before = bad.copy()
        with pytest.raises(err) as e:
            fn(bad)
        assert "quantize_" in str(e.value)
        np.testing.assert_array_equal(bad, before)  # the caller's array is untouched


@pytest.mark.parametrize("clips", [(), (0.0,), (1.5,), (True,), "0.9", (0.9, "x")])
def test_quantize_w8a8_refuses_bad_clips(clips):
    from atbcore.ops.linear_quant import quantize_w8a8
    with pytest.raises(InputError, match="clips"):
        quantize_w8a8(rand((2, 8), seed=2), clips=clips)


@pytest.mark.parametrize("name", ["quantize_act_rows", "quantize_w8a8_rows"])
def test_row_quantizers_refuse_what_is_not_rows(name):
    import atbcore.ops.linear_quant as lq
    fn = getattr(lq, name)
    fn(rand((2, 8), seed=3))  # rows go through
    for bad in (np.zeros(5, np.float32), np.zeros((2, 0), np.float32), np.zeros((1, 2, 3))):
        with pytest.raises(ShapeError, match=name):
            fn(bad)
    if name == "quantize_act_rows":
        for block in (0, -32, 2.5, True):
            with pytest.raises(InputError, match="block"):
                fn(rand((2, 8), seed=3), block)
