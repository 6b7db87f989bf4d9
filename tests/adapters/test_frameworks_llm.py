"""``atb_mindspore.LLM`` and ``atb_paddle.LLM`` on local seeded checkpoints (Llama,
Qwen2 with q/k/v biases, Mistral with an 8-token sliding window): greedy tokens
against Hugging Face's generate and text against ``atb_torch.LLM``, for one prompt
and a batch of 8 prompts of different lengths; seeded sampling, penalties and
log-probabilities against ``atb_torch.LLM``; streaming, stop strings and
continuous batching with fewer batch slots than prompts; the serving engine's paged
cache: a cache too small for the batch (preemption), prefix-cache hits and
prompt-lookup speculation, each giving Hugging Face's greedy tokens."""

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch" / "llm"))
from llm_checkpoint import build_checkpoint  # noqa: E402

from atbcore.errors import InputError  # noqa: E402

FRAMEWORKS = ["mindspore", "paddle"]
ARCHS = ["llama", "qwen2", "mistral"]
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a",
           "numbers 0 1 2 3", "one two three four five six seven eight nine ten",
           "continuous batching serves", "tiny model trained inside a test", "lazy"]
NEW = 10


def _front(fw):
    pytest.importorskip(fw)
    return importlib.import_module(f"atb_{fw}")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {a: build_checkpoint(tmp_path_factory.mktemp(f"tiny-{a}"), arch=a) for a in ARCHS}


@pytest.fixture(scope="module")
def torch_llms(ckpts):
    from atb_torch.llm import LLM

    return {a: LLM(p) for a, p in ckpts.items()}


