"""The torch backend's NPU kernels, run through the torch_npu conformance double on CPU
tensors standing in for NPU ones: each against the op's NumPy reference (DESIGN.md
section 5 tolerances), each documented constraint turned into a reason, and the
double rejecting calls torch_npu documents as invalid."""

import numpy as np
import pytest
import torch

from atbcore.backends import get_backend
from atbcore.backends.npu import soc_family, unavailable_reason, use_npu_module
from atbcore.backends.torch.device_kernels import DEVICE_KERNELS
from atbcore.numerics import assert_close
from atbcore.ops.registry import get_op
from npu_double import ContractViolation, NpuDouble
from oracle import FLOATS, as_torch, rand

get_backend("torch").load()


@pytest.fixture
def npu():
    with use_npu_module(NpuDouble("A2")) as double:
        yield double


def _run(op, params, ins, out=None):
    opdef = get_op(op)
    p = opdef.make_params(params)
    tins = {n: None if x is None else as_torch(x) for n, x in ins.items()}
    dk = DEVICE_KERNELS[(op, "npu")]
    assert dk.why_not(p, tins) is None
    got = dk.fn(p, tins, out=out)
    ref = opdef.reference(p, {n: None if x is None else np.array(x, copy=True)
                              for n, x in ins.items()})
    return got, ref


def _why(op, params, ins):
    p = get_op(op).make_params(params)
    return DEVICE_KERNELS[(op, "npu")].why_not(p, {n: None if x is None else as_torch(x)
                                                   for n, x in ins.items()})


def test_the_double_is_not_torch_npu():
    import importlib.util

    assert importlib.util.find_spec("torch_npu") is None
    assert unavailable_reason() == "torch_npu is not installed"
    with use_npu_module(NpuDouble("310P")):
        assert unavailable_reason() is None and soc_family() == "310P"


@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm_and_add_rms_norm(npu, dtype):
    x, r, w = rand((3, 4, 64), dtype, 1), rand((3, 4, 64), dtype, 2), rand((64,), dtype, 3)
    offset = {"weight_offset": 1.0} if dtype == "fp32" else {}
    (y,), (ref,) = _run("RmsNorm", {"eps": 1e-5, **offset}, {"x": x, "weight": w})
    assert_close(y, ref, dtype, what="npu RmsNorm")
    (y, s), (ry, rs) = _run("AddRmsNorm", {"eps": 1e-6}, {"x": x, "residual": r, "weight": w})
    assert_close(s, rs, dtype, what="npu AddRmsNorm sum")
    assert_close(y, ry, dtype, what="npu AddRmsNorm")
    assert npu.calls == ["npu_rms_norm", "npu_add_rms_norm"]


def test_norm_reasons_follow_the_soc(npu):
    x, w = rand((2, 8), "bf16", 4), rand((8,), "bf16", 5)
    assert _why("RmsNorm", {}, {"x": x, "weight": w}) is None
    with use_npu_module(NpuDouble("310P")):
        assert "310P takes float16/float32; given bfloat16" in _why("RmsNorm", {}, {"x": x, "weight": w})
        x16, w16 = rand((2, 8), "fp16", 4), rand((8,), "fp16", 5)
        assert "32 bytes" in _why("RmsNorm", {}, {"x": x16, "weight": w16})
    assert "2-8 dims" in _why("RmsNorm", {}, {"x": rand((8,), "bf16"), "weight": w})
    assert "differs" in _why("RmsNorm", {}, {"x": x, "weight": rand((8,), "fp32")})
    assert "rounded" in _why("RmsNorm", {"weight_offset": 1.0}, {"x": x, "weight": w})


@pytest.mark.parametrize("dtype", FLOATS)
def test_swiglu(npu, dtype):
    x = rand((2, 3, 2 * 48), dtype, 6)
    (y,), (ref,) = _run("SwiGLU", {}, {"x": x})
    assert_close(y, ref, dtype, what="npu SwiGLU")
    assert "apart" in _why("SwiGLU", {}, {"x": x[..., :48], "up": x[..., 48:]})


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("rotary_type,layout", [("half", "BSH"), ("interleave", "BNSD")])
def test_rope(npu, dtype, rotary_type, layout):
    b, s, hq, hk, d = 2, 5, 4, 2, 32
    shape = (lambda h: (b, s, h * d)) if layout == "BSH" else (lambda h: (b, h, s, d))
    q, k = rand(shape(hq), dtype, 7), rand(shape(hk), dtype, 8)
    pos = np.array([3, 9, 1, 0, 40], np.int64)
    params = {"num_heads": hq, "num_kv_heads": hk, "head_dim": d, "rotary_type": rotary_type,
              "layout": layout}
    (qo, ko), (rq, rk) = _run("RoPE", params, {"q": q, "k": k, "position_ids": pos})
    assert_close(qo, rq, dtype, what="npu RoPE q")
    assert_close(ko, rk, dtype, what="npu RoPE k")
    assert npu.calls == ["npu_rotary_mul", "npu_rotary_mul"]


def test_rope_reasons(npu):
    q = rand((1, 2, 4 * 32), "fp16")
    assert "partial rotary" in _why("RoPE", {"num_heads": 4, "rotary_dim": 16}, {"q": q})
    assert "tolerance" in _why("RoPE", {"num_heads": 4}, {"q": rand((1, 2, 128), "bf16")})
    with use_npu_module(NpuDouble("310P")):
        assert "head_dim 128" in _why("RoPE", {"num_heads": 4}, {"q": q})
        assert _why("RoPE", {"num_heads": 1}, {"q": q}) is None


def test_the_double_rejects_what_torch_npu_documents_as_invalid(npu):
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ContractViolation, match="gamma shape"):
        npu.npu_rms_norm(x, torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ContractViolation, match="contiguous"):
        npu.npu_swiglu(torch.zeros(8, 4).t())
    with pytest.raises(ContractViolation, match="r1 dtype"):
        npu.npu_rotary_mul(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8, dtype=torch.half),
                           torch.zeros(1, 2, 1, 8))
    with pytest.raises(TypeError):  # keyword names are torch_npu's
        npu.npu_rms_norm(x, torch.zeros(8, dtype=torch.bfloat16), eps=1e-6)
    with use_npu_module(NpuDouble("310P")) as old:
        with pytest.raises(ContractViolation, match="not supported on 310P"):
            old.npu_add_rms_norm(x, x, torch.zeros(8, dtype=torch.bfloat16))


def test_dispatch_takes_npu_tensors_only_with_torch_npu_present():
    from atbcore.dtypes import Dtype
    from atbcore.tensor import TensorDesc

    torch_backend = get_backend("torch")
    opdef = get_op("RmsNorm")
    descs = {"x": TensorDesc((2, 8), Dtype.FP16, device="npu:0"),
             "weight": TensorDesc((8,), Dtype.FP16, device="npu:0")}
    p = opdef.make_params({})
    assert torch_backend.not_supported_reasons(opdef, p, descs) == ["torch_npu is not installed"]
    with use_npu_module(NpuDouble("A2")):
        assert torch_backend.not_supported_reasons(opdef, p, descs) == []
    cpu = {n: TensorDesc(d.shape, d.dtype) for n, d in descs.items()}
    assert torch_backend.not_supported_reasons(opdef, p, cpu) == []
