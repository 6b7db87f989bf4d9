"""The engine as a request loop: concurrent clients get what they get alone, requests
carry their own sampling (penalties against HF's logits processors and a NumPy
oracle, log-probabilities against HF's logits), cancelling frees KV blocks."""

import random
import threading

import numpy as np
import pytest
import torch

from atbcore.errors import ParamsError

PROMPTS = ["the quick brown fox", "hello world, this is", "one two three four five six",
           "numbers 0 1 2 3 4 5 6 7 8 9 and letters a b c"]


def test_concurrent_generate_outputs_equal_serial(llm):
    rng = random.Random(5)
    jobs = []  # (prompts, kwargs): greedy and sampled, lists and single prompts
    for k in range(8):
        prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(2, 60))]
                   for _ in range(rng.randint(1, 3))]
        kw = dict(max_new_tokens=rng.randint(3, 20), ignore_eos=True)
        if k % 2:
            kw.update(temperature=0.8, top_k=20, top_p=0.9, seed=k)
        if k % 3 == 0:
            kw.update(repetition_penalty=1.2, frequency_penalty=0.5)
        jobs.append((prompts, kw))
    serial = [[o.token_ids for o in llm.generate_outputs(p, **kw)] for p, kw in jobs]
    got = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def client(i):
        barrier.wait()
        got[i] = [o.token_ids for o in llm.generate_outputs(jobs[i][0], **jobs[i][1])]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == serial
    assert llm.cache.manager.num_used_blocks == 0


def test_cancel_frees_blocks_and_others_finish(llm):
    from atb_torch.llm import SamplingConfig

    long = llm.submit(PROMPTS[0], SamplingConfig(), max_new_tokens=200, ignore_eos=True)
    other = llm.submit(PROMPTS[1], SamplingConfig(), max_new_tokens=12, ignore_eos=True)
    req, ev = long.get(timeout=30)
    assert ev.token_ids and llm.cache.manager.num_used_blocks > 0
    llm.cancel(long)
    assert long.requests[0].finish_reason == "abort"
    toks = [t for _, e in other for t in e.token_ids]
    assert toks == llm.generate_outputs(PROMPTS[1], max_new_tokens=12,
                                        ignore_eos=True)[0].token_ids
    assert llm.cache.manager.num_used_blocks == 0


def test_n_choices_draw_from_their_own_streams(llm):
    from atb_torch.llm import SamplingConfig

    cfg = SamplingConfig(temperature=1.0, seed=11)
    h = llm.submit(PROMPTS[2], cfg, max_new_tokens=10, ignore_eos=True, n=3)
    by = {0: [], 1: [], 2: []}
    for _, ev in h:
        by[ev.index].extend(ev.token_ids)
    # choice j equals prompt j of a list sampled with the same seed (stream j)
    ref = llm.generate_outputs([PROMPTS[2]] * 3, max_new_tokens=10, ignore_eos=True,
                               temperature=1.0, seed=11)
    assert [by[j] for j in range(3)] == [o.token_ids for o in ref]
    assert len({tuple(v) for v in by.values()}) > 1


def test_repetition_penalty_equals_hf(llm, hf):
    model, tok = hf
    changed = False
    for p in PROMPTS[:2]:
        ids = torch.tensor([tok(p).input_ids])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                 do_sample=False, repetition_penalty=1.5)[0, ids.shape[1]:]
        out = llm.generate_outputs(p, max_new_tokens=16, repetition_penalty=1.5)[0]
        assert out.token_ids == ref.tolist()[:len(out.token_ids)]
        assert out.finish_reason in ("eos", "length")
        changed |= out.token_ids != llm.generate_outputs(p, max_new_tokens=16)[0].token_ids
    assert changed  # the penalty mattered


def test_presence_frequency_penalties_against_numpy():
    from atb_torch.llm.sampling import SamplingConfig, select_tokens

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    output = [4, 4, 9, 17, 4]
    cfg = SamplingConfig(presence_penalty=0.7, frequency_penalty=0.6, logprobs=3)
    ref = logits.copy()
    for t in set(output):
        ref[:, t] -= 0.7 + 0.6 * output.count(t)
    ref[:, 4] += 5.0  # make sure the penalties change the argmax
    x = torch.from_numpy(logits.copy())
    x[:, 4] += 5.0
    toks, lps = select_tokens(x, [cfg] * 3, [(0, 0)] * 3, [10] * 3, [([1, 2], output)] * 3)
    assert toks == ref.argmax(-1).tolist()
    lse = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - ref.max(-1, keepdims=True)
    for i in range(3):
        assert lps[i].logprob == pytest.approx(lse[i, toks[i]], rel=1e-4, abs=1e-5)
        assert [t for t, _ in lps[i].top] == np.argsort(-lse[i])[:3].tolist()


def test_logprobs_equal_hf_log_softmax(llm, hf):
    model, tok = hf
    ids = torch.tensor([tok(PROMPTS[3]).input_ids])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                           do_sample=False, output_logits=True, return_dict_in_generate=True)
    out = llm.generate_outputs(PROMPTS[3], max_new_tokens=8, logprobs=2)[0]
    assert len(out.logprobs) == len(out.token_ids)
    for lp, logits in zip(out.logprobs, g.logits):
        ref = torch.log_softmax(logits[0].float(), -1)
        assert lp.logprob == pytest.approx(float(ref[lp.token]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref, 2).indices.tolist()


def test_bad_sampling_values_are_params_errors(llm):
    with pytest.raises(ParamsError, match="presence_penalty"):
        llm.generate("a", presence_penalty=3.0)
    with pytest.raises(ParamsError, match="logprobs"):
        llm.generate("a", logprobs=-1)
    with pytest.raises(ParamsError, match="n"):
        llm.submit("a", n=0)


def test_a_failing_step_ends_its_requests_and_the_loop_goes_on(ckpt):
    from atb_torch.llm import LLM, EngineClosedError

    llm = LLM(ckpt)
    inner = llm.engine.model.forward_paged
    calls = []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return inner(*a, **kw)

    llm.engine.model.forward_paged = flaky
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
    assert llm.cache.manager.num_used_blocks == 0  # the failed requests' blocks are back
    llm.engine.model.forward_paged = inner
    assert llm.generate(PROMPTS[0], max_new_tokens=4)  # still serving
    llm.close()
    with pytest.raises(EngineClosedError):
        llm.generate(PROMPTS[0], max_new_tokens=4)
