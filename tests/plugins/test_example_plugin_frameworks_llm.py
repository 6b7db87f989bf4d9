"""The rope point in MindSpore's and Paddle's serving engine: with the example plugin
installed as a package (entry point group ``atb``), ``atb_mindspore.LLM`` and
``atb_paddle.LLM`` (the paged core decoder over the framework's tensors) give the
logits and the 32 greedy tokens of the Hugging Face model with the same rotation
written in by hand; a plan with no plugin loaded gives plain Hugging Face's."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "adapters" / "torch" / "llm"))

from llm_checkpoint import build_checkpoint  # noqa: E402

from atbcore.numerics import assert_close  # noqa: E402
from test_example_plugin import example  # noqa: E402,F401  (fixture)
from test_example_plugin_llama import STEPS, HandRotary, _hf_greedy, hand_apply_rotary  # noqa: E402

FRAMEWORKS = [f for f in ("mindspore", "paddle") if importlib.util.find_spec(f)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama-rope"), arch="llama")


def _hand_rotated(ckpt, ids, monkeypatch):
    """(prompt logits, STEPS greedy tokens) of plain HF and of HF with the example's
    rotation written in by hand."""
    import transformers.models.llama.modeling_llama as modeling
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).eval()
    plain, plain_tokens = _hf_greedy(hf, ids)
    c = hf.config
    monkeypatch.setattr(hf.model, "rotary_emb", HandRotary(c.hidden_size // c.num_attention_heads,
                                                           float(c.rope_parameters["rope_theta"])))
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", hand_apply_rotary)
    want, want_tokens = _hf_greedy(hf, ids)
    assert not torch.equal(plain_tokens, want_tokens)  # the hand rotation is another model
    return (plain[0][0].numpy(), plain_tokens[0].tolist()), (want[0][0].numpy(),
                                                             want_tokens[0].tolist())


def _prompt_logits(llm, prompt: list[int]) -> np.ndarray:
    """Every prompt token's logits from the LLM's paged decoder (a sequence of its own,
    freed after)."""
    cache = llm.cache
    model = getattr(llm, "model", None) or llm.engine.model  # atb_torch.LLM: its engine's
    cache.add_sequence(10_000, token_ids=prompt)
    try:
        batch = cache.batch_for([10_000], [0], [0])
        return model.forward_paged(prompt, batch, cache, all_logits=True)
    finally:
        cache.free_sequence(10_000)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_rope_plugin_changes_the_framework_llm_as_the_rotation_written_into_hf(
        fw, ckpt, example, monkeypatch):  # noqa: F811
    from atbcore.plugin import get_plugin_manager

    front = importlib.import_module(f"atb_{fw}")
    ids = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(7))
    prompt = ids[0].tolist()
    _, (want_logits, want_tokens) = _hand_rotated(ckpt, ids, monkeypatch)
    assert get_plugin_manager().records["atb_example"].status == "loaded"
    llm = front.LLM(ckpt, block_size=8, num_blocks=16, enable_prefix_caching=False)
    try:
        assert_close(_prompt_logits(llm, prompt), want_logits, "fp32",
                     what=f"{fw} LLM prompt logits")
        out = llm.generate_outputs([prompt], max_new_tokens=STEPS, ignore_eos=True)[0]
    finally:
        llm.close()
    assert out.token_ids == want_tokens


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_without_the_plugin_the_framework_llm_is_plain_hugging_face(fw, ckpt, monkeypatch):
    front = importlib.import_module(f"atb_{fw}")
    ids = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(7))
    prompt = ids[0].tolist()
    (plain_logits, plain_tokens), _ = _hand_rotated(ckpt, ids, monkeypatch)
    llm = front.LLM(ckpt, block_size=8, num_blocks=16, enable_prefix_caching=False)
    try:
        assert_close(_prompt_logits(llm, prompt), plain_logits, "fp32",
                     what=f"{fw} LLM prompt logits, no plugin")
        out = llm.generate_outputs([prompt], max_new_tokens=STEPS, ignore_eos=True)[0]
    finally:
        llm.close()
    assert out.token_ids == plain_tokens


class _HandSquareplus(torch.nn.Module):
    """The example's activation written into the HF model by hand."""

    def forward(self, x):
        return 0.5 * (x + torch.sqrt(x * x + 4.0))


