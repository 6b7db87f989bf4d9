"""LLM.generate against Hugging Face's generate on the same local checkpoint: greedy
tokens, continuous batching, sampling, streaming, stop strings, loading rules."""

import random

import pytest
import torch

from atbcore.errors import InputError, ParamsError

PROMPTS = ["the quick brown fox", "hello world, this is", "one two three four five six",
           "numbers 0 1 2 3 4 5 6 7 8 9 and letters a b c"]


def hf_greedy(hf, prompt_ids, n):
    model, _ = hf
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_equals_hf_generate(llm, hf):
    outs = llm.generate_outputs(PROMPTS, max_new_tokens=24)
    for o, p in zip(outs, PROMPTS):
        ref = hf_greedy(hf, hf[1](p).input_ids, 24)
        assert o.prompt_token_ids == hf[1](p).input_ids
        assert o.token_ids == ref, p
        assert o.finish_reason == ("eos" if ref[-1] == 2 else "length")
        assert o.text == hf[1].decode(ref, skip_special_tokens=True)
    assert llm.generate(PROMPTS[0], max_new_tokens=24) == outs[0].text  # one prompt -> str


def test_continuous_batching_16_prompts_equal_each_alone(ckpt):
    from atb_torch.llm import LLM

    llm = LLM(ckpt, max_batch_size=5, max_prefill_tokens=256)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 384) for _ in range(n)]
               for n in (3, 17, 40, 9, 120, 64, 5, 33, 250, 16, 80, 2, 47, 101, 12, 190)]
    batched = []
    for ev in llm.stream(prompts, max_new_tokens=30, ignore_eos=True):
        batched.append(ev)
    by_req = {i: [] for i in range(16)}
    for ev in batched:
        by_req[ev.index].extend(ev.token_ids)
    st = llm.last_stats
    alone = [llm.generate_outputs(p, max_new_tokens=30, ignore_eos=True)[0].token_ids
             for p in prompts]
    assert [by_req[i] for i in range(16)] == alone
    # joins and leaves: never more than 5 running, and the decode batch size changed
    assert st.max_running == 5 and len(set(st.batch_sizes)) > 2
    # no padding: exactly the prompt tokens plus every generated token but the last
    assert st.computed_tokens == sum(map(len, prompts)) - st.cached_prompt_tokens + 16 * 29
    assert llm.cache.manager.num_used_blocks == 0  # finished sequences gave their blocks back


def test_batched_greedy_equals_hf_per_prompt(llm, hf):
    outs = llm.generate_outputs(PROMPTS[::-1], max_new_tokens=16)
    for o, p in zip(outs, PROMPTS[::-1]):
        assert o.token_ids == hf_greedy(hf, hf[1](p).input_ids, 16)


def test_sampling_is_reproducible_and_independent_of_the_batch(llm):
    kw = dict(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.9)
    a = llm.generate_outputs(PROMPTS, seed=[11, 12, 13, 14], **kw)
    b = llm.generate_outputs(PROMPTS, seed=[11, 12, 13, 14], **kw)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    alone = [llm.generate_outputs(p, seed=s, **kw)[0].token_ids
             for p, s in zip(PROMPTS, [11, 12, 13, 14])]
    assert [o.token_ids for o in a] == alone
    other = llm.generate_outputs(PROMPTS, seed=[21, 22, 23, 24], **kw)
    assert [o.token_ids for o in other] != alone
    greedy = llm.generate_outputs(PROMPTS, max_new_tokens=12)
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]


def test_sampling_follows_the_core_sampling_op(llm):
    """The first sampled token equals TopkToppSampling on HF-equal prefill logits with
    the per-position seed the LLM documents."""
    from atb_torch.llm.sampling import step_seed
    from atbcore.operation import Builder

    ids = llm.tokenizer(PROMPTS[1]).input_ids
    tok = llm.generate_outputs(PROMPTS[1], max_new_tokens=1, temperature=0.7, top_k=20,
                               seed=5)[0].token_ids[0]
    with torch.no_grad():
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(llm.path, local_files_only=True)
        logits = hf(torch.tensor([ids])).logits[:, -1]
    op = Builder().build_operation("TopkToppSampling", {"top_k": 20, "temperature": 0.7,
                                                        "seed": step_seed(5, 0, len(ids))})
    assert tok == int(op.execute([logits])[0][0])


