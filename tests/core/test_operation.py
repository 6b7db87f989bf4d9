"""Operation/Builder contract details: output lists, dynamic-shape ranges, misuse."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import rand


def test_fewer_outputs_than_the_op_has_writes_the_leading_ones():
    """Seed 8.8 passes one output to AddLayerNorm (which returns norm and sum)."""
    x, r, w, b = (torch.from_numpy(rand(s, "fp32", i)) for i, s in
                  enumerate([(2, 3, 16), (2, 3, 16), (16,), (16,)]))
    outputs = [atb.TensorDesc(shape=list(x.shape), dtype=atb.Dtype.FP32)]
    res = atb.Builder().build_operation("AddLayerNorm", {"hidden_size": 16, "eps": 1e-5}).execute(
        [x, r, w, b], outputs)
    assert res is outputs and len(outputs) == 1
    gold = torch.nn.functional.layer_norm(x + r, (16,), w, b, 1e-5)
    atb.assert_close(outputs[0], gold, "fp32")
    with pytest.raises(atb.InputError, match="number of outputs"):
        atb.Builder().build_operation("AddLayerNorm").execute([x, r, w, b], [None, None, None])


def test_builder_dynamic_shape_is_enforced():
    builder = atb.Builder()
    builder.set_dynamic_shape({"batch_size": (1, 4), "seq_len": (1, 8), "num_heads": 4})
    op = builder.build_operation("RmsNorm")
    w = np.ones(16, np.float32)
    op.execute([rand((2, 8, 16)), w])  # inside the ranges
    with pytest.raises(atb.ShapeError, match="seq_len"):
        op.execute([rand((2, 9, 16)), w])
    with pytest.raises(atb.ShapeError, match="batch_size"):
        op.execute([rand((5, 2, 16)), w])


def test_bare_tensor_instead_of_a_list_is_refused():
    op = atb.Builder().build_operation("RmsNorm")
    with pytest.raises(atb.InputError, match="list or tuple"):
        op.execute(torch.randn(2, 4))
    with pytest.raises(atb.InputError, match="outputs"):
        op.execute([torch.randn(2, 4), torch.ones(4)], torch.empty(2, 4))


def test_misuse_of_descriptors_and_params_raises_atb_errors():
    with pytest.raises(atb.DtypeError, match="float99"):
        atb.TensorDesc((2, 3), "float99")
    with pytest.raises(atb.ShapeError, match="-3"):
        atb.TensorDesc((2, -3))
    assert atb.TensorDesc((2, -1)).shape == (2, -1)
    with pytest.raises(atb.ParamsError, match="dict"):
        atb.Builder().build_operation("RmsNorm", [1, 2])
    assert atb.Tensor is atb.TensorDesc  # the seeds' atb.Tensor(shape=..., dtype=...)
    assert atb.Tensor(shape=[1, 2], dtype=atb.Dtype.FP16).dtype is atb.Dtype.FP16
