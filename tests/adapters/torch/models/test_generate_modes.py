"""Every ``generate`` mode of a compiled Llama / Qwen2 / GPT-2 gives Hugging Face's
tokens (the oracle: the same model's own ``generate``), on whichever transformers
release is installed (CI runs the newest and the oldest supported); the modes atb's
loop answers run over the decode plan, the others run Hugging Face's loop over the
compiled forward. Also: ``save_pretrained`` writes the original architecture, and
``pipeline("text-generation")`` takes a compiled model without complaint."""

import json
import logging

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers.testing_utils import CaptureLogger

from atb_torch.models import compile
from atb_torch.models.hf_model import AtbCausalLMMixin
from tiny_models import VOCAB, left_padded, tiny

ARCHS = ["llama", "qwen2", "gpt2"]

# (name, generate kwargs, runs atb's loop)
MODES = [
    ("greedy", dict(do_sample=False), True),
    ("sample_top_k_top_p", dict(do_sample=True, top_k=30, top_p=0.85, temperature=0.7), True),
    ("sample_min_p", dict(do_sample=True, min_p=0.05, temperature=1.3), True),
    ("sample_3_sequences", dict(do_sample=True, num_return_sequences=3), True),
    ("min_new_tokens", dict(do_sample=False, min_new_tokens=12, eos_token_id=None), True),
    ("repetition_penalty", dict(do_sample=False, repetition_penalty=1.4), True),
    ("no_repeat_ngram", dict(do_sample=False, no_repeat_ngram_size=2), True),
    ("bad_words", dict(do_sample=False, bad_words_ids=[[7], [9, 10]]), True),
    ("suppress_tokens", dict(do_sample=False, suppress_tokens=[3, 4, 5]), True),
    ("typical", dict(do_sample=True, typical_p=0.8), True),
    ("beams", dict(do_sample=False, num_beams=3), False),
    ("beam_sample", dict(do_sample=True, num_beams=2), False),
]


@pytest.fixture(scope="module")
def models():
    return {a: tiny(a) for a in ARCHS}


@pytest.fixture(scope="module")
def tokenizer():
    """A character tokenizer over the tiny models' 256 ids (id i is ``chr(33 + i)``),
    built in memory: stop strings and pipelines need a real one."""
    vocab = {chr(33 + i): i for i in range(VOCAB)}
    tok = Tokenizer(BPE(vocab, merges=[], unk_token="!"))
    tok.decoder = decoders.Fuse()  # characters join without spaces
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="!", pad_token="!",
                                      bos_token='"', eos_token="#")


def _both(ref_model, compiled, ids, seed=5, **kw):
    """(HF's tokens, atb's tokens, steps atb's own loop ran) with the same seed."""
    torch.manual_seed(seed)
    ref = ref_model.generate(ids, **kw)
    stats = compiled.atb_runner.stats
    steps = stats.get("loop_tokens", 0)
    torch.manual_seed(seed)
    out = compiled.generate(ids, **kw)
    return ref, out, stats.get("loop_tokens", 0) - steps


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name,kw,atb_loop", MODES, ids=[m[0] for m in MODES])
def test_mode_tokens_equal_hf(models, arch, name, kw, atb_loop):
    m = models[arch]
    c = compile(m)
    ids, mask = left_padded([5, 9], seed=3)
    ref, out, steps = _both(m, c, ids, attention_mask=mask, max_new_tokens=16, **kw)
    assert torch.equal(out, ref), f"{arch} {name}: tokens differ from HF generate"
    assert (steps > 0) == atb_loop, f"{arch} {name}: atb's loop ran {steps} steps"


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_follows_the_seed(models, arch):
    """Same seed, same tokens as HF; another seed, other tokens (the draw is real)."""
    m, c = models[arch], compile(models[arch])
    ids, mask = left_padded([6, 6], seed=8)
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=True, top_p=0.95)
    ref, out, _ = _both(m, c, ids, seed=11, **kw)
    assert torch.equal(out, ref)
    torch.manual_seed(12)
    assert not torch.equal(c.generate(ids, **kw), ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_stop_strings_with_tokenizer(models, tokenizer, arch):
    m, c = models[arch], compile(models[arch])
    ids, _ = left_padded([6], seed=9)
    free = m.generate(ids, max_new_tokens=20, do_sample=False)
    # stop on the text of the 4th and 5th generated tokens: both must stop right there
    stop = "".join(tokenizer.convert_ids_to_tokens(free[0, 9:11].tolist()))
    kw = dict(max_new_tokens=20, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    ref, out, steps = _both(m, c, ids, **kw)
    assert ref.shape[1] < free.shape[1], "the stop string did not stop HF"
    assert torch.equal(out, ref) and steps > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_and_pad_rows(models, arch):
    m, c = models[arch], compile(models[arch])
    ids, mask = left_padded([5, 9], seed=5)
    free = m.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    eos = int(free[0, ids.shape[1] + 2])  # row 0 stops early, row 1 goes on (padded)
    ref, out, steps = _both(m, c, ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                            eos_token_id=eos, pad_token_id=1)
    assert torch.equal(out, ref) and steps > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_states_and_attentions_fall_back_to_hf(models, arch, caplog):
    m, c = models[arch], compile(models[arch])
    ids, mask = left_padded([4, 7], seed=6)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False,
              return_dict_in_generate=True, output_hidden_states=True, output_attentions=True)
    with caplog.at_level(logging.DEBUG, logger="atb"):  # INFO once, DEBUG after
        ref, out = m.generate(ids, **kw), c.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.hidden_states) == len(ref.hidden_states) == 6
    for step_out, step_ref in zip(out.hidden_states + out.attentions,
                                  ref.hidden_states + ref.attentions):
        for a, b in zip(step_out, step_ref):
            torch.testing.assert_close(a, b)
    assert "the model's own forward" in caplog.text
    with torch.no_grad():  # forward alone, over a cache atb filled
        first = c(ids, attention_mask=mask, use_cache=True)
        nxt = first.logits[:, -1:].argmax(-1)
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        out = c(nxt, attention_mask=mask2, past_key_values=first.past_key_values,
                output_hidden_states=True)
        ref = m(torch.cat([ids, nxt], 1), attention_mask=mask2, output_hidden_states=True)
    for a, b in zip(out.hidden_states, ref.hidden_states):
        torch.testing.assert_close(a[:, -1], b[:, -1], rtol=1e-4, atol=1e-4)


