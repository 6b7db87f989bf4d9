"""Acceptance of the rope point in a compiled model: the example plugin, installed
as a package (entry point group ``atb``), changes the logits of a Llama lowered to
a GraphOp (``lower_decoder``, the engine ``compile()`` is moving to) exactly as the
same rotation written into the Hugging Face model by hand does, for the prompt and
for 32 greedy decode steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters" / "torch" / "models"))

from tiny_models import VOCAB, tiny  # noqa: E402

from atbcore.memory import KVCache  # noqa: E402
from atbcore.numerics import assert_close  # noqa: E402
from test_example_plugin import example  # noqa: E402,F401,F811  (fixture)

STEPS = 32


class HandRotary(torch.nn.Module):
    """The example's rotation as Hugging Face cos/sin tables, by hand: the first
    half of each head turns in (2i, 2i+1) pairs by (pos / 2) * base^(-2i / rd);
    cos = 1, sin = 0 on the dims that pass through."""

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        self.d, self.base = head_dim, base

    def forward(self, x, position_ids):
        rd = self.d // 2
        inv = self.base ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
        ang = (position_ids.double() / 2.0)[..., None] * inv          # [B, S, rd/2]
        cos = torch.ones(*position_ids.shape, self.d, dtype=torch.float64)
        sin = torch.zeros_like(cos)
        for j in (0, 1):
            cos[..., j:rd:2], sin[..., j:rd:2] = ang.cos(), ang.sin()
        return cos.to(x.dtype), sin.to(x.dtype)


def hand_apply_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """Interleaved rotation: (e, o) -> (e cos - o sin, o cos + e sin)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def turn(x):
        out = torch.empty_like(x)
        out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
        return out

    return q * cos + turn(q) * sin, k * cos + turn(k) * sin


def _hf_greedy(hf, ids):
    """Prompt logits, then STEPS greedy steps with HF's own cache: (logits per step, tokens).
    The cache goes in under the name this transformers takes (``cache`` since 5.x's later
    releases, ``past_key_values`` before)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        logits, past = [out.logits], out.past_key_values
        toks = []
        for _ in range(STEPS):
            tok = logits[-1][:, -1].argmax(-1, keepdim=True)
            toks.append(tok)
            out = hf(tok, use_cache=True, **{name: past})
            logits.append(out.logits)
            past = out.past_key_values
    return logits, torch.cat(toks, 1)


def test_rope_plugin_changes_a_lowered_llama_as_the_rotation_written_into_hf(  # noqa: F811
        example, monkeypatch):
    import transformers.models.llama.modeling_llama as modeling
    from atb_torch.models.lower import lower_decoder

    from atbcore.plugin import get_plugin_manager

    hf = tiny("llama")
    assert get_plugin_manager().records["atb_example"].status == "loaded"
    op = lower_decoder(hf)  # the example's atb_rope hook is installed: every RoPE node asks it
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    plain, _ = _hf_greedy(hf, ids)

    c = hf.config
    head_dim = c.hidden_size // c.num_attention_heads
    base = float(c.rope_parameters["rope_theta"])
    monkeypatch.setattr(hf.model, "rotary_emb", HandRotary(head_dim, base))
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", hand_apply_rotary)
    want, want_tokens = _hf_greedy(hf, ids)
    assert (want[0] - plain[0]).abs().max() > 1e-3  # the hand rotation is a different model

    cache = KVCache(c.num_hidden_layers, 1, 64, c.num_key_value_heads, head_dim, dtype="fp32")
    with torch.no_grad():
        got, _ = op(ids, kv_cache=cache)
        assert_close(got, want[0], "fp32", what="prefill logits")
        tokens = []
        for step in range(STEPS):
            tok = got[:, -1].argmax(-1, keepdim=True)
            tokens.append(tok)
            got, _ = op(tok, kv_cache=cache)
            assert_close(got, want[step + 1], "fp32", what=f"decode step {step}")
    assert torch.equal(torch.cat(tokens, 1), want_tokens)


def test_rope_plugin_changes_a_compiled_llama_as_the_rotation_written_into_hf(  # noqa: F811
        example, monkeypatch):
    """The same acceptance through ``atb.compile``: its core engine asks the plugin's
    rope point as the GraphOp does (prefill, each decode step through ``forward``,
    and ``generate``'s own loop)."""
    import transformers.models.llama.modeling_llama as modeling
    from atb_torch.models import compile
    from atb_torch.models.core_runner import CoreRunner

    hf = tiny("llama")
    fast = compile(hf)
    assert isinstance(fast.atb_runner, CoreRunner)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    c = hf.config
    monkeypatch.setattr(hf.model, "rotary_emb", HandRotary(c.hidden_size // c.num_attention_heads,
                                                           float(c.rope_parameters["rope_theta"])))
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", hand_apply_rotary)
    want, want_tokens = _hf_greedy(hf, ids)
    with torch.no_grad():
        out = fast(ids, use_cache=True)
        assert_close(out.logits, want[0], "fp32", what="compiled prefill logits")
        pkv = out.past_key_values
        for step in range(STEPS):
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            out = fast(tok, past_key_values=pkv, use_cache=True)
            assert_close(out.logits, want[step + 1], "fp32", what=f"compiled decode step {step}")
            pkv = out.past_key_values
    gen = fast.generate(ids, max_new_tokens=STEPS, do_sample=False)
    assert torch.equal(gen[:, ids.shape[1]:], want_tokens)


def test_rope_plugin_changes_the_serving_engine_as_the_rotation_written_into_hf(  # noqa: F811
        example, monkeypatch):
    """``atb.LLM`` (the paged core decoder) asks the plugin's rope point too: its greedy
    tokens are those of the HF model with the rotation written in by hand."""
    import transformers.models.llama.modeling_llama as modeling
    from atb_torch.llm import LLM

    hf = tiny("llama")
    llm = LLM(hf, block_size=8, num_blocks=16)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    _, plain_tokens = _hf_greedy(hf, ids)
    c = hf.config
    monkeypatch.setattr(hf.model, "rotary_emb", HandRotary(c.hidden_size // c.num_attention_heads,
                                                           float(c.rope_parameters["rope_theta"])))
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", hand_apply_rotary)
    _, want_tokens = _hf_greedy(hf, ids)
    out = llm.generate_outputs([ids[0].tolist()], max_new_tokens=STEPS, ignore_eos=True)[0]
    llm.close()
    assert out.token_ids == want_tokens[0].tolist()
    assert not torch.equal(plain_tokens, want_tokens)  # the plugin made a difference
