"""The Triton prefill attention through its registration (FlashAttention's "cuda"
device kernel), in Triton's interpreter on the CPU (or on a GPU when there is one),
against the NumPy reference and torch SDPA (a second oracle)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atbcore.backends import get_backend
from atbcore.backends.torch.device_kernels import DEVICE_KERNELS
from atbcore.numerics import assert_close
from atbcore.ops.registry import get_op
from oracle import FLOATS, as_torch, rand

get_backend("torch").load()
SHAPES = {"BSH": lambda b, s, n, d: (b, s, n * d), "BSND": lambda b, s, n, d: (b, s, n, d),
          "BNSD": lambda b, s, n, d: (b, n, s, d)}


def _run(params, ins, device):
    opdef = get_op("FlashAttention")
    p = opdef.make_params(params)
    tins = {n: None if x is None else as_torch(x).to(device) for n, x in ins.items()}
    dk = DEVICE_KERNELS[("FlashAttention", "cuda")]
    assert dk.why_not(p, tins) is None
    (o,) = dk.fn(p, tins)
    (ref,) = opdef.reference(p, {n: None if x is None else np.array(x, copy=True)
                                 for n, x in ins.items()})
    return o.cpu(), ref


def _sdpa(q, k, v, layout, h, hk, causal_br):
    """SDPA on [B, N, S, D] with a bottom-right causal mask (fp32)."""
    def bnsd(x, n):
        x = torch.from_numpy(np.asarray(x, np.float32))
        if layout == "BSH":
            x = x.unflatten(-1, (n, -1))
        return x if layout == "BNSD" else x.transpose(1, 2)
    q4, k4, v4 = bnsd(q, h), bnsd(k, hk), bnsd(v, hk)
    sq, skv = q4.shape[2], k4.shape[2]
    m = None
    if causal_br:
        m = torch.arange(skv)[None] <= torch.arange(sq)[:, None] + max(skv - sq, 0)
    o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=m, enable_gqa=True)
    if layout == "BNSD":
        return o
    o = o.transpose(1, 2)
    return o.flatten(-2) if layout == "BSH" else o


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout,sq,skv,causal", [("BSH", 37, 37, True), ("BSND", 9, 70, True),
                                                  ("BNSD", 20, 33, False)])
def test_prefill_attention_gqa(device, dtype, layout, sq, skv, causal):
    b, h, hk, d = 2, 4, 2, 24  # head_dim 24: padded to 32 inside
    ins = {"q": rand(SHAPES[layout](b, sq, h, d), dtype, 1),
           "k": rand(SHAPES[layout](b, skv, hk, d), dtype, 2),
           "v": rand(SHAPES[layout](b, skv, hk, d), dtype, 3)}
    o, ref = _run({"num_heads": h, "num_kv_heads": hk, "layout": layout, "causal": causal},
                  ins, device)
    assert_close(o, ref, dtype, what=f"triton prefill {layout} vs numpy")
    sd = _sdpa(ins["q"], ins["k"], ins["v"], layout, h, hk, causal)
    assert_close(o, sd.to(o.dtype), dtype, what=f"triton prefill {layout} vs SDPA")


@pytest.mark.parametrize("extra", [{"window": 5}, {"seq_lens": [40, 3]},
                                   {"window": 7, "seq_lens": [11, 40]}])
def test_prefill_attention_window_and_seq_lens(device, extra):
    b, s, h, d = 2, 40, 2, 16
    ins = {"q": rand((b, s, h * d), "fp16", 4), "k": rand((b, s, h * d), "fp16", 5),
           "v": rand((b, s, h * d), "fp16", 6)}
    params = {"num_heads": h, "causal": True}
    if "window" in extra:
        params["window"] = extra["window"]
    if "seq_lens" in extra:
        ins["seq_lens"] = np.array(extra["seq_lens"], np.int32)
    o, ref = _run(params, ins, device)
    assert_close(o, ref, "fp16", what=f"triton prefill {extra}")


def test_prefill_packed_qkv_and_reasons(device):
    b, s, h, d = 1, 12, 2, 16
    qkv = rand((b, s, 3 * h * d), "bf16", 7)
    o, ref = _run({"num_heads": h, "causal": True}, {"q": qkv, "k": None, "v": None}, device)
    assert_close(o, ref, "bf16", what="triton prefill packed qkv")
    dk, opdef = DEVICE_KERNELS[("FlashAttention", "cuda")], get_op("FlashAttention")
    q = as_torch(rand((1, 4, 32), "fp16"))
    mask = torch.ones(4, 4, dtype=torch.bool)
    assert "explicit mask" in dk.why_not(opdef.make_params({"num_heads": 2}),
                                         {"q": q, "k": q, "v": q, "mask": mask})
    big = as_torch(rand((1, 2, 300), "fp16"))
    assert "head_dim 300 > 256" in dk.why_not(opdef.make_params({"num_heads": 1}),
                                              {"q": big, "k": big, "v": big})