def test_streaming_yields_the_same_tokens_and_text(llm):
    full = llm.generate_outputs(PROMPTS[2], max_new_tokens=20)[0]
    events = list(llm.stream(PROMPTS[2], max_new_tokens=20))
    assert sum((e.token_ids for e in events), []) == full.token_ids
    assert "".join(e.text for e in events) == full.text
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    # a list streams every prompt's events, interleaved
    evs = list(llm.stream(PROMPTS, max_new_tokens=8))
    assert {e.index for e in evs} == set(range(len(PROMPTS)))
    assert evs[0].index != evs[1].index  # the first step produced a token for each
    # a consumer that stops early leaves no KV blocks behind (the engine thread runs
    # ahead of its consumers: long requests, so that they are still running at close)
    it = llm.stream(PROMPTS, max_new_tokens=1500, ignore_eos=True)
    next(it)
    it.close()
    assert llm.cache.manager.num_used_blocks == 0
    assert llm.last_stats.generated_tokens < len(PROMPTS) * 1500  # cancelled, not finished


def test_stop_strings_end_and_cut_the_text(llm):
    full = llm.generate_outputs(PROMPTS[0], max_new_tokens=30, ignore_eos=True)[0].text
    stop = full[8:10]
    cut = full.find(stop)
    out = llm.generate_outputs(PROMPTS[0], max_new_tokens=30, ignore_eos=True, stop=[stop])[0]
    assert out.text == full[:cut] and out.finish_reason == "stop"
    streamed = "".join(e.text for e in llm.stream(PROMPTS[0], max_new_tokens=30,
                                                  ignore_eos=True, stop=stop))
    assert streamed == full[:cut]


def test_bf16_and_w8_run(ckpt, llm):
    from atb_torch.llm import LLM

    ref = llm.generate_outputs(PROMPTS, max_new_tokens=8, ignore_eos=True)
    for kw in ({"dtype": "bf16"}, {"quantize": "w8"}):
        with LLM(ckpt, **kw) as other:
            assert other.dtype == (torch.bfloat16 if "dtype" in kw else torch.float32)
            outs = other.generate_outputs(PROMPTS, max_new_tokens=8, ignore_eos=True)
        assert other.cache.freed  # the KV cache went back to the pool on exit
        assert [len(o.token_ids) for o in outs] == [8] * len(PROMPTS)
        # same first token as fp32 for most prompts (lower precision, same model)
        assert sum(o.token_ids[0] == r.token_ids[0] for o, r in zip(outs, ref)) >= 3


def test_checkpoint_rules(tmp_path, ckpt):
    from atb_torch.llm import LLM

    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(InputError, match="pickle"):
        LLM(tmp_path)
    with pytest.raises(InputError, match="local directory"):
        LLM(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="config.json"):
        LLM(empty)


def test_bad_arguments_are_refused(llm):
    with pytest.raises(ParamsError, match="temperature"):
        llm.generate("hi", temperature=-1.0)
    with pytest.raises(ParamsError, match="top_p"):
        llm.generate("hi", temperature=1.0, top_p=0.0)
    with pytest.raises(ParamsError, match="max_new_tokens"):
        llm.generate("hi", max_new_tokens=0)
    with pytest.raises(InputError, match="max_model_len"):
        llm.generate([5] * 2048, max_new_tokens=1)
    with pytest.raises(InputError, match="token ids"):
        llm.generate([[5, 6, 10_000]], max_new_tokens=1)
    with pytest.raises(ParamsError, match="seed"):
        llm.generate(["a", "b"], seed=[1])