@pytest.fixture(scope="module")
def hf_tokens(ckpts):
    """Hugging Face greedy tokens of every prompt, generated alone (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for a, p in ckpts.items():
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
        rows = []
        for text in PROMPTS:
            ids = torch.tensor([tok(text).input_ids])
            with torch.no_grad():
                got = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            rows.append(got[0, ids.shape[1]:].tolist())
        out[a] = rows
    return out


_LLMS = {}


def _llm(fw, arch, ckpts, **kw):
    key = (fw, arch, tuple(sorted(kw.items())))
    if key not in _LLMS:
        _LLMS[key] = _front(fw).LLM(ckpts[arch], **kw)
    return _LLMS[key]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_greedy_tokens_equal_hugging_face_and_text_equals_atb_torch(fw, arch, ckpts, torch_llms,
                                                                    hf_tokens):
    llm = _llm(fw, arch, ckpts)
    single = llm.generate_outputs(PROMPTS[1], max_new_tokens=NEW)[0]
    batch = llm.generate_outputs(PROMPTS, max_new_tokens=NEW)
    # the eight prompts prefilled packed in one step, then decoded together
    assert llm.stats.prefill_steps == 1
    assert llm.stats.max_running == len(PROMPTS)
    assert single.token_ids == hf_tokens[arch][1]
    assert [o.token_ids for o in batch] == hf_tokens[arch]
    want = torch_llms[arch].generate_outputs(PROMPTS, max_new_tokens=NEW)
    assert [o.text for o in batch] == [o.text for o in want]
    assert [o.finish_reason for o in batch] == [o.finish_reason for o in want]
    assert llm.generate(PROMPTS[1], max_new_tokens=NEW) == want[1].text


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_seeded_sampling_draws_the_tokens_atb_torch_draws(fw, ckpts, torch_llms):
    llm, ref = _llm(fw, "llama", ckpts), torch_llms["llama"]
    kw = dict(max_new_tokens=8, temperature=0.9, top_k=40, top_p=0.9)
    got = llm.generate_outputs(PROMPTS, seed=7, **kw)
    want = ref.generate_outputs(PROMPTS, seed=7, **kw)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    seeds = list(range(3, 3 + len(PROMPTS)))
    assert [o.token_ids for o in llm.generate_outputs(PROMPTS, seed=seeds, **kw)] == \
        [o.token_ids for o in ref.generate_outputs(PROMPTS, seed=seeds, **kw)]
    # a different seed draws differently somewhere (the draws depend on it)
    other = llm.generate_outputs(PROMPTS, seed=8, **kw)
    assert [o.token_ids for o in other] != [o.token_ids for o in got]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_penalties_and_logprobs_match_atb_torch(fw, ckpts, torch_llms):
    llm, ref = _llm(fw, "llama", ckpts), torch_llms["llama"]
    kw = dict(max_new_tokens=8, repetition_penalty=1.5, frequency_penalty=0.5, logprobs=3)
    got, want = llm.generate_outputs(PROMPTS[:3], **kw), ref.generate_outputs(PROMPTS[:3], **kw)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert [lp.token for lp in g.logprobs] == g.token_ids
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_stream_stop_strings_and_fewer_cache_rows_than_prompts(fw, ckpts):
    llm = _llm(fw, "llama", ckpts)
    full = llm.generate_outputs(PROMPTS, max_new_tokens=NEW)
    events = list(llm.stream(PROMPTS, max_new_tokens=NEW))
    for i, o in enumerate(full):
        mine = [e for e in events if e.index == i]
        assert sum((e.token_ids for e in mine), []) == o.token_ids
        assert "".join(e.text for e in mine) == o.text
        assert mine[-1].finished and not any(e.finished for e in mine[:-1])
    # two batch slots for eight prompts: requests wait for a free slot, same tokens
    small = _llm(fw, "llama", ckpts, max_batch_size=2)
    assert small.engine.max_batch_size == 2
    assert [o.token_ids for o in small.generate_outputs(PROMPTS, max_new_tokens=NEW)] == \
        [o.token_ids for o in full]
    assert small.stats.max_running == 2
    # a stop string cuts the text right before it
    text = full[1].text
    stop = text[3:5]
    cut = llm.generate_outputs(PROMPTS[1], max_new_tokens=NEW, stop=stop)[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.find(stop)]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bad_checkpoints_and_arguments_are_refused_by_name(fw, ckpts, tmp_path):
    front = _front(fw)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(InputError, match="pickle"):
        front.LLM(tmp_path)
    llm = _llm(fw, "llama", ckpts)
    with pytest.raises(InputError, match="prompt token ids"):
        llm.generate([1, 2, 10_000])
    with pytest.raises(InputError, match="prompts"):
        llm.generate([])


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_cache_too_small_for_the_batch_preempts_and_keeps_the_tokens(fw, arch, ckpts,
                                                                       hf_tokens):
    # 4 blocks of 8 tokens: the 8 prompts (1..11 tokens) and their 10 new tokens do
    # not fit at once, so the engine preempts and recomputes, with the same tokens
    llm = _llm(fw, arch, ckpts, block_size=8, num_blocks=4)
    got = llm.generate_outputs(PROMPTS, max_new_tokens=NEW)
    assert [o.token_ids for o in got] == hf_tokens[arch]
    assert llm.stats.preemptions > 0
    assert llm.cache.manager.num_free_blocks == 4  # every block back


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_prefix_cache_hits_are_reported_and_keep_the_tokens(fw, ckpts, hf_tokens):
    llm = _llm(fw, "llama", ckpts)
    head = PROMPTS[4] + " " + PROMPTS[1]  # longer than a 16-token block
    prompts = [head + " " + p for p in PROMPTS[:3]]
    first = llm.generate_outputs(prompts, max_new_tokens=NEW)
    again = llm.generate_outputs(prompts, max_new_tokens=NEW)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert all(o.num_cached_tokens >= 16 for o in again)
    assert llm.stats.cached_prompt_tokens == sum(o.num_cached_tokens for o in again)
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpts["llama"], local_files_only=True).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([first[0].prompt_token_ids]), max_new_tokens=NEW,
                           do_sample=False, pad_token_id=0)[0, len(first[0].prompt_token_ids):]
    assert first[0].token_ids == want.tolist()


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_prompt_lookup_speculation_gives_the_greedy_tokens(fw, ckpts, hf_tokens):
    llm = _llm(fw, "llama", ckpts, enable_speculative=True)
    got = llm.generate_outputs(PROMPTS, max_new_tokens=NEW)
    assert [o.token_ids for o in got] == hf_tokens["llama"]
    assert llm.stats.spec_steps > 0 and llm.stats.spec_proposed > 0
