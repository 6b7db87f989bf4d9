"""Prefix caching (a shared 1,000-token prefix is computed once, counted at the model)
and prompt-lookup speculative decoding (identical output, acceptance reported)."""

import random

import pytest

from atb_torch.llm.speculative import SpecStats, accept_draft, propose_draft


def count_model_tokens(llm):
    """Wrap the engine's model so every token it computes is counted (independently
    of the LLM's own statistics)."""
    seen = []
    inner = llm.engine.model.forward_paged

    def spy(input_ids, batch, cache, all_logits=False):
        seen.append(len(input_ids))
        return inner(input_ids, batch, cache, all_logits=all_logits)

    llm.engine.model.forward_paged = spy
    return seen


def test_shared_1000_token_prefix_is_computed_once(ckpt):
    from atb_torch.llm import LLM

    rng = random.Random(7)
    prefix = [rng.randrange(3, 384) for _ in range(1000)]
    prompts = [prefix + [rng.randrange(3, 384) for _ in range(20 + i)] for i in range(3)]
    plain = LLM(ckpt, enable_prefix_caching=False)
    ref = [o.token_ids for o in plain.generate_outputs(prompts, max_new_tokens=6, ignore_eos=True)]

    llm = LLM(ckpt, enable_prefix_caching=True)
    seen = count_model_tokens(llm)
    outs = llm.generate_outputs(prompts, max_new_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in outs] == ref  # outputs unchanged
    shared = 1000 // 16 * 16  # whole blocks of the prefix (block_size 16)
    assert [o.num_cached_tokens for o in outs] == [0, shared, shared]
    prompt_total = sum(map(len, prompts))
    # the model ran the prefix once: every prompt token but the two cached prefixes,
    # plus one token per decode step per request
    assert sum(seen) == prompt_total - 2 * shared + 3 * 5
    assert llm.last_stats.cached_prompt_tokens == 2 * shared
    # a later call with the same prefix is served from the cache too
    seen.clear()
    again = llm.generate_outputs(prefix + [5, 6, 7], max_new_tokens=2, ignore_eos=True)[0]
    assert again.num_cached_tokens == shared and sum(seen) == 1003 - shared + 1
    assert again.token_ids == plain.generate_outputs(prefix + [5, 6, 7], max_new_tokens=2,
                                                     ignore_eos=True)[0].token_ids


def test_speculative_greedy_output_is_identical_and_acceptance_is_reported(ckpt, llm):
    from atb_torch.llm import LLM

    spec = LLM(ckpt, enable_speculative=True)
    rng = random.Random(3)
    loop = [rng.randrange(3, 384) for _ in range(12)]
    prompts = ["one two three four five six seven eight nine ten " * 4,
               loop * 6, "the quick brown fox", [rng.randrange(3, 384) for _ in range(40)]]
    ref = llm.generate_outputs(prompts, max_new_tokens=40, ignore_eos=True)
    steps_plain = llm.last_stats.steps
    outs = spec.generate_outputs(prompts, max_new_tokens=40, ignore_eos=True)
    st = spec.last_stats
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.text for o in outs] == [o.text for o in ref]
    assert st.spec_proposed > 0 and 0 < st.acceptance_rate <= 1
    assert st.spec_accepted == round(st.acceptance_rate * st.spec_proposed)
    assert st.steps < steps_plain  # accepted drafts saved forward passes
    assert spec.cache.manager.num_used_blocks == 0  # forks and sequences all freed
    # sampled output is identical too (draws are keyed by token position)
    kw = dict(max_new_tokens=30, temperature=0.8, top_k=40, seed=[1, 2, 3, 4], ignore_eos=True)
    assert [o.token_ids for o in spec.generate_outputs(prompts, **kw)] == \
        [o.token_ids for o in llm.generate_outputs(prompts, **kw)]


def test_streaming_with_speculation_yields_the_same_tokens(ckpt, llm):
    from atb_torch.llm import LLM

    spec = LLM(ckpt, enable_speculative=True)
    p = "one two three four five six seven eight nine ten " * 3
    ref = llm.generate_outputs(p, max_new_tokens=30, ignore_eos=True)[0]
    events = list(spec.stream(p, max_new_tokens=30, ignore_eos=True))
    assert sum((e.token_ids for e in events), []) == ref.token_ids
    assert "".join(e.text for e in events) == ref.text


@pytest.mark.parametrize("tokens, expect", [
    ([1, 2, 3, 4, 1, 2], [3, 4, 1, 2]),         # the suffix [1, 2] was seen: what followed
    ([5, 6, 7, 8, 9, 7, 8], [9, 7, 8]),         # longest suffix first ([7, 8] -> 9, 7, 8)
    ([1, 2, 3], []),                            # nothing repeats
    ([4, 4, 4, 4, 4, 4], [4, 4, 4]),            # the longest continuation
    ([1, 2, 3, 7, 1, 2, 5, 6, 7, 8, 1, 2], [5, 6, 7, 8]),  # the most recent one
])
def test_propose_draft(tokens, expect):
    assert propose_draft(tokens, num_draft=4, max_ngram=3)[:len(expect)] == expect
    if not expect:
        assert propose_draft(tokens, 4) == []


def test_accept_draft_keeps_matching_prefix_plus_one_model_token():
    assert accept_draft([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_draft([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_draft([5], [4, 2]) == [4]
    s = SpecStats(proposed=8, accepted=6)
    assert s.acceptance_rate == 0.75 and SpecStats().acceptance_rate == 0.0
