"""Bad input raises the same AtbError types through atb_mindspore as through the
core (and atb_torch): wrong dtypes, shapes, params, values and devices, from op
Cells and GraphOps in PyNative and GRAPH_MODE, with outputs left untouched."""

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="mindspore is not installed")

import atb_mindspore as atb  # noqa: E402
import atb_mindspore.bridge as bridge  # noqa: E402
from atbcore.tensor import describe, to_numpy, to_torch  # noqa: E402
from ms_cases import to_ms  # noqa: E402
from oracle import check_error, rand  # noqa: E402

F32, F16 = "fp32", "fp16"
CASES = [
    # (op, params, inputs, error type)
    ("RmsNorm", {}, [np.ones((2, 8), np.int32), rand([8], F32)], atb.DtypeError),
    ("RmsNorm", {}, [rand([2, 8], F32), rand([6], F32)], atb.ShapeError),
    ("Linear", {}, [rand([2, 8], F32), rand([4, 6], F32)], atb.ShapeError),
    ("Linear", {"quant": "w8"}, [rand([2, 8], F32), rand([4, 8], F32), rand([4], F32)], atb.DtypeError),
    ("FlashAttention", {"num_heads": 3}, [rand([1, 4, 8], F32)] * 3, atb.ShapeError),
    ("FlashAttention", {"num_heads": 2}, [rand([1, 4, 8], F32), rand([1, 4, 8], F16),
                                         rand([1, 4, 8], F16)], atb.DtypeError),
    ("RoPE", {"num_heads": 2}, [rand([1, 4, 8], F32), np.array([0, 1, 2, 9], np.int64),
                                rand([5, 4], F32), rand([5, 4], F32)], atb.InputError),
    ("Embedding", {}, [rand([5, 4], F32), np.array([7], np.int64)], atb.InputError),
    ("Gather", {}, [rand([5, 4], F32), rand([2], F32)], atb.DtypeError),
    ("Elewise", {"elewise_type": "add"}, [rand([2, 3], F32), rand([4], F32)], atb.ShapeError),
    ("Softmax", {"dim": 3}, [rand([2, 3], F32)], atb.ShapeError),
]
IDS = [f"{c[0]}-{c[3].__name__}" for c in CASES]


@pytest.mark.parametrize("op,params,inputs,exc", CASES, ids=IDS)
def test_same_error_types_as_the_core(op, params, inputs, exc):
    check_error(op, params, inputs, exc, backend="torch")           # the core via torch
    with pytest.raises(exc) as ei:                                    # op Cell, PyNative
        atb.ops.__dict__[op](**params)(*[to_ms(x) for x in inputs])
    assert op.lower() in str(ei.value).lower()
    with pytest.raises(exc):                                          # the core on MindSpore
        atb.Builder(backend="mindspore").build_operation(op, params).execute(
            [to_ms(x) for x in inputs])


@pytest.mark.parametrize("op,params,inputs,exc", CASES[:6], ids=IDS[:6])
def test_same_error_types_in_graph_mode(op, params, inputs, exc, graph_mode):
    with pytest.raises(exc):
        atb.ops.__dict__[op](**params)(*[to_ms(x) for x in inputs])


def test_bad_params_are_params_errors():
    with pytest.raises(atb.ParamsError):
        atb.ops.RmsNorm(eps=-1.0)
    with pytest.raises(atb.ParamsError):
        atb.ops.Softmax(bogus=1)
    with pytest.raises(atb.ParamsError):
        atb.GraphOp([atb.Linear(out_features=4)], fusion_config={"no_such_switch": True})


def test_failed_call_leaves_outputs_untouched():
    x, w = to_ms(rand([2, 8], F32, 1)), to_ms(rand([6], F32, 2))
    out = to_ms(np.full((2, 8), 7.0, np.float32))
    op = atb.Builder().build_operation("RmsNorm")
    with pytest.raises(atb.ShapeError):
        op.execute([x, w], [out])
    np.testing.assert_array_equal(to_numpy(out), 7.0)
    with pytest.raises(atb.DtypeError):
        op.execute([x, to_ms(rand([8], F32, 2))], [to_ms(np.zeros((2, 8), np.float16))])
    good = to_ms(np.zeros((2, 8), np.float32))
    op.execute([x, to_ms(rand([8], F32, 2))], [good])                 # written in place
    assert np.abs(to_numpy(good)).max() > 0


def test_graph_op_shape_and_dtype_errors_match_the_core(graph_mode):
    def layers():
        return [atb.RmsNorm(), atb.Linear(out_features=4)]

    from atbcore import GraphOp as CoreGraphOp
    import atbcore.graph.layers as core_layers

    core = CoreGraphOp([core_layers.RmsNorm(), core_layers.Linear(out_features=4)])
    core(rand([2, 8], F32, 1))
    with pytest.raises(atb.AtbError) as want:
        core(rand([2, 6], F32, 1))
    cell = atb.GraphOp(layers())
    graph_mode.set_context(mode=graph_mode.PYNATIVE_MODE)
    cell(to_ms(rand([2, 8], F32, 1)))
    with pytest.raises(type(want.value)):
        cell(to_ms(rand([2, 6], F32, 1)))                             # PyNative
    graph_mode.set_context(mode=graph_mode.GRAPH_MODE)
    with pytest.raises(type(want.value)):
        cell(to_ms(rand([2, 6], F32, 1)))                             # GRAPH_MODE
    with pytest.raises(atb.CapabilityError, match="bf16"):
        atb.ops.RmsNorm()(to_ms(rand([2, 8], "bf16")), to_ms(rand([8], "bf16")))


def test_tensor_on_an_unsupported_device(monkeypatch):
    """A MindSpore tensor on an Ascend NPU, in a process whose MindSpore runs on the
    CPU: no backend can take it (CapabilityError, as the core gives for a device no
    backend has); it never crosses into NumPy or torch (DeviceError)."""
    x, w = to_ms(rand([2, 8], F32, 1)), to_ms(rand([8], F32, 2))
    monkeypatch.setattr(bridge, "device_name", lambda t: "npu:0")
    assert describe(x).device == "npu:0"
    with pytest.raises(atb.CapabilityError, match="npu:0"):
        atb.ops.RmsNorm()(x, w)
    with pytest.raises(atb.DeviceError):
        to_numpy(x)
    torch = pytest.importorskip("torch")
    with pytest.raises(atb.DeviceError):
        to_torch(x)
    monkeypatch.undo()
    meta = torch.empty(2, 8, device="meta")
    with pytest.raises(atb.CapabilityError):
        atb.ops.RmsNorm()(meta, torch.empty(8, device="meta"))