def test_preemption_when_blocks_run_out_keeps_the_tokens(ckpt, llm):
    from atb_torch.llm import LLM

    small = LLM(ckpt, num_blocks=12, block_size=16, max_batch_size=8)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 384) for _ in range(40)] for _ in range(4)]
    outs = small.generate_outputs(prompts, max_new_tokens=20, ignore_eos=True)
    assert small.last_stats.preemptions > 0  # 4 x 3 blocks filled the cache at the start
    alone = [llm.generate_outputs(p, max_new_tokens=20, ignore_eos=True)[0].token_ids
             for p in prompts]
    assert [o.token_ids for o in outs] == alone
    assert small.cache.manager.num_used_blocks == 0
    out, = small.generate_outputs([[5] * 200], max_new_tokens=2)  # fails alone, no raise
    assert out.finish_reason == "error" and "does not fit the KV cache" in out.error
    assert out.token_ids == [] and small.cache.manager.num_used_blocks == 0


def test_a_request_that_outgrows_the_cache_fails_alone(ckpt, llm):
    """6 blocks of 16 = 96 cached tokens: the 40-token prompt asking for 60 more
    outgrows the cache mid-decode, the 200-token prompt never fits; each fails with
    its reason and its blocks freed, while the two short requests complete with the
    tokens they produce alone, and the long one keeps the tokens it had made."""
    from atb_torch.llm import LLM

    small = LLM(ckpt, num_blocks=6, block_size=16, max_batch_size=8)
    rng = random.Random(11)
    long_p = [rng.randrange(3, 384) for _ in range(40)]
    short = [[rng.randrange(3, 384) for _ in range(10)] for _ in range(2)]
    huge = [rng.randrange(3, 384) for _ in range(200)]
    prompts = [short[0], long_p, huge, short[1]]
    events = list(small.stream(prompts, max_new_tokens=60, ignore_eos=True))
    outs = small.generate_outputs(prompts, max_new_tokens=60, ignore_eos=True)
    assert small.cache.manager.num_used_blocks == 0
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "outgrew the KV cache" in outs[1].error and "does not fit" in outs[2].error
    last = {e.index: e for e in events}
    assert last[1].finish_reason == "error" and last[1].error == outs[1].error
    assert last[2].finish_reason == "error" and outs[2].token_ids == []
    for i in (0, 3):
        alone = llm.generate_outputs(prompts[i], max_new_tokens=60, ignore_eos=True)[0]
        assert outs[i].token_ids == alone.token_ids and outs[i].text == alone.text
    made = outs[1].token_ids
    assert 0 < len(made) < 60 and len(long_p) + len(made) <= 97
    alone = llm.generate_outputs(long_p, max_new_tokens=len(made), ignore_eos=True)[0]
    assert made == alone.token_ids


def test_core_engine_serves_hf_tokens_with_every_engine_feature(ckpt, llm, hf):
    """The core lowered decoder over the paged cache: greedy tokens of HF, with a cache
    small enough to preempt, prefix hits and prompt-lookup drafts."""
    from atb_torch.llm import LLM

    core = LLM(ckpt, enable_speculative=True, block_size=8, num_blocks=8)
    got = core.generate_outputs(PROMPTS, max_new_tokens=12)
    for o in got:
        assert o.token_ids == hf_greedy(hf, o.prompt_token_ids, 12)
    assert core.stats.preemptions > 0 and core.stats.spec_proposed > 0
    again = core.generate_outputs(PROMPTS[3], max_new_tokens=12)[0]  # its first block cached
    assert again.token_ids == got[3].token_ids and again.num_cached_tokens >= 8
    core.close()


def test_explain_reports_the_core_plan(llm):
    """``LLM.explain()``: the paged core plan that served the requests (its kernels and
    packed layouts), not the unbound graph."""
    llm.generate_outputs(PROMPTS[:1], max_new_tokens=2)
    text = llm.explain()
    assert "PagedAttention" in text and "32-output panels" in text and "Plan for" in text
