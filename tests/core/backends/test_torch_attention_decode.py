"""FlashAttention's torch kernel on a decode step (one query row over a cache): the
C decode attention serves it, in every layout, with GQA, boolean key masks,
``seq_lens`` and windows, against the float64 NumPy reference and torch's SDPA;
what it cannot take (per-head or additive masks) still runs, and gives the same."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atbcore.backends.cpu_kernels import available
from atbcore.backends.torch import attention as torch_attention
from atbcore.numerics import assert_close
from atbcore.ops.attention import ref_attention

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.fixture
def decode_calls(monkeypatch):
    """How many times the C decode attention ran."""
    calls = []
    real = torch_attention.decode_attention_bound

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(torch_attention, "decode_attention_bound", counting)
    return calls


def _run(q, k, v, mask=None, seq_lens=None, **params):
    import atb_torch.library  # noqa: F401  (registers torch.ops.atb.*)

    return torch.ops.atb.flash_attention(q, k, v, mask, seq_lens, **params)


def _layout(x, layout):  # [B, N, S, D] -> layout
    if layout == "BNSD":
        return x
    x = x.transpose(1, 2).contiguous()
    return x.reshape(x.shape[0], x.shape[1], -1) if layout == "BSH" else x


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH"])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,kv,skv,d", [(1, 8, 2, 129, 64), (3, 4, 4, 17, 32), (2, 6, 3, 1, 16)])
def test_one_query_row_runs_the_c_decode_attention(decode_calls, layout, dt, b, h, kv, skv, d):
    g = torch.Generator().manual_seed(b + h + skv + d)
    q = torch.randn(b, h, 1, d, generator=g).to(dt)
    k = torch.randn(b, kv, skv, d, generator=g).to(dt)
    v = torch.randn(b, kv, skv, d, generator=g).to(dt)
    out = _run(_layout(q, layout), _layout(k, layout), _layout(v, layout), num_heads=h,
               num_kv_heads=kv, scale=0.3, causal=True, layout=layout)
    assert decode_calls, "the C decode attention did not serve the call"
    assert out.dtype == dt and out.is_contiguous()
    ref = ref_attention(q.float().numpy(), k.float().numpy(), v.float().numpy(), scale=0.3,
                        causal=True)
    assert_close(out, _layout(torch.from_numpy(ref).float(), layout), NAMES[dt], layout)
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.3,
                                          enable_gqa=True)
    assert_close(out.float(), _layout(sdpa, layout), NAMES[dt], f"{layout} vs SDPA")


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 40), (1, 1, 1, 40), (1, 40), (1, 1, 40)])
def test_key_masks_seq_lens_and_windows(decode_calls, mask_shape):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 8, 1, 32), (2, 2, 40, 32),
                                                      (2, 2, 40, 32)))
    mask = torch.rand(mask_shape, generator=g) > 0.4
    mask[..., 3] = True
    lens = torch.tensor([40, 23])
    for kw in (dict(mask=mask), dict(seq_lens=lens), dict(mask=mask, seq_lens=lens, window=9),
               dict(window=5)):
        decode_calls.clear()
        out = _run(q, k, v, num_heads=8, num_kv_heads=2, scale=0.2, causal=True,
                   layout="BNSD", **kw)
        assert decode_calls, kw
        ref = ref_attention(q.numpy(), k.numpy(), v.numpy(), scale=0.2, causal=True,
                            window=kw.get("window"),
                            mask=None if "mask" not in kw else mask.numpy(),
                            kv_lens=None if "seq_lens" not in kw else lens.tolist())
        assert_close(out, ref.astype(np.float32), "fp32", str(sorted(kw)))


def test_fully_masked_row_gives_zeros(decode_calls):
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 16)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1] = False
    out = _run(q, k, v, mask, num_heads=4, scale=0.25, layout="BNSD")
    assert decode_calls
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], scale=0.25)
    assert_close(out[:1], ref, "fp32", "the unmasked row")


@pytest.mark.parametrize("kind", ["per-head", "additive"])
def test_masks_the_decode_kernel_does_not_take_still_run(decode_calls, kind):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 4, 1, 16), (2, 4, 12, 16),
                                                      (2, 4, 12, 16)))
    mask = torch.rand(2, 4, 1, 12, generator=g) > 0.3
    mask[..., 0] = True
    if kind == "additive":
        mask = torch.where(mask[:, :1], 0.0, -1e4)
    out = _run(q, k, v, mask, num_heads=4, scale=0.25, layout="BNSD")
    assert not decode_calls, "the C decode attention took a mask it cannot express"
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    assert_close(out, ref, "fp32", kind)


def test_decode_bnsd_refuses_what_it_cannot_serve():
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16)
    assert torch_attention.decode_bnsd(q, k, k, scale=0.25) is not None
    assert torch_attention.decode_bnsd(torch.randn(1, 4, 2, 16), k, k, scale=0.25) is None
    assert torch_attention.decode_bnsd(q, k, k, scale=0.25,
                                       mask=torch.zeros(1, 1, 1, 5)) is None   # additive
    assert torch_attention.decode_bnsd(q, k, k.double(), scale=0.25) is None
    assert torch_attention.decode_bnsd(q, torch.randn(1, 3, 5, 16), torch.randn(1, 3, 5, 16),
                                       scale=0.25) is None                     # 4 % 3 heads
