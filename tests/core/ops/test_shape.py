"""Shape ops: Transpose, Reshape (a view), Split, Concat, Slice — torch kernels vs
the NumPy reference, torch's own permute/split/cat/slicing as oracles, bad input."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand

DTYPES = FLOATS + ["int32"]


def _t(a):
    return atb.tensor.to_torch(np.array(a, copy=True))


def _op(name, params):
    return atb.Builder().build_operation(name, params)


def _data(shape, dtype, seed):
    if dtype == "int32":
        return np.random.default_rng(seed).integers(-99, 99, size=shape).astype(np.int32)
    return rand(shape, dtype, seed)


# ----------------------------------------------------------------------------- Transpose


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,perm", [((4, 7), (1, 0)), ((2, 3, 5), (2, 0, 1)),
                                        ((2, 3, 4, 5), (0, 2, 1, 3)), ((3, 5), (0, 1))])
def test_transpose(dtype, shape, perm):
    x = _data(shape, dtype, 1)
    check_op("Transpose", {"perm": list(perm)}, [x])
    xt = _t(x)
    y, = _op("Transpose", {"perm": perm}).execute([xt])
    assert torch.equal(y, xt.permute(*perm))
    assert y.is_contiguous()
    y.zero_()  # a fresh tensor, even for the identity permutation
    assert torch.equal(xt, _t(x))


# ----------------------------------------------------------------------------- Reshape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,new,want", [((2, 3, 5), (6, 5), (6, 5)), ((2, 3, 5), (-1,), (30,)),
                                            ((4, 9), (3, -1, 2), (3, 6, 2)),
                                            ((7,), (1, 7, 1), (1, 7, 1))])
def test_reshape(dtype, shape, new, want):
    x = _data(shape, dtype, 2)
    ref, = check_op("Reshape", {"shape": list(new)}, [x])
    assert ref.shape == want
    desc, = _op("Reshape", {"shape": new}).infer_shape([atb.TensorDesc(shape, dtype)])
    assert desc.shape == want


def test_reshape_is_a_view_on_torch():
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    y, = _op("Reshape", {"shape": [6, -1]}).execute([x])
    assert y.shape == (6, 4) and y.data_ptr() == x.data_ptr()
    y[0, 0] = 100.0
    y[5, 3] = -1.0
    assert x[0, 0, 0] == 100.0 and x[1, 2, 3] == -1.0
    # NumPy input through the torch backend: still no copy (DLPack both ways).
    a = np.arange(12, dtype=np.float32)
    b, = atb.Builder(backend="torch").build_operation("Reshape", {"shape": [3, 4]}).execute([a])
    b[2, 3] = 55.0
    assert a[11] == 55.0


def test_reshape_of_a_non_viewable_input_copies_correctly():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # strides allow no view
    y, = _op("Reshape", {"shape": [12]}).execute([x])
    assert torch.equal(y, x.reshape(12))


# ----------------------------------------------------------------------------- Split


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,params,n", [
    ((3, 12), {"num": 3}, 3), ((3, 13), {"sizes": [5, 1, 7]}, 3),
    ((6, 5, 2), {"dim": 0, "num": 2}, 2),
    ((2, 9, 3), {"split_dim": 1, "split_sizes": [4, 0, 5]}, 3),
    ((4, 7), {"num": 1}, 1)])
def test_split(dtype, shape, params, n):
    x = _data(shape, dtype, 3)
    ref = check_op("Split", params, [x])
    assert len(ref) == n
    dim = params.get("dim", params.get("split_dim", -1))
    sizes = params.get("sizes") or params.get("split_sizes") or shape[dim] // params["num"]
    xt = _t(x)
    want = torch.split(xt, sizes, dim=dim)
    got = _op("Split", params).execute([xt])
    assert len(got) == n
    for g, w in zip(got, want):  # views of the input, as torch.split (and Reshape) make
        assert torch.equal(g, w)
        assert g.untyped_storage().data_ptr() == xt.untyped_storage().data_ptr()


def test_split_into_given_outputs():
    x = _t(rand((2, 10), "fp32", 4))
    outs = [torch.zeros(2, 3), torch.zeros(2, 7)]
    res = _op("Split", {"sizes": [3, 7]}).execute([x], outs)
    assert res[0] is outs[0] and res[1] is outs[1]
    assert torch.equal(outs[0], x[:, :3]) and torch.equal(outs[1], x[:, 3:])
    descs = _op("Split", {"num": 5}).infer_shape([atb.TensorDesc((2, 10), "fp16")])
    assert [d.shape for d in descs] == [(2, 2)] * 5


# ----------------------------------------------------------------------------- Concat


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes,dim", [
    ([(3, 5), (3, 2)], -1), ([(1, 4), (2, 4), (5, 4)], 0), ([(2, 3, 5)], 1),
    ([(2, 1, 7), (2, 4, 7), (2, 0, 7), (2, 3, 7), (2, 2, 7)], 1)])
def test_concat(dtype, shapes, dim):
    xs = [_data(s, dtype, 10 + i) for i, s in enumerate(shapes)]
    ref, = check_op("Concat", {"dim": dim}, xs)
    got, = _op("Concat", {"concat_dim": dim}).execute([_t(x) for x in xs])
    assert torch.equal(got, torch.cat([_t(x) for x in xs], dim=dim))
    assert got.shape == ref.shape


def test_concat_infer_shape_and_output():
    op = _op("Concat", {"dim": 0})
    descs = [atb.TensorDesc((2, 3), "bf16"), atb.TensorDesc((5, 3), "bf16")]
    assert op.infer_shape(descs) == [atb.TensorDesc((7, 3), "bf16")]
    out = torch.zeros(7, 3)
    a, b = torch.randn(2, 3), torch.randn(5, 3)
    op.execute([a, b], [out])
    assert torch.equal(out, torch.cat([a, b]))


# ----------------------------------------------------------------------------- Slice


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,offsets,sizes,index", [
    ((5, 7), [1, 2], [3, 4], np.s_[1:4, 2:6]),
    ((5, 7), [0, -3], [-1, 2], np.s_[0:, 4:6]),
    ((2, 9, 3), [1, 0, 1], [1, -1, 2], np.s_[1:2, :, 1:3]),
    ((6,), [6], [0], np.s_[6:6]),
    ((4, 4), [0, 0], [-1, -1], np.s_[:, :])])
def test_slice(dtype, shape, offsets, sizes, index):
    x = _data(shape, dtype, 5)
    ref, = check_op("Slice", {"offsets": offsets, "sizes": sizes}, [x])
    xt = _t(x)
    got, = _op("Slice", {"offsets": offsets, "sizes": sizes}).execute([xt])
    assert torch.equal(got, xt[index]) and got.is_contiguous()
    assert ref.shape == tuple(xt[index].shape)


# ----------------------------------------------------------------------------- bad input

X = rand((2, 8))
OUT = [np.full((2, 8), 3.0, np.float32)]
BAD = [
    ("Transpose", {"perm": [1, 0, 2]}, [X], atb.ShapeError, ["rank 3", "[2, 8]"]),
    ("Transpose", {"perm": [1, 0]}, [], atb.InputError, ["number of inputs"]),
    ("Reshape", {"shape": [3, 5]}, [X], atb.ShapeError, ["size mismatch", "15", "16"]),
    ("Reshape", {"shape": [3, -1]}, [X], atb.ShapeError, ["-1 cannot be inferred"]),
    ("Reshape", {"shape": [0, -1]}, [X], atb.ShapeError, ["-1 cannot be inferred"]),
    ("Split", {"sizes": [3, 4]}, [X], atb.ShapeError, ["sum", "8", "7"]),
    ("Split", {"num": 3}, [X], atb.ShapeError, ["divisible", "3"]),
    ("Split", {"num": 2, "dim": 2}, [X], atb.ShapeError, ["dim 2", "out of range"]),
    ("Split", {"num": 2}, [X, X], atb.InputError, ["number of inputs"]),
    ("Concat", {}, [X, rand((3, 7))], atb.ShapeError, ["'x1'", "[2, 8]", "[3, 7]"]),
    ("Concat", {}, [X, rand((2, 8, 1))], atb.ShapeError, ["'x1'"]),
    ("Concat", {}, [X, X.astype(np.float16)], atb.DtypeError, ["'x1'", "FP32", "FP16"]),
    ("Concat", {}, [], atb.InputError, ["number of inputs"]),
    ("Concat", {}, [X, None, X], atb.InputError, ["'x1'", "missing"]),
    ("Concat", {"dim": -3}, [X, X], atb.ShapeError, ["out of range"]),
    ("Slice", {"offsets": [0, 0, 0], "sizes": [1, 1, 1]}, [X], atb.ShapeError, ["rank 3"]),
    ("Slice", {"offsets": [3, 0], "sizes": [1, 1]}, [X], atb.ShapeError, ["offsets[0] = 3"]),
    ("Slice", {"offsets": [0, -9], "sizes": [1, 1]}, [X], atb.ShapeError, ["offsets[1] = -9"]),
    ("Slice", {"offsets": [1, 5], "sizes": [1, 4]}, [X], atb.ShapeError, ["past the end", "<= 8"]),
]


@pytest.mark.parametrize("op,params,inputs,exc,frags", BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(op, params, inputs, exc, frags):
    check_error(op, params, inputs, exc, *frags, outputs=OUT)


def test_bad_outputs_leave_them_untouched():
    check_error("Split", {"num": 2}, [X], atb.InputError, "number of outputs",
                outputs=[np.full((2, 4), 3.0, np.float32)] * 3)
    check_error("Split", {"num": 2}, [X], atb.ShapeError, "output",
                outputs=[np.full((2, 4), 3.0, np.float32), np.full((2, 5), 3.0, np.float32)])
    check_error("Transpose", {"perm": [1, 0]}, [X], atb.ShapeError, "output", outputs=OUT)
    check_error("Reshape", {"shape": [16]}, [X], atb.ShapeError, "output", outputs=OUT)


@pytest.mark.parametrize("op,params,frag", [
    ("Transpose", {"perm": [0, 0]}, "not a permutation"),
    ("Transpose", {"perm": [1, 2]}, "not a permutation"),
    ("Transpose", {}, "perm"),
    ("Reshape", {"shape": [-1, -1]}, "at most one -1"),
    ("Reshape", {"shape": [2, -2]}, "shape"),
    ("Reshape", {}, "shape"),
    ("Split", {}, "num or sizes"),
    ("Split", {"num": 0}, "num"),
    ("Split", {"num": 2, "sizes": [1, 2, 3]}, "disagree"),
    ("Split", {"sizes": [2, -1]}, "sizes"),
    ("Slice", {"offsets": [0, 0], "sizes": [1]}, "lengths differ"),
    ("Slice", {"offsets": [0]}, "required"),
    ("Slice", {"offsets": [0], "sizes": [-2]}, "sizes"),
])
def test_bad_params(op, params, frag):
    check_error(op, params, [], atb.ParamsError, frag, build_error=True)