@pytest.fixture(scope="module")
def squareplus_ckpt(ckpt, tmp_path_factory):
    """The tiny checkpoint with ``hidden_act: squareplus`` in its config (the weights
    and tokenizer are the same files)."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("tiny-llama-squareplus")
    for f in Path(ckpt).iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["hidden_act"] = "squareplus"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _hand_squareplus(hf, ids, monkeypatch):
    """(prompt logits, greedy tokens) of ``hf`` with squareplus written into every MLP by
    hand (checked to differ from its own)."""
    _, plain_tokens = _hf_greedy(hf, ids)
    for layer in hf.model.layers:
        monkeypatch.setattr(layer.mlp, "act_fn", _HandSquareplus())
    want, want_tokens = _hf_greedy(hf, ids)
    assert not torch.equal(plain_tokens, want_tokens)  # squareplus is another model
    return want, want_tokens


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_activation_plugin_in_the_framework_llm_as_written_into_hf(
        fw, ckpt, squareplus_ckpt, example, monkeypatch):  # noqa: F811
    """A checkpoint naming the example's ``squareplus`` as its MLP activation (which
    transformers itself cannot load): MindSpore's and Paddle's ``LLM`` (the plugin's
    ``atb_activation`` hook alone provides it) give the prompt logits and greedy tokens
    of the HF model with squareplus written into every MLP by hand."""
    from transformers import AutoModelForCausalLM

    _rope_off(monkeypatch)
    ids = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(11))
    hf = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).eval()
    want, want_tokens = _hand_squareplus(hf, ids, monkeypatch)
    front = importlib.import_module(f"atb_{fw}")
    llm = front.LLM(squareplus_ckpt, block_size=8, num_blocks=16, enable_prefix_caching=False)
    try:
        assert_close(_prompt_logits(llm, ids[0].tolist()), want[0][0].numpy(), "fp32",
                     what=f"{fw} LLM prompt logits, squareplus")
        out = llm.generate_outputs([ids[0].tolist()], max_new_tokens=STEPS, ignore_eos=True)[0]
    finally:
        llm.close()
    assert out.token_ids == want_tokens[0].tolist()


def test_activation_plugin_in_a_compiled_hf_model_as_written_into_hf(
        ckpt, example, monkeypatch):  # noqa: F811
    """The same in torch: an HF Llama whose config names ``squareplus`` (its MLPs given
    the hand-written one), compiled: prefill, decode steps through ``forward`` and
    ``generate`` equal the hand-written model's."""
    from transformers import AutoModelForCausalLM

    from atb_torch.models import compile

    _rope_off(monkeypatch)
    ids = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(11))
    hf = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).eval()
    want, want_tokens = _hand_squareplus(hf, ids, monkeypatch)
    monkeypatch.setattr(hf.config, "hidden_act", "squareplus")
    fast = compile(hf)
    with torch.no_grad():
        out = fast(ids, use_cache=True)
        assert_close(out.logits, want[0], "fp32", what="compiled prefill, squareplus")
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        out = fast(tok, past_key_values=out.past_key_values, use_cache=True)
        assert_close(out.logits, want[1], "fp32", what="compiled decode step, squareplus")
    gen = fast.generate(ids, max_new_tokens=STEPS, do_sample=False)
    assert torch.equal(gen[:, ids.shape[1]:], want_tokens)


def _rope_off(monkeypatch):
    """The example's RoPE switched off (atb's built-in rotation runs): these tests are
    about its activation."""
    import atb_example_plugin as ex

    monkeypatch.setattr(ex, "_settings", ex.RopeSettings(enabled=False))
