"""How CUDA calls reach the Triton kernels: the torch backend's op kernels route by the
device of their inputs, each device kernel says why it cannot take a call, and a
refused call runs the torch kernel with the reason logged. The routing is exercised
on the CPU with a stand-in device kernel; the real CUDA path runs when a GPU exists."""

import logging

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.backends import get_backend
from atbcore.backends.base import Kernel
from atbcore.backends.torch.device_kernels import (DeviceKernel, _wrap, apply_device_kernels,
                                                   input_device)
from atbcore.backends.torch import triton_cuda as tc
from atbcore.numerics import assert_close
from atbcore.ops.registry import get_op
from oracle import as_torch, rand

get_backend("torch").load()


def test_cuda_kernels_are_registered_for_the_fused_ops():
    kernels = get_backend("torch").kernels
    for op in ("RmsNorm", "AddRmsNorm", "SwiGLU", "GeGLU", "RoPE", "RopeKVCache",
               "PagedAttention", "FlashAttention"):
        assert "cuda" in kernels[op].devices and "cuda: Triton" in kernels[op].impl, op
    apply_device_kernels(kernels)  # idempotent: a second load does not wrap twice
    assert kernels["RmsNorm"].impl.count("cuda: Triton") == 1


def test_routing_by_device_and_logged_fallback(caplog):
    calls = []
    base = Kernel(op="Probe", fn=lambda p, ins: ["base"], devices=("cpu", "cuda"))
    refuse = {"why": None}
    dk = DeviceKernel("Probe", "cpu", lambda p, ins, out=None: calls.append(out) or ["device"],
                      lambda p, ins: refuse["why"], "probe kernel", "probe")
    k = _wrap(base, {"cpu": dk})
    x = torch.zeros(2)
    assert k.fn(None, {"x": x}) == ["device"] and calls == [None]
    refuse["why"] = "head_dim 300 > 256"
    with caplog.at_level(logging.INFO, logger="atb"):
        assert k.fn(None, {"x": x}) == ["base"]
    assert "Probe: probe kernel skipped (head_dim 300 > 256) -> torch kernel" in caplog.text
    assert input_device({"a": None, "x": torch.zeros(1)}) == "cpu"


def _p(op, **kw):
    return get_op(op).make_params(kw)


def test_reasons_name_what_the_kernels_do_not_cover():
    q = torch.zeros(2, 4, 8)
    kc = torch.zeros(3, 4, 2, 8)
    ins = {"query": q, "key_cache": kc, "value_cache": kc,
           "block_tables": torch.zeros(1, 3, dtype=torch.int32),
           "context_lens": torch.ones(1, dtype=torch.int32),
           "q_seq_lens": torch.tensor([2], dtype=torch.int32)}
    assert tc.paged_reasons(_p("PagedAttention"), ins) is None  # the paged prefill kernel
    ins8 = {**ins, "key_cache": kc.to(torch.int8), "q_seq_lens": None,
            "block_tables": torch.zeros(2, 3, dtype=torch.int32),
            "context_lens": torch.ones(2, dtype=torch.int32)}
    assert "cache dtype int8" in tc.paged_reasons(_p("PagedAttention"), ins8)
    rope_ins = {"key_cache": torch.zeros(1, 4, 2, 8), "value_cache": torch.zeros(1, 4, 2, 8)}
    why = tc.rope_kv_cache_reasons(_p("RopeKVCache", rotary_type="gptj"), rope_ins)
    assert "'interleave'" in why
    assert tc.rope_kv_cache_reasons(_p("RopeKVCache"), rope_ins) is None
    strided = {"key_cache": torch.zeros(2, 4, 4, 8)[:, :, :2], "slot_mapping": torch.zeros(1)}
    strided["value_cache"] = strided["key_cache"]
    assert "non-contiguous" in tc.rope_kv_cache_reasons(_p("RopeKVCache"), strided)
    assert "without a weight" in tc.norm_reasons(_p("RmsNorm"), {"x": q, "weight": None})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_ops_on_cuda_tensors_run_the_triton_kernels(dtype, caplog):
    """The public ops on CUDA tensors: the Triton kernels against the NumPy reference."""
    x, r, w = rand((4, 256), dtype, 1), rand((4, 256), dtype, 2), rand((256,), dtype, 3)
    with caplog.at_level(logging.INFO, logger="atb"):
        y, s = atb.Builder().build_operation("AddRmsNorm", {"eps": 1e-6}).execute(
            [as_torch(t).cuda() for t in (x, r, w)])
    assert "triton kernel skipped" not in caplog.text
    ry, rs = get_op("AddRmsNorm").reference(_p("AddRmsNorm", eps=1e-6),
                                            {"x": x, "residual": r, "weight": w})
    assert_close(y.cpu(), ry, dtype, what="cuda AddRmsNorm")
    assert_close(s.cpu(), rs, dtype, what="cuda AddRmsNorm sum")
    b, h, hkv, d, nb, bs = 3, 8, 2, 128, 64, 16
    ins = [rand((b, h, d), dtype, 4), rand((nb, bs, hkv, d), dtype, 5),
           rand((nb, bs, hkv, d), dtype, 6),
           np.random.default_rng(7).permutation(nb)[:b * 20].reshape(b, 20).astype(np.int32),
           np.array([1, 170, 320], np.int32)]
    o, = atb.Builder().build_operation("PagedAttention", {}).execute(
        [as_torch(t).cuda() for t in ins])
    ref, = get_op("PagedAttention").reference(_p("PagedAttention"), dict(zip(
        ("query", "key_cache", "value_cache", "block_tables", "context_lens"), ins)))
    assert_close(o.cpu(), ref, dtype, what="cuda PagedAttention")
    q, k, v = (rand((2, 300, n * 128), dtype, 8 + i) for i, n in enumerate((8, 2, 2)))
    with caplog.at_level(logging.INFO, logger="atb"):
        o, = atb.Builder().build_operation("FlashAttention", {"num_heads": 8, "causal": True}) \
            .execute([as_torch(t).cuda() for t in (q, k, v)])
    assert "triton kernel skipped" not in caplog.text
    ref, = get_op("FlashAttention").reference(_p("FlashAttention", num_heads=8, causal=True),
                                              {"q": q, "k": k, "v": v})
    assert_close(o.cpu(), ref, dtype, what="cuda FlashAttention (Triton prefill)")
