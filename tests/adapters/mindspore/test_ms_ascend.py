"""MindSpore's Ascend branches (``ops.rms_norm``, ``ops.add_rms_norm``,
``ops.rotary_position_embedding``, ``ops.flash_attention_score``) through a conformance
double on CPU tensors standing for Ascend ones: each against the NumPy reference, the
double validating every argument, and each documented constraint sending the call to
the composed kernel with its reason."""

import numpy as np
import pytest

pytest.importorskip("mindspore", reason="mindspore is not installed")

from ascend_double import AscendOpsDouble, ContractViolation  # noqa: E402
from atbcore.backends.cpu_kernels.native_kernels import native_off  # noqa: E402
from ms_cases import check_ms, to_ms  # noqa: E402
from oracle import rand  # noqa: E402

from atb_mindspore._env import use_ascend_ops  # noqa: E402
from atb_mindspore.backend import common  # noqa: E402


@pytest.fixture
def ascend():
    with native_off(), use_ascend_ops(AscendOpsDouble()) as double:
        yield double


@pytest.mark.parametrize("dt", ["fp32", "fp16", "bf16"])
def test_norms_on_the_fused_ops(ascend, dt):
    x, r, w = rand([2, 5, 32], dt, 1), rand([2, 5, 32], dt, 2), rand([32], dt, 3)
    check_ms("RmsNorm", {"eps": 1e-6}, [x, w], path="Ascend fused")
    check_ms("AddRmsNorm", {"eps": 1e-5}, [x, r, w], path="Ascend fused")
    assert ascend.calls == ["rms_norm", "add_rms_norm"]
    check_ms("RmsNorm", {"weight_offset": 1.0}, [x, w], path="composed")


@pytest.mark.parametrize("dt", ["fp32", "fp16"])
@pytest.mark.parametrize("layout,rotary_type", [("BSND", "half"), ("BNSD", "interleave")])
def test_rope_on_the_fused_op(ascend, dt, layout, rotary_type):
    b, s, h, d = 2, 6, 4, 32
    shape = (b, s, h, d) if layout == "BSND" else (b, h, s, d)
    q, k = rand(shape, dt, 4), rand(shape, dt, 5)
    pos = np.array([4, 0, 9, 2, 7, 1], np.int64)  # one set of positions for the batch
    params = {"num_heads": h, "head_dim": d, "layout": layout, "rotary_type": rotary_type}
    check_ms("RoPE", params, [q, k, pos], path="Ascend fused")
    assert ascend.calls == ["rotary_position_embedding"] * 2


def test_rope_constraints_are_reasons(ascend):
    q = rand((2, 6, 4, 32), "bf16", 6)
    check_ms("RoPE", {"num_heads": 4, "layout": "BSND"}, [q, q, np.arange(6)], path="composed")
    assert "bf16" in common.PATHS["RoPE"][1]
    pos2 = np.stack([np.arange(6), np.arange(6) + 3])  # per-batch positions
    q16 = rand((2, 4, 6, 32), "fp16", 7)
    check_ms("RoPE", {"num_heads": 4, "layout": "BNSD", "rotary_type": "interleave"},
             [q16, q16, pos2], path="composed")
    assert "shared by the batch" in common.PATHS["RoPE"][1]
    assert ascend.calls == []


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout,sq,skv,causal", [("BNSD", 8, 8, True), ("BSH", 5, 12, True),
                                                  ("BNSD", 6, 9, False)])
def test_flash_attention_on_the_fused_op(ascend, dt, layout, sq, skv, causal):
    b, h, hk, d = 2, 4, 2, 16
    shape = (lambda s, n: (b, n, s, d)) if layout == "BNSD" else (lambda s, n: (b, s, n * d))
    ins = [rand(shape(sq, h), dt, 8), rand(shape(skv, hk), dt, 9), rand(shape(skv, hk), dt, 10)]
    check_ms("FlashAttention", {"num_heads": h, "num_kv_heads": hk, "causal": causal,
                                "layout": layout}, ins, path="Ascend fused")
    assert ascend.calls == ["flash_attention_score"]


def test_flash_attention_constraints_are_reasons(ascend):
    q, k = rand((1, 2, 9, 16), "fp16", 11), rand((1, 2, 4, 16), "fp16", 12)
    check_ms("FlashAttention", {"num_heads": 2, "causal": True}, [q, k, k], path="chunked")
    assert "Sq 9 > Skv 4" in common.PATHS["FlashAttention"][1]
    q32 = rand((1, 2, 4, 16), "fp32", 13)
    check_ms("FlashAttention", {"num_heads": 2}, [q32, q32, q32], path="chunked")
    assert "fp16/bf16" in common.PATHS["FlashAttention"][1]
    assert ascend.calls == []


def test_the_double_rejects_invalid_calls(ascend):
    x = to_ms(rand((2, 4, 6, 32), "fp16"))
    with pytest.raises(ContractViolation, match="dtype"):
        ascend.rotary_position_embedding(x, to_ms(rand((1, 1, 6, 32), "fp32")),
                                         to_ms(rand((1, 1, 6, 32), "fp32")))
    with pytest.raises(ContractViolation, match="compressed mask"):
        ascend.flash_attention_score(x, x, x, 4, attn_mask=to_ms(np.zeros((6, 6), np.uint8)),
                                     scalar_value=1.0, input_layout="BNSD", sparse_mode=3)
    with pytest.raises(ContractViolation, match="gamma"):
        ascend.rms_norm(x, to_ms(rand((16,), "fp16")))
    assert ascend.arange is not None  # everything else is mindspore.ops'
