"""AllReduce, single process only (this machine runs one process): the identity
without a process group, and a real ``torch.distributed.all_reduce`` call in a
gloo group of world size 1. No multi-process reduction is tested here."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand


def _t(a):
    return atb.tensor.to_torch(np.array(a, copy=True))


@pytest.mark.parametrize("dtype", FLOATS + ["int32"])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 33)])
def test_identity_without_process_group(dtype, shape):
    assert not dist.is_initialized()
    x = rand(shape, dtype, 1) if dtype != "int32" else np.arange(np.prod(shape), dtype=np.int32
                                                                ).reshape(shape)
    ref, = check_op("AllReduce", {"op": "sum"}, [x])
    np.testing.assert_array_equal(ref.view(np.uint8), x.view(np.uint8))  # bit-exact identity
    xt = _t(x)
    y, = atb.Builder().build_operation("AllReduce").execute([xt])
    assert torch.equal(y, xt) and y.data_ptr() != xt.data_ptr()  # a copy, never the input


def test_gloo_group_of_one_calls_all_reduce(tmp_path, monkeypatch):
    calls = []
    real = dist.all_reduce

    def spy(t, op=dist.ReduceOp.SUM, **kw):
        calls.append(op)
        return real(t, op=op, **kw)

    monkeypatch.setattr(dist, "all_reduce", spy)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        x = torch.randn(4, 9)
        before = x.clone()
        for name, want in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
            y, = atb.Builder().build_operation("AllReduce", {"all_reduce_type": name,
                                                             "rank_size": 1}).execute([x])
            assert torch.equal(y, before) and calls[-1] == want
        assert len(calls) == 2 and torch.equal(x, before)  # input never reduced in place
        # The NumPy reference cannot see other processes; with one it is still exact.
        ref, = atb.Builder(backend="numpy").build_operation("AllReduce").execute([x.numpy()])
        np.testing.assert_array_equal(ref, before.numpy())
    finally:
        dist.destroy_process_group()


def test_rank_size_mismatch_is_refused():
    x = rand((2, 8))
    err = check_error("AllReduce", {"rank_size": 2}, [x], atb.CapabilityError, "rank_size 2",
                      "world size 1", outputs=[np.full((2, 8), 3.0, np.float32)])
    assert err.op == "AllReduce"


def test_bad_input_and_params():
    x = rand((2, 8))
    check_error("AllReduce", {}, [x, x], atb.InputError, "number of inputs")
    check_error("AllReduce", {}, [x], atb.ShapeError, "output",
                outputs=[np.full((2, 9), 3.0, np.float32)])
    check_error("AllReduce", {}, [x], atb.InputError, "number of outputs",
                outputs=[np.full((2, 8), 3.0, np.float32)] * 2)
    check_error("AllReduce", {"op": "avg"}, [], atb.ParamsError, "op", build_error=True)
    check_error("AllReduce", {"rank_size": 0}, [], atb.ParamsError, "rank_size", build_error=True)


# ---------------------------------------------------------------- the other collectives
ONE_RANK = [
    ("AllGather", {}, [(3, 4)]), ("AllGather", {"axis": 1}, [(3, 4)]),
    ("ReduceScatter", {"op": "min", "axis": -1}, [(2, 6)]), ("Broadcast", {"root": 0}, [(5,)]),
    ("AllToAll", {"axis": 1}, [(2, 6)]),
    ("LinearParallel", {}, [(3, 8), (5, 8), (5,)]),
    ("LinearParallel", {"type": "linear_reduce_scatter", "transpose_weight": False},
     [(4, 8), (8, 5)]),
    ("LinearParallel", {"type": "ALL_GATHER_LINEAR"}, [(2, 3, 8), (5, 8), (5,)]),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op,params,shapes", ONE_RANK)
def test_one_rank_without_a_group_is_the_local_case(op, params, shapes, dtype):
    """One process: the kernels equal the reference's one-rank case (AllGather adds
    the ranks dim, LinearParallel is a Linear)."""
    ins = [rand(s, dtype, i) for i, s in enumerate(shapes)]
    ref, = check_op(op, params, ins)
    if op == "AllGather" and "axis" not in params:
        np.testing.assert_array_equal(ref, ins[0][None])
    elif op == "LinearParallel":
        w = ins[1].astype(np.float64)
        w = w if params.get("transpose_weight", True) else w.T
        want = ins[0].astype(np.float64) @ w.T + (ins[2] if len(ins) > 2 else 0)
        atb.numerics.assert_close(ref, want, dtype)
    else:
        np.testing.assert_array_equal(ref, ins[0])


def test_new_ops_are_listed():
    names = atb.list_operations()
    for op in ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "AllToAll",
               "LinearParallel"):
        assert op in names


def test_collective_errors_name_op_expected_given():
    x = rand((3, 4))
    for op in ("AllGather", "ReduceScatter", "Broadcast", "AllToAll"):
        check_error(op, {"rank_size": 2}, [rand((4, 4))], atb.CapabilityError, "rank_size 2",
                    "world size 1")
        check_error(op, {"group": "nope"}, [rand((4, 4))], atb.ParamsError, "'nope'",
                    "register_group")
        check_error(op, {"group": 3}, [], atb.ParamsError, "group", build_error=True)
    check_error("AllGather", {"axis": 2}, [x], atb.ShapeError, "axis 2")
    check_error("ReduceScatter", {"op": "avg"}, [], atb.ParamsError, "op", build_error=True)
    check_error("Broadcast", {"root": 1}, [x], atb.CapabilityError, "root", "[0, 1)")
    check_error("Broadcast", {"root": -1}, [], atb.ParamsError, "root", build_error=True)
    check_error("LinearParallel", {"type": "pure_linear"}, [], atb.ParamsError, "type",
                build_error=True)
    check_error("LinearParallel", {}, [x, rand((5, 6))], atb.ShapeError, "in_features")
    check_error("LinearParallel", {"bias": True}, [x, rand((5, 4))], atb.InputError, "bias")
    check_error("LinearParallel", {"rank_size": 4}, [x, rand((5, 4))], atb.CapabilityError,
                "rank_size 4")


def test_backend_per_device_in_one_place():
    from atbcore.distributed import BACKEND_BY_DEVICE, backend_for_device

    assert BACKEND_BY_DEVICE == {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
    assert backend_for_device("cpu") == "gloo"
    with pytest.raises(atb.CapabilityError, match="tpu"):
        backend_for_device("tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(atb.CapabilityError, match="nccl.*no CUDA device"):
            backend_for_device("cuda:0")
