"""DLPack exchange: zero-copy proven by writing through one view and reading the
other; non-contiguous inputs handled and never misread; dtypes map both ways."""

import importlib.util

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.dtypes import Dtype
from atbcore.tensor import TensorDesc, convert, describe, framework_of, to_numpy, to_torch

HAS_MS = importlib.util.find_spec("mindspore") is not None
HAS_PADDLE = importlib.util.find_spec("paddle") is not None
needs_ms = pytest.mark.skipif(not HAS_MS, reason="mindspore not installed")
needs_paddle = pytest.mark.skipif(not HAS_PADDLE, reason="paddlepaddle not installed")


def test_dtype_coercion_round_trip():
    for d in (Dtype.FP32, Dtype.FP16, Dtype.BF16, Dtype.INT8, Dtype.INT32, Dtype.INT64, Dtype.BOOL):
        assert Dtype.of(d.numpy) is d
        assert Dtype.of(d.torch) is d
        assert Dtype.of(d.name.lower()) is d
    assert Dtype.of("half") is Dtype.FP16 and Dtype.of("bf16") is Dtype.BF16
    with pytest.raises(ValueError):
        Dtype.of("float13")


def test_tensor_desc_value_semantics():
    a = TensorDesc(shape=[2, 3], dtype=atb.Dtype.FP16)
    assert a == TensorDesc((2, 3), "fp16") and hash(a) == hash(TensorDesc((2, 3), "fp16"))
    assert a.numel == 6 and a.nbytes == 12 and a.rank == 2
    assert describe(torch.zeros(4, 5, dtype=torch.bfloat16)) == TensorDesc((4, 5), Dtype.BF16)


def test_numpy_torch_zero_copy_both_ways():
    a = np.zeros((3, 4), np.float32)
    t = to_torch(a)
    t[1, 2] = 5.0
    assert a[1, 2] == 5.0
    t2 = torch.zeros(2, 2)
    b = to_numpy(t2)
    b[0, 1] = 7.0
    assert t2[0, 1].item() == 7.0


def test_bf16_zero_copy_through_ml_dtypes():
    t = torch.zeros(4, dtype=torch.bfloat16)
    a = to_numpy(t)
    assert a.dtype == Dtype.BF16.numpy
    a[2] = 1.5
    assert t[2].item() == 1.5
    back = to_torch(a)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()


@needs_paddle
def test_paddle_zero_copy_both_ways():
    import paddle

    p = paddle.zeros([2, 3], dtype="float32")
    t = to_torch(p)
    t[0, 0] = 3.0
    assert float(p.numpy()[0, 0]) == 3.0
    t2 = torch.zeros(2, 3)
    p2 = convert(t2, "paddle")
    assert framework_of(p2) == "paddle"
    t2[1, 1] = 9.0
    assert float(p2.numpy()[1, 1]) == 9.0


@needs_ms
def test_mindspore_zero_copy_both_ways():
    import mindspore

    m = mindspore.Tensor(np.zeros((2, 3), np.float32))
    t = to_torch(m)
    t[0, 2] = 4.0
    assert float(m.asnumpy()[0, 2]) == 4.0
    t2 = torch.zeros(2, 3)
    m2 = convert(t2, "mindspore")
    assert framework_of(m2) == "mindspore"
    t2[1, 0] = 6.0
    assert float(m2.asnumpy()[1, 0]) == 6.0


def test_non_contiguous_inputs_are_read_correctly():
    op = atb.Builder().build_operation("RmsNorm", {"eps": 1e-6})
    base = torch.randn(16, 8)
    x = base.t()  # [8, 16], strides (1, 8)
    assert not x.is_contiguous()
    w = torch.randn(16)
    y, = op.execute([x, w])
    ref, = atb.Builder(backend="numpy").build_operation("RmsNorm", {"eps": 1e-6}).execute(
        [np.ascontiguousarray(x.numpy()), w.numpy()])
    atb.assert_close(y, ref, "fp32")
    # numpy negative strides cannot alias into torch: copied, never misread
    xn = np.ascontiguousarray(x.numpy())[::-1]
    y2, = op.execute([xn, w.numpy()])
    ref2, = atb.Builder(backend="numpy").build_operation("RmsNorm", {"eps": 1e-6}).execute(
        [xn.copy(), w.numpy()])
    atb.assert_close(y2, ref2, "fp32")
    assert isinstance(y2, np.ndarray)


@needs_paddle
@needs_ms
@pytest.mark.parametrize("fw", ["numpy", "paddle", "mindspore"])
def test_ops_return_tensors_of_the_input_framework(fw):
    x, w = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32), np.ones(8, np.float32)
    xs, ws = convert(x, fw), convert(w, fw)
    y, = atb.Builder().build_operation("RmsNorm").execute([xs, ws])
    assert framework_of(y) == fw
    ref, = atb.Builder(backend="numpy").build_operation("RmsNorm").execute([x, w])
    atb.assert_close(to_numpy(y), ref, "fp32")


def test_unsupported_tensor_type_is_a_clear_error():
    with pytest.raises(atb.InputError, match="RmsNorm.*list"):
        atb.Builder().build_operation("RmsNorm").execute([[1.0, 2.0], np.ones(2, np.float32)])


def test_descriptor_without_data_is_rejected_by_execute():
    op = atb.Builder().build_operation("RmsNorm")
    with pytest.raises(atb.InputError, match="no data"):
        op.execute([atb.TensorDesc([2, 8], atb.Dtype.FP32), np.ones(8, np.float32)])
    # but infer_shape takes descriptors
    assert op.infer_shape([atb.TensorDesc([2, 8]), atb.TensorDesc([8])]) == [atb.TensorDesc([2, 8])]
