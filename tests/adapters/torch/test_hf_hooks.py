"""The hooks into what users already call, against Hugging Face eager (the oracle) at
the fp32 tolerance: ``torch.compile(model, backend="atb")`` (atb's fused ops over the
FX graph) and ``attn_implementation="atb"`` (atb's FlashAttention inside HF's model)."""

import sys
from pathlib import Path

import pytest
import torch

from atbcore.numerics import assert_close

sys.path.insert(0, str(Path(__file__).parent / "models"))
from tiny_models import left_padded, tiny  # noqa: E402

import atb_torch.dynamo_backend as dynamo_backend  # noqa: E402  (registers backend "atb")
import atb_torch.models.hf_attention  # noqa: E402,F401  (registers attn_implementation "atb")

ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _real(x, mask):
    return x[mask.bool()]


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_compile_backend_atb_logits(arch):
    m = tiny(arch)
    m.set_attn_implementation("sdpa")
    counts = {}

    def backend(gm, example_inputs):  # the atb backend, counting what it rewrote
        counts.update(dynamo_backend.rewrite(gm))
        return gm.forward

    ids, mask = left_padded([5, 12, 9])
    with torch.no_grad():
        ref = m(ids, attention_mask=mask).logits
        out = torch.compile(m, backend=backend)(ids, attention_mask=mask).logits
    assert counts == {"rms_norm": 5, "swiglu": 2, "flash_attention": 2}, counts
    assert_close(_real(out, mask), _real(ref, mask), "fp32", f"{arch} backend=atb")


def test_torch_compile_backend_atb_decode_steps():
    """Prefill then decode over HF's DynamicCache (causal prefill, one-token steps),
    with the backend found by its name."""
    m = tiny("llama")
    m.set_attn_implementation("sdpa")
    c = torch.compile(m, backend="atb")
    ids, _ = left_padded([7], seed=4)
    with torch.no_grad():
        r, o = m(ids, use_cache=True), c(ids, use_cache=True)
        assert_close(o.logits, r.logits, "fp32", "prefill")
        for step in range(4):
            tok = r.logits[:, -1:].argmax(-1)
            r = m(tok, past_key_values=r.past_key_values)
            o = c(tok, past_key_values=o.past_key_values)
            assert_close(o.logits, r.logits, "fp32", f"decode step {step}")


@pytest.mark.parametrize("arch", ARCHS + ["gpt2"])
def test_attn_implementation_atb_logits_and_generate(arch):
    m = tiny(arch)
    ids, mask = left_padded([5, 12, 9], seed=2)
    with torch.no_grad():
        ref = m(ids, attention_mask=mask).logits
        ref_gen = m.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        m.set_attn_implementation("atb")
        assert m.config._attn_implementation == "atb"
        out = m(ids, attention_mask=mask).logits
        gen = m.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert_close(_real(out, mask), _real(ref, mask), "fp32", f"{arch} attn_implementation=atb")
    assert torch.equal(gen, ref_gen)


def test_attn_implementation_atb_refuses_attention_weights():
    from atbcore.errors import CapabilityError

    m = tiny("llama")
    m.set_attn_implementation("atb")
    ids, _ = left_padded([4])
    with pytest.raises(CapabilityError, match="output_attentions"):
        m(ids, output_attentions=True)


def test_torch_compile_backend_atb_with_inductor_for_the_rest():
    m = tiny("llama")
    m.set_attn_implementation("sdpa")
    ids, mask = left_padded([5, 12, 9])
    with torch.no_grad():
        ref = m(ids, attention_mask=mask).logits
        out = torch.compile(m, backend="atb", options={"inner": "inductor"})(
            ids, attention_mask=mask).logits
    assert_close(_real(out, mask), _real(ref, mask), "fp32", "backend=atb, inner inductor")


def test_torch_compile_backend_atb_refuses_unknown_options():
    from atbcore.errors import ParamsError

    m = tiny("llama")
    ids, _ = left_padded([4])
    with pytest.raises(Exception) as e:  # Dynamo wraps the backend's error
        torch.compile(m, backend="atb", options={"inner": "tvm"})(ids)
    assert isinstance(e.value, ParamsError) or "inner" in str(e.value)


def test_backend_atb_eager_graph_calls_kernels_directly(monkeypatch):
    """Run as traced, the graph calls atb's kernels without the custom-op dispatch:
    linears of a decode step go to the C matmul, the decode step's attention to the
    C decode attention; logits stay HF's."""
    from atbcore.backends.torch import attention as torch_attention

    m = tiny("llama")
    m.set_attn_implementation("sdpa")
    targets, decode = [], []
    real = torch_attention.decode_attention_bound

    def counting(*a, **k):
        decode.append(1)
        return real(*a, **k)
    monkeypatch.setattr(torch_attention, "decode_attention_bound", counting)

    def backend(gm, example_inputs):
        fn = dynamo_backend.atb_backend(gm, example_inputs)
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return fn

    c = torch.compile(m, backend=backend, dynamic=True)
    ids, _ = left_padded([6], seed=5)
    with torch.no_grad():
        r, o = m(ids, use_cache=True), c(ids, use_cache=True)
        for step in range(3):
            tok = r.logits[:, -1:].argmax(-1)
            r = m(tok, past_key_values=r.past_key_values)
            o = c(tok, past_key_values=o.past_key_values)
            assert_close(o.logits, r.logits, "fp32", f"decode step {step}")
    for fn in (dynamo_backend.eager_linear, dynamo_backend.eager_rms_norm,
               dynamo_backend.eager_swiglu, dynamo_backend.eager_flash_attention):
        assert fn in targets, fn.__name__
    assert torch.ops.atb.rms_norm.default not in targets
    assert decode, "the decode steps' attention did not run the C decode attention"


def test_eager_linear_few_rows_c_matmul_many_rows_torch():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    for rows in (1, 3, dynamo_backend.LINEAR_MAX_ROWS, 200):
        x = torch.randn(rows, 40, generator=g)
        with torch.no_grad():
            out = dynamo_backend.eager_linear(x, w, b)
        assert_close(out, torch.nn.functional.linear(x, w, b), "fp32", f"{rows} rows")


def test_eager_calls_keep_refusing_backward():
    """Where autograd records, the eager forms run the custom ops, whose backward
    raises (a direct kernel call would silently drop the gradient)."""
    from atbcore.errors import AtbError

    x = torch.randn(2, 16, requires_grad=True)
    w = torch.ones(16)
    y = dynamo_backend.eager_rms_norm(x, w, 1e-6)
    assert y.requires_grad
    with pytest.raises(AtbError):
        y.sum().backward()
    q = torch.randn(1, 4, 1, 8, requires_grad=True)
    k = torch.randn(1, 4, 5, 8)
    o = dynamo_backend.eager_flash_attention(q, k, k, None, None, 4, 4, 0.0, False, 0, "BNSD")
    assert o.requires_grad
    assert_close(o.detach(), torch.nn.functional.scaled_dot_product_attention(q.detach(), k, k),
                 "fp32", "attention with grad recorded")


def test_attn_implementation_atb_decode_steps_run_the_c_decode_attention(monkeypatch):
    import atb_torch.models.hf_attention as hf_attention

    calls = []
    real = hf_attention.decode_bnsd

    def counting(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(hf_attention, "decode_bnsd", counting)
    m = tiny("llama")
    ids, mask = left_padded([5, 9], seed=3)
    with torch.no_grad():
        ref = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        m.set_attn_implementation("atb")
        out = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    assert calls and all(calls), calls
