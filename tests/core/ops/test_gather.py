"""Gather and Embedding: torch kernels vs the NumPy reference, torch.gather /
index_select / F.embedding as oracles, ids out of range rejected before writing."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand

DTYPES = FLOATS + ["int32"]


def _t(a):
    return atb.tensor.to_torch(np.array(a, copy=True))


def _data(shape, dtype, seed):
    if dtype == "int32":
        return np.random.default_rng(seed).integers(-99, 99, size=shape).astype(np.int32)
    return rand(shape, dtype, seed)


def _ids(shape, n, dtype, seed):
    return np.random.default_rng(seed).integers(0, n, size=shape).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("shape,axis,idx_shape", [
    ((7, 5), 0, (4,)), ((3, 11, 2), 1, (2, 3)), ((3, 11, 2), -1, (5,)),
    ((5, 6), 1, ()), ((9,), 0, (3, 2, 2))])
def test_gather(dtype, idx_dtype, shape, axis, idx_shape):
    x = _data(shape, dtype, 1)
    idx = _ids(idx_shape, shape[axis], idx_dtype, 2)
    ref, = check_op("Gather", {"axis": axis}, [x, idx])
    want_shape = shape[:axis % len(shape)] + idx_shape + shape[axis % len(shape) + 1:]
    assert ref.shape == want_shape
    got, = atb.Builder().build_operation("Gather", {"dim": axis}).execute([_t(x), _t(idx)])
    # Oracle: index_select with flat indices, reshaped like NumPy's take.
    flat = torch.index_select(_t(x), axis, _t(idx).reshape(-1).long())
    assert torch.equal(got, flat.reshape(want_shape))


def test_gather_matches_torch_gather():
    x = _t(rand((4, 9), "fp32", 3))
    idx = torch.tensor([8, 0, 3, 3, 5])
    got, = atb.Builder().build_operation("Gather", {"axis": 1}).execute([x, idx])
    # torch.gather picks per element; broadcasting the index over rows is a column gather.
    assert torch.equal(got, torch.gather(x, 1, idx[None, :].expand(4, -1)))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
@pytest.mark.parametrize("ids_shape", [(5,), (2, 3), (2, 3, 4), ()])
def test_embedding(dtype, ids_dtype, ids_shape):
    w = rand((37, 19), dtype, 4)
    ids = _ids(ids_shape, 37, ids_dtype, 5)
    ref, = check_op("Embedding", {}, [w, ids])
    assert ref.shape == ids_shape + (19,)
    got, = atb.Builder().build_operation("Embedding", {"vocab_size": 37}).execute([_t(w), _t(ids)])
    assert torch.equal(got, F.embedding(_t(ids).long(), _t(w)))


def test_embedding_edge_ids_and_output():
    w = torch.randn(10, 4)
    ids = torch.tensor([[0, 9], [9, 0]])
    out = torch.zeros(2, 2, 4)
    atb.Builder().build_operation("Embedding").execute([w, ids], [out])
    assert torch.equal(out, w[ids])


W = rand((10, 4))
OUT = [np.full((3, 4), 5.0, np.float32)]
BAD = [
    ("Embedding", {}, [W, np.array([0, 10, 2])], atb.InputError, ["'ids'", "out of range", "10"]),
    ("Embedding", {}, [W, np.array([0, -1, 2])], atb.InputError, ["'ids'", "-1"]),
    ("Embedding", {}, [W, np.array([0.0, 1.0, 2.0])], atb.DtypeError, ["'ids'", "FP64"]),
    ("Embedding", {}, [rand((10,)), np.array([0, 1, 2])], atb.ShapeError, ["'weight'", "rank 2"]),
    ("Embedding", {"num_embeddings": 12}, [W, np.array([0, 1, 2])], atb.ShapeError,
     ["num_embeddings", "12"]),
    ("Embedding", {}, [W], atb.InputError, ["number of inputs"]),
    # shapes chosen so the given output [3, 4] fits: the range check itself must refuse
    ("Gather", {"axis": 1}, [rand((3, 6)), np.array([1, 6, 0, 2])], atb.InputError,
     ["'indices'", "out of range", "6"]),
    ("Gather", {}, [rand((5, 4)), np.array([-2, 1, 0])], atb.InputError, ["-2"]),
    ("Gather", {"axis": 2}, [rand((4, 3)), np.array([1, 1, 0])], atb.ShapeError,
     ["axis 2", "out of range"]),
    ("Gather", {}, [rand((4, 4)), np.array([1.0, 2.0, 0.0], np.float32)], atb.DtypeError,
     ["'indices'", "FP32"]),
    ("Gather", {}, [None, np.array([1, 2, 0])], atb.InputError, ["'x'", "missing"]),
]


@pytest.mark.parametrize("op,params,inputs,exc,frags", BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(op, params, inputs, exc, frags):
    check_error(op, params, inputs, exc, *frags, outputs=OUT)


def test_out_of_range_ids_rejected_on_numpy_backend_too():
    check_error("Embedding", {}, [W, np.array([0, 11, 2])], atb.InputError, "11",
                backend="numpy", outputs=OUT)


def test_bad_outputs_leave_them_untouched():
    check_error("Embedding", {}, [W, np.array([0, 1, 2])], atb.ShapeError, "output",
                outputs=[np.full((3, 5), 5.0, np.float32)])
    check_error("Embedding", {}, [W, np.array([0, 1, 2])], atb.InputError, "number of outputs",
                outputs=OUT * 2)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_bound_embedding_in_a_graph_op_writes_its_rows_and_refuses_bad_ids(ids_dtype):
    """A GraphOp's CPU Embedding is bound to its planned buffer (one index_select, no
    separate range pass): rows equal F.embedding's; a bad id still raises InputError
    naming Embedding, and the next good call runs."""
    from atbcore.graph.graph_op import GraphOp
    from atbcore.graph import layers as L
    from atb_torch.graph_layers import OpLayer

    w = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    op = GraphOp([OpLayer("embed", op="Embedding", kind="embedding", weights={"weight": w},
                          x_index=1), L.RmsNorm("n", eps=1e-6)], backend="torch")
    good = torch.tensor([[3, 49, 0, 7]], dtype=ids_dtype)
    want = F.rms_norm(F.embedding(good.long(), w), (8,), eps=1e-6)
    atb.assert_close(op(good), want, "fp32", "bound embedding + norm")
    assert op.last_plan is not None and any(
        p.bound.get("embed") for p in op.last_plan.programs.values())
    for bad in (50, -1):
        with pytest.raises(atb.InputError, match="Embedding.*out of range"):
            op(torch.tensor([[3, bad, 0, 7]], dtype=ids_dtype))
    atb.assert_close(op(good), want, "fp32", "after the refused call")


def test_bound_row_gather_in_a_graph():
    """Rows of a matrix gathered inside a GraphOp (bound into the planned buffer): equal
    to index_select; an index out of range is still refused by name."""
    from atbcore.graph.builder import GraphBuilder
    from atbcore.graph.graph_op import GraphOp

    b = GraphBuilder("rows")
    x = b.add_input("x", atb.TensorDesc((6, 4), "fp32"))
    i = b.add_input("i", atb.TensorDesc((3,), "int64"))
    g = b.add_node("Gather", [x, i], {"axis": 0})[0]
    b.mark_output(b.add_node("Relu", [g])[0])
    op = GraphOp(b.build(), backend="torch")
    xs = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    idx = torch.tensor([5, 0, 5])
    assert torch.equal(op(xs, idx), torch.relu(torch.index_select(xs, 0, idx)))
    assert any(p.bound.get("gather") for p in op.last_plan.programs.values())
    with pytest.raises(atb.InputError, match="out of range"):
        op(xs, torch.tensor([0, 6, 1]))
