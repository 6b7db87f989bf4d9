"""quantize="w8" (weight-only int8 per output channel) and lower-precision compute:
logits cosine to the fp32 Hugging Face model, in prefill and in decode steps."""

import pytest
import torch
import torch.nn.functional as F

from atb_torch.models import compile
from tiny_models import assert_layouts, left_padded, tiny


def _cos(out, ref, mask):
    return float(F.cosine_similarity(out[mask.bool()].float(), ref[mask.bool()], dim=-1).min())


@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt2", "qwen3"])
def test_w8_logits_cosine(arch):
    m = tiny(arch)
    c = compile(m, quantize="w8")
    assert_layouts(c, "int8 32-output panels (w8)")
    ids, mask = left_padded([7, 12])
    with torch.no_grad():
        ref = m(ids, attention_mask=mask, use_cache=True)
        out = c(ids, attention_mask=mask, use_cache=True)
        assert _cos(out.logits, ref.logits, mask) >= 0.995
        assert not torch.equal(out.logits, ref.logits)  # really quantized
        tok = ref.logits[:, -1].argmax(-1, keepdim=True)
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        pos = (mask2.cumsum(-1) - 1)[:, -1:]
        r2 = m(tok, attention_mask=mask2, position_ids=pos, past_key_values=ref.past_key_values)
        o2 = c(tok, attention_mask=mask2, position_ids=pos, past_key_values=out.past_key_values)
        assert _cos(o2.logits, r2.logits, torch.ones(2, 1)) >= 0.995


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_compute_logits_cosine(dtype):
    m = tiny("llama")
    c = compile(m, dtype=dtype)
    assert c.atb_runner.dtype == dtype and c.atb_runner.new_cache(1, 4).torch_dtype == dtype
    ids, mask = left_padded([5, 9])
    with torch.no_grad():
        out = c(ids, attention_mask=mask).logits
        ref = m(ids, attention_mask=mask).logits
    assert out.dtype == dtype
    assert _cos(out, ref, mask) >= 0.999
    # the decode plan in half precision agrees with the general path
    g_plan = c.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    c1 = compile(m, dtype=dtype, opt_level=1)
    g_gen = c1.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert (g_plan == g_gen).float().mean() > 0.9  # half rounding may flip a late token
