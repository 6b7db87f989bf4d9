"""Norm ops: torch kernels vs the NumPy reference, HF/torch oracles, bad input."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand

SHAPES = [(1, 1, 64), (2, 3, 769), (4, 4096)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(dtype, shape):
    x, w = rand(shape, dtype, 1), rand(shape[-1:], dtype, 2)
    check_op("RmsNorm", {"eps": 1e-6}, [x, w])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_matches_reference(dtype, shape):
    x, w, b = rand(shape, dtype, 1), rand(shape[-1:], dtype, 2), rand(shape[-1:], dtype, 3)
    check_op("LayerNorm", {"eps": 1e-5}, [x, w, b])
    check_op("LayerNorm", {"eps": 1e-5}, [x])  # no affine


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["AddRmsNorm", "AddLayerNorm"])
def test_add_norm_returns_norm_and_sum(dtype, op):
    x, r, w = rand((2, 5, 769), dtype, 1), rand((2, 5, 769), dtype, 2), rand((769,), dtype, 3)
    ref = check_op(op, {}, [x, r, w])
    np.testing.assert_array_equal(ref[1], (x.astype(np.float64) + r.astype(np.float64)).astype(x.dtype))


def test_rms_norm_vs_hf_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    m = LlamaRMSNorm(769, eps=1e-6)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 7, 769)
    y, = atb.Builder().build_operation("RmsNorm", {"eps": 1e-6}).execute([x, m.weight.detach()])
    atb.assert_close(y, m(x).detach(), "fp32", "RmsNorm vs LlamaRMSNorm")


def test_layer_norm_vs_torch_and_bert():
    from transformers.models.bert.modeling_bert import BertConfig, BertSelfOutput

    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(384, eps=1e-12)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    x = torch.randn(3, 11, 384)
    y, = atb.Builder().build_operation("LayerNorm", {"eps": 1e-12}).execute(
        [x, ln.weight.detach(), ln.bias.detach()])
    atb.assert_close(y, ln(x).detach(), "fp32", "LayerNorm vs nn.LayerNorm")
    # BERT's output block: LayerNorm(dense(h) + input) is AddLayerNorm of dense(h) and input.
    cfg = BertConfig(hidden_size=384, intermediate_size=1536, hidden_dropout_prob=0.0)
    blk = BertSelfOutput(cfg).eval()
    h, inp = torch.randn(3, 11, 384), torch.randn(3, 11, 384)
    dense = blk.dense(h).detach()
    out, s = atb.Builder().build_operation("AddLayerNorm", {"eps": cfg.layer_norm_eps}).execute(
        [dense, inp, blk.LayerNorm.weight.detach(), blk.LayerNorm.bias.detach()])
    atb.assert_close(out, blk(h, inp).detach(), "fp32", "AddLayerNorm vs BertSelfOutput")


def test_seed_style_params_and_outputs_list():
    """Seed 8.3: params by seed names; outputs given as TensorDescs are replaced."""
    x = torch.randn(4, 16, 768)
    w = torch.ones(768)
    op = atb.Builder().build_operation("RmsNorm", {"normalized_shape": 768, "eps": 1e-5,
                                                   "dtype": atb.Dtype.FP32})
    outputs = [atb.TensorDesc(shape=list(x.shape), dtype=atb.Dtype.FP32)]
    op.execute([x, w], outputs)
    atb.assert_close(outputs[0], torch.nn.functional.rms_norm(x, (768,), w, 1e-5), "fp32")


def test_writes_into_given_output():
    x, w = rand((2, 769), "fp32", 1), rand((769,), "fp32", 2)
    out = torch.zeros(2, 769)
    res = atb.Builder().build_operation("RmsNorm").execute([torch.from_numpy(x), torch.from_numpy(w)],
                                                          [out])
    assert res[0] is out
    ref, = atb.Builder(backend="numpy").build_operation("RmsNorm").execute([x, w])
    atb.assert_close(out, ref, "fp32")


BAD = [
    # (op, params, inputs, error, fragments)
    ("RmsNorm", {}, [rand((2, 8)), rand((7,))], atb.ShapeError, ["weight", "[8]", "[7]"]),
    ("RmsNorm", {"hidden_size": 16}, [rand((2, 8)), rand((8,))], atb.ShapeError, ["[16]"]),
    ("RmsNorm", {}, [rand((2, 8)).astype(np.int32), rand((8,))], atb.DtypeError, ["INT32"]),
    ("RmsNorm", {"dtype": "fp16"}, [rand((2, 8)), rand((8,))], atb.DtypeError, ["FP16", "FP32"]),
    ("RmsNorm", {}, [rand((2, 8))], atb.InputError, ["number of inputs"]),
    ("AddRmsNorm", {}, [rand((2, 8)), rand((3, 8)), rand((8,))], atb.ShapeError, ["residual"]),
    ("AddLayerNorm", {}, [rand((2, 8)), rand((2, 8), "fp16"), rand((8,))], atb.DtypeError,
     ["residual"]),
    ("LayerNorm", {}, [rand((2, 8)), rand((8,)), rand((8,)), rand((8,))], atb.InputError,
     ["number of inputs"]),
]


@pytest.mark.parametrize("op,params,inputs,exc,frags", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(op, params, inputs, exc, frags):
    check_error(op, params, inputs, exc, *frags, outputs=[np.full((2, 8), 3.0, np.float32)])


def test_bad_params():
    check_error("RmsNorm", {"eps": -1}, [], atb.ParamsError, "eps", build_error=True)
    check_error("LayerNorm", {"epsilonn": 1}, [], atb.ParamsError, "epsilonn", build_error=True)
    check_error("NoSuchOp", {}, [], atb.ParamsError, "NoSuchOp", build_error=True)


def test_wrong_output_shape_leaves_output_untouched():
    check_error("RmsNorm", {}, [rand((2, 8)), rand((8,))], atb.ShapeError, "output",
                outputs=[np.full((2, 9), 3.0, np.float32)])
