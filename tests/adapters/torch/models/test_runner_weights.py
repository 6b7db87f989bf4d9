"""The weights a runner's C matmul streams: on huge pages (the model's own parameter
moved in place, or the panels), packed in 32-output panels unless ATB_PANELS=0, each
layout giving HF's logits."""

import pytest
import torch

from atbcore.numerics import assert_close
from atb_torch.models import ModelRunner
from tiny_models import left_padded, tiny


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


@pytest.mark.parametrize("panels", ["1", "0"])
def test_decode_weights_on_hugepages_shared_with_the_model(panels, monkeypatch):
    """The weights the C matmul streams sit on huge pages: the fp32 panels, or with
    ATB_PANELS=0 the [out, in] rows, where a single model parameter moves itself (one
    copy in memory); the model's own forward is unchanged either way."""
    from atbcore.memory import hugepages

    monkeypatch.setenv("ATB_PANELS", panels)
    m = tiny("llama", vocab_size=16384)  # a 4 MiB LM head
    ids = torch.randint(3, 16384, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = m(ids).logits
    param = m.lm_head.weight.data_ptr()
    r = ModelRunner.from_hf(m, opt_level=2)
    head = r.lm_head.w
    assert (r.lm_head.panels is None) == (panels == "0" or not r.lm_head.rows)
    streamed = head if r.lm_head.panels is None else r.lm_head.panels
    # the runner holds the panels alone (the parameter stays the model's, unmoved)
    # or the parameter itself, moved in place
    if r.lm_head.panels is not None:
        assert head.is_meta and m.lm_head.weight.data_ptr() == param
    else:
        assert head.data_ptr() == m.lm_head.weight.data_ptr()
    if hugepages.available() is None and r.lm_head.rows:
        if panels == "0":  # moved alone: aligned (panels share the runner's arena)
            assert streamed.data_ptr() % hugepages.HUGE == 0
        assert hugepages.on_hugepages(streamed) >= hugepages.HUGE
    with torch.no_grad():
        assert torch.equal(m(ids).logits, before)
    c = r.new_cache(1, 16)
    assert_close(r.prefill(ids, c), before[:, -1], "fp32", "runner after the move")
    if r.lm_head.panels is None:
        r2 = ModelRunner.from_hf(m, opt_level=2)  # a second compile finds it there: no copy
        assert r2.lm_head.w.data_ptr() == head.data_ptr() == m.lm_head.weight.data_ptr()
    # tied embeddings: the embedding table follows the head (no stale second copy)
    t = tiny("llama", vocab_size=16384, tie_word_embeddings=True)
    rt = ModelRunner.from_hf(t, opt_level=2)
    assert rt.embed_w.data_ptr() == t.model.embed_tokens.weight.data_ptr() == \
        t.lm_head.weight.data_ptr()
    if rt.lm_head.panels is None:
        assert rt.lm_head.w.data_ptr() == rt.embed_w.data_ptr()
    ids_t = torch.randint(3, 16384, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_close(rt.prefill(ids_t, rt.new_cache(1, 8)), t(ids_t).logits[:, -1], "fp32",
                     "tied head")


def test_decode_weights_in_panels_unless_disabled(llama, monkeypatch):
    """Decode Linears carry a panel-packed copy the C matmul streams (shown by
    explain()'s kernel names); with ATB_PANELS=0 they run on the [out, in] rows, and
    both prefill and decode HF's logits. bf16 and int8 weights are packed too."""
    from atbcore.backends.cpu_kernels import available

    packed = ModelRunner.from_hf(llama, opt_level=2)
    monkeypatch.setenv("ATB_PANELS", "0")
    plain = ModelRunner.from_hf(llama, opt_level=2)
    monkeypatch.delenv("ATB_PANELS")
    lins = [packed.lm_head] + [getattr(b, n) for b in packed.blocks for n in ("qkv", "o", "down")]
    if available():
        assert all(lin.panels is not None and "panels" in lin.kernel for lin in lins)
        assert packed.lm_head.panels.shape == (256 // 32, 64, 32)
    assert plain.lm_head.panels is None and "panels" not in plain.lm_head.kernel
    half = ModelRunner.from_hf(tiny("llama").to(torch.bfloat16), opt_level=2)
    w8 = ModelRunner.from_hf(llama, opt_level=2, quantize="w8")
    if available():  # panels keep the weights' dtype; w8 ones replace the int8 rows
        assert half.lm_head.panels.dtype == torch.bfloat16
        assert w8.blocks[0].qkv.panels.dtype == torch.int8 and w8.blocks[0].qkv.w.is_meta
    long, long_mask = left_padded([40, 33], seed=5)  # 80 rows: the prefill GEMMs on panels
    with torch.no_grad():
        ref = llama(long, attention_mask=long_mask).logits
    for r in (packed, plain):
        got = r.forward(long, r.new_cache(2, 48), attention_mask=long_mask)
        assert_close(got[long_mask.bool()], ref[long_mask.bool()], "fp32", "prefill vs HF")
    ids, mask = left_padded([4, 9], seed=8)
    ca, cb = packed.new_cache(2, 32), plain.new_cache(2, 32)
    la = packed.prefill(ids, ca, attention_mask=mask)
    lb = plain.prefill(ids, cb, attention_mask=mask)
    seq = ids
    for step in range(5):
        tok = lb.argmax(-1)
        seq, mask = torch.cat([seq, tok[:, None]], 1), torch.cat([mask, mask[:, -1:]], 1)
        la, lb = packed.decode(tok, ca).clone(), plain.decode(tok, cb).clone()
        with torch.no_grad():
            ref = llama(seq, attention_mask=mask).logits[:, -1]
        assert_close(la, ref, "fp32", f"panels step {step} vs HF")
        assert_close(lb, ref, "fp32", f"rows step {step} vs HF")


def test_explain_names_each_linear_kernel_and_layout(llama, monkeypatch):
    """``runner.explain()`` says per Linear what runs for few and many rows, with the
    weight layout, and the bytes a decode step reads."""
    from atbcore.backends.cpu_kernels import available

    r = ModelRunner.from_hf(llama, opt_level=2)
    text = r.explain()
    lines = {ln.split()[0]: ln for ln in text.splitlines()[1:]}
    assert text.startswith("llama: 2 layers, float32, opt_level 2, quantize none, cpu")
    for name, shape in (("qkv", "[128 x 64]"), ("o", "[64 x 64]"), ("gate_up", "[256 x 64]"),
                        ("down", "[64 x 128]"), ("lm_head", "[256 x 64]")):
        lin = r.lm_head if name == "lm_head" else getattr(r.blocks[0], name)
        assert shape in lines[name] and lines[name].endswith(lin.kernel)
        if available():
            assert "32-output panels" in lines[name] and "C panel GEMM" in lines[name]
    mib = r.weight_bytes / 2**20
    assert f"weights read per decode step: {mib:.1f} MiB" in text
    monkeypatch.setenv("ATB_PANELS", "0")
    plain = ModelRunner.from_hf(llama, opt_level=2).explain()
    assert "panels" not in plain and "torch F.linear on [out, in]" in plain
    assert "F.linear" in ModelRunner.from_hf(llama, opt_level=0).explain()
