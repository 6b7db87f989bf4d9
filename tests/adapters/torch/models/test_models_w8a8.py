"""quantize="w8a8" (int8 activations quantized per row x int8 weights, the C VNNI
matmul at every row count): logits cosine to the fp32 Hugging Face model in prefill
and decode, the plan's generate, and the encoder fast path's embeddings."""

import pytest
import torch
import torch.nn.functional as F

from atb_torch.models import compile
from atbcore.backends.cpu_kernels import available
from tiny_models import assert_layouts, left_padded, tiny

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


def _cos(out, ref, mask):
    return float(F.cosine_similarity(out[mask.bool()].float(), ref[mask.bool()], dim=-1).min())


@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt2", "qwen3"])
def test_w8a8_logits_cosine(arch):
    m = tiny(arch)
    c = compile(m, quantize="w8a8")
    assert_layouts(c, "w8a8 VNNI panels")
    ids, mask = left_padded([7, 12])
    with torch.no_grad():
        ref = m(ids, attention_mask=mask, use_cache=True)
        out = c(ids, attention_mask=mask, use_cache=True)
        assert _cos(out.logits, ref.logits, mask) >= 0.99
        assert not torch.equal(out.logits, ref.logits)  # really quantized
        tok = ref.logits[:, -1].argmax(-1, keepdim=True)
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        pos = (mask2.cumsum(-1) - 1)[:, -1:]
        r2 = m(tok, attention_mask=mask2, position_ids=pos, past_key_values=ref.past_key_values)
        o2 = c(tok, attention_mask=mask2, position_ids=pos, past_key_values=out.past_key_values)
        assert _cos(o2.logits, r2.logits, torch.ones(2, 1)) >= 0.99


def test_w8a8_generate_and_bf16():
    m = tiny("llama")
    ids, mask = left_padded([5, 9])
    for dtype in (torch.float32, torch.bfloat16):
        c = compile(m, quantize="w8a8", dtype=dtype)
        with torch.no_grad():
            out = c(ids, attention_mask=mask).logits
            ref = m(ids, attention_mask=mask).logits
        assert out.dtype == dtype
        assert _cos(out, ref, mask) >= 0.99
        g = c.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert g.shape == (2, ids.shape[1] + 6)


def test_w8a8_bad_quantize_named():
    from atbcore.errors import ParamsError

    with pytest.raises(ParamsError, match="w8a8"):
        compile(tiny("llama"), quantize="w4a4")


@pytest.mark.parametrize("heavy_padding", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_encoder(dtype, heavy_padding):
    """BERT under w8a8 on the core engine (Linear quant="w8a8": the C w8a8 matmul on
    VNNI panels, residual adds inside): close to HF fp32 and to the unfused plan
    (opt_level 0: the same quantized matmuls, adds and activations as their own
    nodes)."""
    bert = tiny("bert")
    c = compile(bert, quantize="w8a8", dtype=dtype)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (4, 16), generator=g)
    tt = torch.randint(0, 2, (4, 16), generator=g)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, (4 if heavy_padding else 14):] = 0
    mask[3, (2 if heavy_padding else 13):] = 0
    with torch.no_grad():
        out = c(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        ref = bert(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        plain = compile(bert, quantize="w8a8", dtype=dtype, opt_level=0)(
            ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    assert "w8a8 VNNI panels" in c.atb_runner.explain()
    assert out.dtype == dtype
    assert _cos(out, ref, mask) >= 0.99
    assert not torch.equal(out[mask.bool()].float(), ref[mask.bool()])  # really quantized
    assert _cos(out, plain, mask) >= (0.99999 if dtype == torch.float32 else 0.995)