def test_streamer_sees_every_token(models):
    m, c = models["llama"], compile(models["llama"])
    ids, _ = left_padded([5], seed=7)
    seen = []

    class Streamer(tf.generation.BaseStreamer):
        def put(self, value):
            seen.append(value.reshape(-1).tolist())

        def end(self):
            seen.append("end")

    out = c.generate(ids, max_new_tokens=8, do_sample=False, streamer=Streamer())
    assert torch.equal(out, m.generate(ids, max_new_tokens=8, do_sample=False))
    assert seen[0] == ids[0].tolist() and seen[-1] == "end"
    assert [t[0] for t in seen[1:-1]] == out[0, 5:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_keeps_architecture(models, arch, tmp_path):
    m, c = models[arch], compile(models[arch])
    assert isinstance(c, AtbCausalLMMixin) and type(c).__name__ == type(m).__name__
    c.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [type(m).__name__]
    again = type(m).from_pretrained(tmp_path).eval()
    ids, _ = left_padded([6], seed=2)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, m(ids).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_text_generation_pipeline(models, tokenizer, arch):
    m, c = models[arch], compile(models[arch])
    text = "hello atb"
    with CaptureLogger(tf.pipelines.base.logger) as log:
        pipe = tf.pipeline("text-generation", model=c, tokenizer=tokenizer)
    assert "is not supported" not in log.out
    ref = tf.pipeline("text-generation", model=m, tokenizer=tokenizer)
    kw = dict(max_new_tokens=8, do_sample=False)
    got = pipe(text, **kw)[0]["generated_text"]
    assert got == ref(text, **kw)[0]["generated_text"] and len(got) == len(text) + 8


@pytest.mark.parametrize("opt", [0, 1])
def test_opt_levels_below_2_run_hf_loop_with_hf_tokens(models, opt):
    """No decode plan below opt 2: Hugging Face's loop over the compiled forward."""
    m, c = models["llama"], compile(models["llama"], opt_level=opt)
    ids, mask = left_padded([5, 9], seed=3)
    for kw in (dict(do_sample=False), dict(do_sample=True, top_p=0.9),
               dict(do_sample=False, repetition_penalty=1.3)):
        ref, out, steps = _both(m, c, ids, attention_mask=mask, max_new_tokens=8, **kw)
        assert torch.equal(out, ref) and steps == 0, (opt, kw)


def test_fast_stopping_criteria_answer_as_hf():
    """The loop's stand-in for max-length + EOS criteria gives the list's rows done
    (None standing for none), and other criteria lists run themselves."""
    from transformers.generation import stopping_criteria as sc

    from atb_torch.models.generate import _stopper

    crit = sc.StoppingCriteriaList([sc.MaxLengthCriteria(9, max_position_embeddings=7),
                                    sc.EosTokenCriteria(torch.tensor([3, 5]))])
    stop = _stopper(crit)
    g = torch.Generator().manual_seed(0)
    for n in range(5, 10):
        for _ in range(6):
            ids = torch.randint(0, 8, (3, n), generator=g)
            ref = crit(ids, None)
            got = stop(ids, ids[:, -1])
            assert torch.equal(ref, got if got is not None else torch.zeros(3, dtype=torch.bool))
    assert _stopper(sc.StoppingCriteriaList([sc.MaxTimeCriteria(5.0)])) is None
