"""Elewise and ResidualAdd: torch kernels vs the NumPy reference, torch functional
ops (float64) as an independent oracle, integer wrap-around, casts, bad input."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand

UNARY_FNS = {"neg": torch.neg, "cos": torch.cos, "sin": torch.sin, "tanh": torch.tanh,
             "exp": torch.exp, "rsqrt": torch.rsqrt}
BINARY_FNS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}
# (x shape, y shape): equal shapes, trailing broadcast, two-sided broadcast, odd sizes
PAIRS = [((7,), (7,)), ((3, 5), (5,)), ((2, 1, 33), (1, 3, 1)), ((4, 9), (1,))]
SHAPES = [(7,), (3, 5), (2, 3, 33)]


def _run(params, inputs):
    return atb.Builder().build_operation("Elewise", params).execute(
        [atb.tensor.to_torch(np.array(a, copy=True)) for a in inputs])[0]


def _oracle(fn, dtype, *xs):
    """torch functional op in float64 from the exact inputs, rounded once."""
    t = [atb.tensor.to_torch(np.array(x)).double() for x in xs]
    return fn(*t).to(atb.Dtype.of(dtype).torch)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("xs,ys", PAIRS)
@pytest.mark.parametrize("t", sorted(BINARY_FNS))
def test_binary_float(t, xs, ys, dtype):
    x = rand(xs, dtype, 1)
    y = rand(ys, dtype, 2, low=0.5, high=2.0) if t == "div" else rand(ys, dtype, 2)
    ref, = check_op("Elewise", {"elewise_type": t}, [x, y])
    assert ref.shape == np.broadcast_shapes(xs, ys) and ref.dtype == x.dtype
    got = _run({"elewise_type": t}, [x, y])
    atb.assert_close(got, _oracle(BINARY_FNS[t], dtype, x, y), dtype, f"{t} vs torch")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", sorted(UNARY_FNS))
def test_unary_float(t, shape, dtype):
    x = rand(shape, dtype, 3, low=0.05, high=4.0) if t == "rsqrt" else rand(shape, dtype, 3)
    check_op("Elewise", {"elewise_type": t}, [x])
    got = _run({"elewise_type": t}, [x])
    atb.assert_close(got, _oracle(UNARY_FNS[t], dtype, x), dtype, f"{t} vs torch")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("scalar", [0.5, -3.25, 1e-3])
def test_muls(dtype, scalar):
    x = rand((3, 17), dtype, 4)
    check_op("Elewise", {"elewise_type": "muls", "var_attr": scalar}, [x])
    got = _run({"elewise_type": "muls", "scalar": scalar}, [x])
    atb.assert_close(got, _oracle(lambda a: a * scalar, dtype, x), dtype, "muls vs torch")


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64"])
@pytest.mark.parametrize("t", ["add", "sub", "mul", "neg"])
def test_integer_ops_exact_with_wraparound(t, dtype):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(5)
    # int8 values span the whole range so add/mul overflow and must wrap like torch.
    hi = info.max if dtype == "int8" else 1000
    x = rng.integers(-hi, hi, size=(3, 11)).astype(dtype)
    y = rng.integers(-hi, hi, size=(11,)).astype(dtype)
    ins = [x] if t == "neg" else [x, y]
    ref, = check_op("Elewise", {"elewise_type": t}, ins)  # exact comparison for ints
    assert ref.dtype == np.dtype(dtype)
    want = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[t](x, y) if t != "neg" else -x
    np.testing.assert_array_equal(ref, want)


CASTS = [("fp32", "fp16"), ("fp32", "bf16"), ("fp16", "fp32"), ("bf16", "fp32"),
         ("fp16", "bf16"), ("fp32", "int32"), ("bf16", "int64"), ("int32", "fp32"),
         ("int64", "int32"), ("int32", "fp16"), ("fp32", "bool"), ("fp32", "fp32")]


@pytest.mark.parametrize("src,dst", CASTS)
def test_cast(src, dst):
    if atb.Dtype.of(src).is_integer:
        x = np.random.default_rng(6).integers(-500, 500, size=(5, 13)).astype(src)
    else:
        x = rand((5, 13), src, 6, scale=40.0)
        x[0, :3] = 0  # exact zeros for the bool cast
    ref, = check_op("Elewise", {"elewise_type": "cast", "out_dtype": dst}, [x])
    assert ref.dtype == atb.Dtype.of(dst).numpy
    got = _run({"elewise_type": "cast", "out_tensor_type": dst}, [x])
    want = atb.tensor.to_torch(np.array(x)).to(atb.Dtype.of(dst).torch)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cast_to_same_dtype_is_a_copy():
    x = torch.randn(4, 5)
    y, = atb.Builder().build_operation("Elewise", {"elewise_type": "cast",
                                                   "out_dtype": "fp32"}).execute([x])
    y.fill_(7.0)
    assert not torch.equal(x, y)


def test_atb_spelling_and_writes_into_output():
    x, y = rand((3, 5), "fp32", 1), rand((3, 5), "fp32", 2)
    out = torch.zeros(3, 5)
    res = atb.Builder().build_operation("Elewise", {"elewise_type": "ELEWISE_SUB"}).execute(
        [torch.from_numpy(x), torch.from_numpy(y)], [out])
    assert res[0] is out
    atb.assert_close(out, x.astype(np.float64) - y, "fp32")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 5, 769)])
def test_residual_add(dtype, shape):
    x, r = rand(shape, dtype, 7), rand(shape, dtype, 8)
    check_op("ResidualAdd", {}, [x, r])
    got, = atb.Builder().build_operation("ResidualAdd").execute(
        [atb.tensor.to_torch(x.copy()), atb.tensor.to_torch(r.copy())])
    atb.assert_close(got, _oracle(torch.add, dtype, x, r), dtype, "ResidualAdd vs torch")


X, Y = rand((2, 8)), rand((2, 8))
OUT = [np.full((2, 8), 3.0, np.float32)]
BAD = [
    ("Elewise", {"elewise_type": "add"}, [X], atb.InputError, ["second input"]),
    ("Elewise", {"elewise_type": "cos"}, [X, Y], atb.InputError, ["one input"]),
    ("Elewise", {"elewise_type": "mul"}, [X, Y.astype(np.float16)], atb.DtypeError,
     ["'y'", "FP32", "FP16"]),
    ("Elewise", {"elewise_type": "add"}, [X, rand((3, 8))], atb.ShapeError,
     ["broadcast", "[2, 8]", "[3, 8]"]),
    ("Elewise", {"elewise_type": "div"}, [X.astype(np.int32), Y.astype(np.int32)],
     atb.DtypeError, ["INT32"]),
    ("Elewise", {"elewise_type": "exp"}, [X.astype(np.int64)], atb.DtypeError, ["INT64"]),
    ("Elewise", {"elewise_type": "neg"}, [X.astype(np.uint8)], atb.DtypeError, ["UINT8"]),
    ("Elewise", {"elewise_type": "add"}, [X, Y, Y], atb.InputError, ["number of inputs"]),
    ("Elewise", {"elewise_type": "add"}, [None, Y], atb.InputError, ["'x'", "missing"]),
    ("ResidualAdd", {}, [X, rand((2, 9))], atb.ShapeError, ["residual", "[2, 8]", "[2, 9]"]),
    ("ResidualAdd", {}, [X, Y.astype(np.float16)], atb.DtypeError, ["residual"]),
    ("ResidualAdd", {}, [X.astype(np.int32), Y.astype(np.int32)], atb.DtypeError, ["INT32"]),
    ("ResidualAdd", {}, [X], atb.InputError, ["number of inputs"]),
]


@pytest.mark.parametrize("op,params,inputs,exc,frags", BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(op, params, inputs, exc, frags):
    check_error(op, params, inputs, exc, *frags, outputs=OUT)


def test_bad_outputs_leave_them_untouched():
    check_error("Elewise", {"elewise_type": "add"}, [X, Y], atb.ShapeError, "output",
                outputs=[np.full((2, 9), 3.0, np.float32)])
    check_error("Elewise", {"elewise_type": "add"}, [X, Y], atb.DtypeError, "output",
                outputs=[np.full((2, 8), 3.0, np.float16)])
    check_error("Elewise", {"elewise_type": "add"}, [X, Y], atb.InputError, "number of outputs",
                outputs=OUT * 2)


@pytest.mark.parametrize("params,frag", [
    ({"elewise_type": "pow"}, "elewise_type"),
    ({}, "elewise_type"),
    ({"elewise_type": "cast"}, "out_dtype"),
    ({"elewise_type": "add", "out_dtype": "fp16"}, "cast only"),
    ({"elewise_type": "cast", "out_dtype": "float128"}, "out_dtype"),
    ({"elewise_type": "add", "var_attr": 2.0}, "muls only"),
    ({"elewise_type": "muls", "var_attr": "x"}, "scalar"),
])
def test_bad_params(params, frag):
    check_error("Elewise", params, [], atb.ParamsError, frag, build_error=True)
