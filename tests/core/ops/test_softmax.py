"""Softmax / ScaledMaskedSoftmax: torch kernels vs the NumPy reference, torch
softmax and SDPA oracles, masks (additive, bool, broadcast), causal, bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand

SHAPES = [(1, 769), (2, 3, 769), (4, 2, 5, 33)]


def run(op, params, inputs):
    return atb.Builder().build_operation(op, params).execute(list(inputs))


def half(x, dtype):
    """NumPy ``x`` as a torch tensor of ``dtype`` (bf16 via fp32)."""
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(atb.Dtype.of(dtype).torch)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_matches_reference(shape, dtype):
    x = rand(shape, dtype, 1, scale=4.0)
    y = check_op("Softmax", {}, [x])[0]
    np.testing.assert_allclose(y.astype(np.float64).sum(-1), 1.0, atol=1e-2)
    check_op("Softmax", {"axes": [0]}, [x])
    check_op("Softmax", {"dim": (-2, -1)}, [x])  # joint softmax over two axes


@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_vs_torch(dtype):
    x = rand((3, 5, 769), dtype, 2, scale=6.0)
    xt = half(x, dtype)
    for dim in (-1, 1, 0):
        y, = run("Softmax", {"dim": dim}, [xt])
        atb.assert_close(y, F.softmax(xt.float(), dim=dim), dtype, f"Softmax dim {dim}")
    y, = run("Softmax", {"dim": (1, 2)}, [xt])
    want = F.softmax(xt.float().reshape(3, -1), dim=-1).reshape(3, 5, 769)
    atb.assert_close(y, want, dtype, "Softmax over axes (1, 2)")


def test_softmax_subtracts_the_max():
    """exp(1000) overflows fp32; with the max subtracted the result is exact."""
    x = torch.tensor([[1000.0, 999.0, 998.0], [-1000.0, -1001.0, -1002.0]])
    y, = run("Softmax", {}, [x])
    e = np.exp([0.0, -1.0, -2.0])
    atb.assert_close(y, np.stack([e / e.sum()] * 2), "fp32")
    y16, = run("Softmax", {}, [torch.full((1, 4), 60000.0, dtype=torch.float16)])
    assert torch.equal(y16, torch.full((1, 4), 0.25, dtype=torch.float16))


MASKS = [  # (name, mask shape builder)
    ("additive [Sk]", lambda sq, sk: rand((sk,), "fp32", 3, scale=2.0)),
    ("additive [B,1,Sq,Sk]", lambda sq, sk: rand((2, 1, sq, sk), "fp32", 4, scale=2.0)),
    ("bool [Sq,Sk]", lambda sq, sk: rand((sq, sk), "fp32", 5) > -0.5),
    ("bool [B,H,1,Sk]", lambda sq, sk: rand((2, 3, 1, sk), "fp32", 6) > -0.5),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name,make", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("causal", [False, True])
def test_scaled_masked_matches_reference(name, make, causal, dtype):
    sq, sk = 5, 769
    x = rand((2, 3, sq, sk), dtype, 7, scale=3.0)
    mask = make(sq, sk)
    if mask.dtype != bool:
        mask = mask.astype(atb.Dtype.of(dtype).numpy)
    check_op("ScaledMaskedSoftmax", {"scale": 0.125, "causal": causal}, [x, mask])


@pytest.mark.parametrize("dtype", FLOATS)
def test_scaled_masked_vs_sdpa(dtype):
    """SDPA with V = identity returns the attention weights softmax(q k^T * scale + mask)."""
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 9, 16
    q, k = torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    eye = torch.eye(s).expand(b, h, s, s)
    x = half((q @ k.transpose(-1, -2)).numpy(), dtype)          # x: [B, H, S, S]
    xf = x.float()
    scale = d ** -0.5
    bool_mask = torch.rand(b, 1, s, s, generator=torch.Generator().manual_seed(1)) > 0.3
    bool_mask[..., 0] = True                                    # SDPA gives NaN for empty rows
    add_mask = torch.randn(s, s, generator=torch.Generator().manual_seed(2))
    cases = [({"scale": scale, "causal": True}, None,
              dict(is_causal=True)),
             ({"scale": scale}, bool_mask, dict(attn_mask=bool_mask)),
             ({"scale": scale}, add_mask.to(x.dtype), dict(attn_mask=add_mask.to(x.dtype).float()))]
    for params, mask, kw in cases:
        # q' = x rows, k' = I: q' k'^T = x, so SDPA(q'=x, k'=I, v=I) = softmax(x * scale + mask)
        want = F.scaled_dot_product_attention(xf, torch.eye(s).expand(b, h, s, s), eye, scale=scale,
                                              **kw)
        y, = run("ScaledMaskedSoftmax", params, [x] if mask is None else [x, mask])
        atb.assert_close(y, want, dtype, f"ScaledMaskedSoftmax {params} vs SDPA")


def test_causal_is_bottom_right_aligned_and_empty_rows_are_zero():
    x = torch.from_numpy(rand((3, 5), "fp32", 8))
    y, = run("ScaledMaskedSoftmax", {"causal": True}, [x])
    keep = torch.ones(3, 5, dtype=torch.bool).tril(2)           # query i sits at key 2 + i
    want = F.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    atb.assert_close(y, want, "fp32", "causal with Sq < Sk")
    assert torch.all(y[~keep] == 0)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False                                             # row 1 sees nothing
    y, = run("ScaledMaskedSoftmax", {}, [x, mask])
    assert torch.equal(y[1], torch.zeros(5))
    atb.assert_close(y[[0, 2]], F.softmax(x[[0, 2]], dim=-1), "fp32")
    ref, = atb.Builder(backend="numpy").build_operation("ScaledMaskedSoftmax").execute(
        [x.numpy(), mask.numpy()])
    np.testing.assert_array_equal(ref[1], np.zeros(5, np.float32))
    y, = run("ScaledMaskedSoftmax", {"causal": True}, [torch.from_numpy(rand((5, 3), "fp32", 9))])
    assert torch.equal(y[:2], torch.zeros(2, 3))                # Sq > Sk: first rows see no key


X = rand((2, 4, 8))
BAD = [
    # (op, params, inputs, error, fragments)
    ("Softmax", {}, [X.astype(np.int64)], atb.DtypeError, ["x", "INT64"]),
    ("Softmax", {"dim": 3}, [X], atb.ShapeError, ["rank", "[2, 4, 8]"]),
    ("Softmax", {"dim": (1, -2)}, [X], atb.ParamsError, ["twice"]),
    ("Softmax", {"dtype": "bf16"}, [X], atb.DtypeError, ["BF16", "FP32"]),
    ("Softmax", {}, [X, X], atb.InputError, ["number of inputs"]),
    ("Softmax", {}, [], atb.InputError, ["number of inputs"]),
    ("ScaledMaskedSoftmax", {}, [X, rand((3, 8))], atb.ShapeError, ["mask", "[3, 8]"]),
    ("ScaledMaskedSoftmax", {}, [X, rand((1, 2, 4, 8))], atb.ShapeError, ["mask"]),
    ("ScaledMaskedSoftmax", {}, [X, np.ones((4, 8), np.int32)], atb.DtypeError, ["mask", "INT32"]),
    ("ScaledMaskedSoftmax", {"causal": True}, [rand((8,))], atb.ShapeError, ["rank >= 2"]),
    ("ScaledMaskedSoftmax", {"causal": True, "dim": 1}, [X], atb.ParamsError, ["last axis"]),
    ("ScaledMaskedSoftmax", {"dtype": "fp16"}, [X, rand((4, 8))], atb.DtypeError, ["'x'", "FP16"]),
]


@pytest.mark.parametrize("op,params,inputs,exc,frags", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(op, params, inputs, exc, frags):
    check_error(op, params, inputs, exc, *frags, outputs=[np.full((2, 4, 8), 3.0, np.float32)])


def test_bad_params():
    check_error("Softmax", {"dim": "last"}, [], atb.ParamsError, "dim", build_error=True)
    check_error("Softmax", {"dim": []}, [], atb.ParamsError, "dim", build_error=True)
    check_error("ScaledMaskedSoftmax", {"scale": float("nan")}, [], atb.ParamsError, "scale",
                build_error=True)
    check_error("ScaledMaskedSoftmax", {"mask_type": 1}, [], atb.ParamsError, "mask_type",
                build_error=True)


def test_wrong_outputs_leave_them_untouched():
    check_error("Softmax", {}, [X], atb.InputError, "number of outputs",
                outputs=[np.full((2, 4, 8), 3.0, np.float32)] * 2)
    check_error("ScaledMaskedSoftmax", {}, [X], atb.ShapeError, "output",
                outputs=[np.full((2, 4, 9), 3.0, np.float32)])
    check_error("ScaledMaskedSoftmax", {}, [X.astype(np.float16)], atb.DtypeError, "output",
                outputs=[np.full((2, 4, 8), 3.0, np.float32)])
