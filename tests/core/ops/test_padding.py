"""Unpad / Pad: torch kernels vs the NumPy reference and a plain Python loop,
right and left padding, round trips, data-dependent shapes, bad input."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand

DTYPES = FLOATS + ["int64"]
CASES = [  # (x shape [B, S, ...], seq_lens)
    ((3, 5, 4), [2, 5, 0]),
    ((1, 7), [7]),
    ((4, 6, 2, 3), [1, 6, 3, 4]),
    ((2, 9, 33), [0, 0]),
]


def _t(a):
    return atb.tensor.to_torch(np.array(a, copy=True))


def _data(shape, dtype, seed):
    if dtype == "int64":
        return np.random.default_rng(seed).integers(-99, 99, size=shape).astype(np.int64)
    return rand(shape, dtype, seed)


def loop_unpad(x, lens, side):
    """The oracle: walk every row and copy its real tokens, one by one."""
    s = x.shape[1]
    rows, cu = [], [0]
    for b, n in enumerate(lens):
        start = 0 if side == "right" else s - n
        for j in range(start, start + n):
            rows.append(x[b, j])
        cu.append(cu[-1] + n)
    packed = np.stack(rows) if rows else np.zeros((0,) + x.shape[2:], x.dtype)
    return packed.astype(x.dtype), np.array(cu, np.int32)


def loop_pad(packed, lens, side, s, value):
    y = np.full((len(lens), s) + packed.shape[1:], value, np.float64).astype(packed.dtype)
    t = 0
    for b, n in enumerate(lens):
        start = 0 if side == "right" else s - n
        for j in range(n):
            y[b, start + j] = packed[t]
            t += 1
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("shape,lens", CASES)
def test_unpad(shape, lens, side, dtype):
    x = _data(shape, dtype, 1)
    for lens_dtype in (np.int32, np.int64):
        seq = np.array(lens, lens_dtype)
        packed, cu = check_op("Unpad", {"padding_side": side}, [x, seq])
        want_packed, want_cu = loop_unpad(x, lens, side)
        np.testing.assert_array_equal(packed, want_packed)
        np.testing.assert_array_equal(cu, want_cu)
        got_packed, got_cu = atb.Builder().build_operation(
            "Unpad", {"padding_side": side}).execute([_t(x), _t(seq)])
        np.testing.assert_array_equal(atb.tensor.to_numpy(got_packed), want_packed)
        assert got_cu.dtype == torch.int32 and got_cu.tolist() == want_cu.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("shape,lens", CASES)
def test_pad(shape, lens, side, dtype):
    packed = _data((sum(lens),) + shape[2:], dtype, 2)
    seq = np.array(lens, np.int64)
    for max_len, value in ((None, 0.0), (shape[1] + 2, -7.0)):
        params = {"padding_side": side, "pad_value": value}
        if max_len is not None:
            params["max_seq_len"] = max_len
        y, = check_op("Pad", params, [packed, seq])
        s = max_len if max_len is not None else max(lens)
        np.testing.assert_array_equal(y, loop_pad(packed, lens, side, s, value))


@pytest.mark.parametrize("side", ["right", "left"])
def test_round_trip(side):
    x = _t(rand((4, 6, 8), "bf16", 3))
    lens = torch.tensor([6, 1, 0, 4])
    packed, cu = atb.Builder().build_operation("Unpad", {"padding_side": side}).execute([x, lens])
    assert packed.shape == (11, 8) and cu.tolist() == [0, 6, 7, 7, 11]
    y, = atb.Builder().build_operation("Pad", {"padding_side": side, "max_seq_len": 6}).execute(
        [packed, lens])
    mask = torch.arange(6)[None] < lens[:, None]
    if side == "left":
        mask = mask.flip(1)
    assert torch.equal(y[mask], x[mask]) and bool((y[~mask] == 0).all())


def test_data_dependent_dims_are_minus_one():
    unpad = atb.Builder().build_operation("Unpad")
    d = unpad.infer_shape([atb.TensorDesc((3, 5, 8), "fp16"), atb.TensorDesc((3,), "int32")])
    assert d == [atb.TensorDesc((-1, 8), "fp16"), atb.TensorDesc((4,), "int32")]
    pad = atb.Builder().build_operation("Pad")
    assert pad.infer_shape([atb.TensorDesc((9, 8), "fp16"),
                            atb.TensorDesc((3,), "int64")])[0].shape == (3, -1, 8)
    pad = atb.Builder().build_operation("Pad", {"max_seq_len": 5})
    assert pad.infer_shape([atb.TensorDesc((9, 8), "fp16"),
                            atb.TensorDesc((3,), "int64")])[0].shape == (3, 5, 8)
    # A given output of the right run-time size is accepted and written.
    x, lens = torch.randn(2, 4, 3), torch.tensor([3, 2])
    outs = [torch.zeros(5, 3), torch.zeros(3, dtype=torch.int32)]
    unpad.execute([x, lens], outs)
    assert torch.equal(outs[0], torch.cat([x[0, :3], x[1, :2]])) and outs[1].tolist() == [0, 3, 5]


X = rand((3, 4, 2))
P = rand((6, 2))
OUT_U = [np.full((6, 2), 3.0, np.float32), np.zeros(4, np.int32)]
OUT_P = [np.full((3, 4, 2), 3.0, np.float32)]
BAD = [
    ("Unpad", {}, [X, np.array([1, 5, 0])], atb.InputError, ["'seq_lens'", "<= 4", "5"], OUT_U),
    ("Unpad", {}, [X, np.array([1, -1, 6])], atb.InputError, ["'seq_lens'", "-1"], OUT_U),
    ("Unpad", {}, [X, np.array([1.0, 2.0, 3.0])], atb.DtypeError, ["'seq_lens'"], OUT_U),
    ("Unpad", {}, [X, np.array([1, 2])], atb.ShapeError, ["'seq_lens'", "batch"], OUT_U),
    ("Unpad", {}, [rand((4,)), np.array([1])], atb.ShapeError, ["'x'", "rank >= 2"], OUT_U),
    ("Unpad", {}, [X, np.array([[1, 2, 3]])], atb.ShapeError, ["'seq_lens'", "rank 1"], OUT_U),
    ("Unpad", {}, [X], atb.InputError, ["number of inputs"], OUT_U),
    ("Pad", {"max_seq_len": 4}, [P, np.array([2, 3, 2])], atb.InputError,
     ["sum of 'seq_lens'", "6", "7"], OUT_P),
    ("Pad", {"max_seq_len": 4}, [P, np.array([5, 1, 0])], atb.InputError,
     ["max_seq_len", "<= 4", "5"], OUT_P),
    ("Pad", {"max_seq_len": 4}, [P, np.array([7, -1, 0])], atb.InputError, ["-1"], OUT_P),
    ("Pad", {"max_seq_len": 4}, [P, np.array([2.0, 2.0, 2.0])], atb.DtypeError, ["'seq_lens'"],
     OUT_P),
    ("Pad", {"max_seq_len": 4}, [rand(()), np.array([0, 0, 0])], atb.ShapeError,
     ["'packed'", "rank >= 1"], OUT_P),
    ("Pad", {"max_seq_len": 4}, [P, np.array([2, 2, 2])], atb.ShapeError, ["output"],
     [np.full((3, 5, 2), 3.0, np.float32)]),
]


@pytest.mark.parametrize("op,params,inputs,exc,frags,outs", BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(op, params, inputs, exc, frags, outs):
    check_error(op, params, inputs, exc, *frags, outputs=outs)


@pytest.mark.parametrize("op,params,frag", [
    ("Unpad", {"padding_side": "middle"}, "padding_side"),
    ("Pad", {"padding_side": "top"}, "padding_side"),
    ("Pad", {"max_seq_len": -1}, "max_seq_len"),
])
def test_bad_params(op, params, frag):
    check_error(op, params, [], atb.ParamsError, frag, build_error=True)
