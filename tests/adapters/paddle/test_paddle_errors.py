"""Bad input through atb_paddle raises the same AtbError types as the core does for
the same call on torch tensors, names the op, and leaves given outputs untouched."""

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import atbcore as atb  # noqa: E402
from oracle import rand  # noqa: E402
from paddle_cases import to_paddle  # noqa: E402

import atb_paddle  # noqa: E402


def _raised(fn):
    with pytest.raises(atb.AtbError) as ei:
        fn()
    return ei.value


def _same(op, params, inputs, layer_call=None):
    """Core (torch tensors) and atb_paddle (Paddle tensors) raise the same type."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    core = _raised(lambda: atb.Builder().build_operation(op, params).execute(
        [torch.from_numpy(np.array(x, copy=True)) if x.dtype != atb.Dtype.BF16.numpy
         else atb.tensor.to_torch(np.array(x, copy=True)) for x in inputs]))
    pd = _raised(layer_call or (lambda: getattr(atb_paddle.ops, op)(**params)(
        *[to_paddle(x) for x in inputs])))
    assert type(pd) is type(core), (type(pd), type(core), str(pd))
    assert op.lower() in str(pd).lower(), str(pd)
    return pd


def test_wrong_dtype():
    x = rand((2, 8), "fp32", 1)
    e = _same("RmsNorm", {}, [x.astype(np.int32), rand((8,), "fp32", 2)])
    assert isinstance(e, atb.DtypeError)
    e = _same("Linear", {}, [x, rand((4, 8), "fp16", 3)])
    assert isinstance(e, atb.DtypeError)
    e = _same("FlashAttention", {"num_heads": 2}, [rand((1, 3, 8), "fp32", 1), rand((1, 3, 8), "bf16", 2),
                                                  rand((1, 3, 8), "bf16", 3)])
    assert isinstance(e, atb.DtypeError)


def test_wrong_shape():
    x = rand((2, 8), "fp32", 1)
    assert isinstance(_same("LayerNorm", {}, [x, rand((7,), "fp32", 2)]), atb.ShapeError)
    assert isinstance(_same("Linear", {}, [x, rand((4, 9), "fp32", 2)]), atb.ShapeError)
    assert isinstance(_same("FlashAttention", {"num_heads": 3},
                            [rand((1, 3, 8), "fp32", 1)] * 3), atb.ShapeError)


def test_ids_out_of_range_and_unknown_params():
    table, ids = rand((5, 4), "fp32", 1), np.array([0, 5], np.int64)
    assert isinstance(_same("Embedding", {}, [table, ids]), atb.InputError)
    with pytest.raises(atb.ParamsError, match="unknown parameter"):
        atb_paddle.ops.RmsNorm(epsilonn=1e-6)
    with pytest.raises(atb.ParamsError):
        atb_paddle.Linear(out_features=0)


def test_seed_layer_and_graph_op_shape_errors_match_core():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from atbcore.graph import layers as L
    from atbcore.graph.graph_op import GraphOp as CoreGraphOp

    core = CoreGraphOp([L.LayerNorm(eps=1e-5), L.Linear(out_features=16)])
    core(torch.zeros(2, 8))
    ce = _raised(lambda: core(torch.zeros(2, 12)))
    blk = atb_paddle.GraphOp([atb_paddle.LayerNorm(eps=1e-5), atb_paddle.Linear(out_features=16)])
    blk(paddle.zeros([2, 8]))
    pe = _raised(lambda: blk(paddle.zeros([2, 12])))
    assert type(pe) is type(ce)
    lin = atb_paddle.Linear(out_features=4, in_features=8)
    ce = _raised(lambda: CoreGraphOp([L.Linear(out_features=4, in_features=8)])(torch.zeros(2, 6)))
    assert type(_raised(lambda: lin(paddle.zeros([2, 6])))) is type(ce)


def test_tensor_on_an_unsupported_device(monkeypatch):
    """No backend serves the device: the core refuses a torch 'meta' tensor; a Paddle
    tensor on a place no backend has (simulated: this Paddle build is CPU-only, so the
    bridge is made to report 'xpu:0') gets the same error type, from a layer too."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    ce = _raised(lambda: atb.Builder().build_operation("RmsNorm").execute(
        [torch.zeros(2, 8, device="meta"), torch.zeros(8, device="meta")]))
    import atb_paddle.bridge as br

    monkeypatch.setattr(br, "device_of_place", lambda place: "xpu:0")
    x, w = paddle.zeros([2, 8]), paddle.ones([8])
    pe = _raised(lambda: atb_paddle.ops.RmsNorm()(x, w))
    assert type(pe) is type(ce) and "xpu:0" in str(pe)
    ge = _raised(lambda: atb_paddle.GraphOp([atb_paddle.RmsNorm(eps=1e-6)])(x))
    assert type(ge) is type(ce)


def test_failed_call_leaves_outputs_untouched():
    x, w = to_paddle(rand((2, 8), "fp32", 1)), to_paddle(rand((7,), "fp32", 2))
    out = paddle.full([2, 8], 5.0)
    with pytest.raises(atb.ShapeError):
        atb_paddle.ops.RmsNorm().execute([x, w], [out])
    np.testing.assert_array_equal(out.numpy(), np.full((2, 8), 5.0, np.float32))
    good = to_paddle(rand((8,), "fp32", 3))
    bad_out = paddle.full([2, 8], 5.0, dtype="float16")
    with pytest.raises(atb.DtypeError):
        atb_paddle.ops.RmsNorm().execute([x, good], [bad_out])
    assert float(bad_out.astype("float32").max()) == 5.0
    atb_paddle.ops.RmsNorm().execute([x, good], [out])      # a good call writes into it
    assert float(out.max()) != 5.0
