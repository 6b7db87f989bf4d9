"""The weights compile()'s core plan streams: every Linear of a decoder (merged QKV,
o, gate|up and down, the LM head) in the C matmul's 32-output panels unless
ATB_PANELS=0, as ``layouts()`` and ``explain()`` say; w8 weights as int8 panels; each
layout giving Hugging Face's logits (the oracle) for a padded 80-row prefill and
decode steps."""

import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.numerics import assert_close
from atb_torch.models.core_runner import CoreRunner
from tiny_models import left_padded, tiny

LINEARS = ("l0.qkv", "l0.o", "l0.mlp", "l1.qkv", "l1.o", "l1.mlp", "lm_head")


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def _against_hf(model, r, tol="fp32"):
    long, long_mask = left_padded([40, 33], seed=5)  # 80 rows: the prefill GEMMs
    with torch.no_grad():
        ref = model(long, attention_mask=long_mask).logits
    got = r.forward(long, r.new_cache(2, 48), attention_mask=long_mask)
    assert_close(got[long_mask.bool()], ref[long_mask.bool()], tol, "prefill vs HF")
    ids, mask = left_padded([4, 9], seed=8)
    cache = r.new_cache(2, 32)
    logits, seq = r.prefill(ids, cache, attention_mask=mask), ids
    for step in range(4):
        tok = logits.argmax(-1)
        seq, mask = torch.cat([seq, tok[:, None]], 1), torch.cat([mask, mask[:, -1:]], 1)
        logits = r.decode(tok, cache).clone()
        with torch.no_grad():
            ref = model(seq, attention_mask=mask).logits[:, -1]
        assert_close(logits, ref, tol, f"decode step {step} vs HF")


def test_linears_in_panels_unless_disabled(llama, monkeypatch):
    packed = CoreRunner.from_hf(llama)
    _against_hf(llama, packed)
    lay = packed.layouts()
    assert set(LINEARS) <= set(lay)
    if available():
        assert all("32-output panels" in lay[n] for n in LINEARS), lay
        assert "weight gate_up_w: 32-output panels" in packed.explain()
    monkeypatch.setenv("ATB_PANELS", "0")  # read when a plan binds
    plain = CoreRunner.from_hf(llama)
    _against_hf(llama, plain)
    assert not any("panels" in v for v in plain.layouts().values())
    assert ": 32-output panels" not in plain.explain()  # no "weight ...: <layout>" line says it


def test_w8_weights_as_int8_panels(llama):
    r = CoreRunner.from_hf(llama, quantize="w8")
    cache = r.new_cache(1, 8)
    ids = torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = llama(ids).logits[:, -1]
    got = r.prefill(ids, cache)
    cos = torch.nn.functional.cosine_similarity(got, ref).min()
    assert cos > 0.999, float(cos)
    if available():
        lay = r.layouts()
        assert {"l0.qkv", "l0.o", "l1.qkv", "lm_head"} <= set(lay)  # the FFN: two w8 Linears
        assert len(lay) == 9 and all(v == "int8 32-output panels (w8)" for v in lay.values()), lay
