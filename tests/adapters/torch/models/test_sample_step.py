"""The decoding step's token (``token_picker``) is Hugging Face's: the same processors'
scores, then ``argmax`` or ``torch.multinomial(softmax(scores), 1)`` with the same
generator (the oracle), and the generator ends in the same state. Also the pieces it
rests on: the C MT19937 against torch's ``uniform_``, the compact-row softmax
against the full row, and the in-place processors against Hugging Face's."""

import math

import numpy as np
import pytest
import torch
from transformers.generation import logits_process as lp

from atb_torch.models import sample_step
from atb_torch.models.processors import accelerate
from atbcore.backends.cpu_kernels.torch_sampling import mt19937_uniforms


def _hf_token(procs, ids, scores, do_sample):
    for p in procs:
        scores = p(ids, scores)
    if not do_sample:
        return scores.argmax(-1)
    return torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)


def _logits(b, v, seed, kind="random"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g) * 2
    if kind == "ties":  # coarse values: ties at the k-th value and at the top-p cut
        x = (x * 2).round() / 2
    elif kind == "peaked":  # top-p keeps very few
        x[:, 3] += 12
    return x


def _same_draws(picker, procs, ids, x, seed, do_sample=True):
    torch.manual_seed(seed)
    torch.rand(seed % 5)  # start anywhere in the generator's block
    ref, ref_next = _hf_token(procs, ids, x.clone(), do_sample), torch.rand(3)
    torch.manual_seed(seed)
    torch.rand(seed % 5)
    out, out_next = picker(ids, x.clone()), torch.rand(3)
    return torch.equal(out, ref) and torch.equal(out_next, ref_next)


TAILS = {
    "temp_topk_topp": lambda: [lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(50),
                               lp.TopPLogitsWarper(0.9)],
    "topk_topp_keep": lambda: [lp.TopKLogitsWarper(40), lp.TopPLogitsWarper(0.3, min_tokens_to_keep=5)],
    "temp_topk": lambda: [lp.TemperatureLogitsWarper(1.7), lp.TopKLogitsWarper(20)],
    "penalty_then_tail": lambda: [lp.RepetitionPenaltyLogitsProcessor(1.3),
                                  lp.TemperatureLogitsWarper(0.6), lp.TopKLogitsWarper(64),
                                  lp.TopPLogitsWarper(0.95)],
}


@pytest.mark.parametrize("tail", list(TAILS))
@pytest.mark.parametrize("kind", ["random", "ties", "peaked"])
@pytest.mark.parametrize("b,v", [(1, 32000), (3, 50257), (2, 4096)])
@pytest.mark.parametrize("c_step", [True, False])
def test_fused_sampling_step_draws_hf_tokens(monkeypatch, tail, kind, b, v, c_step):
    """Random rows take the fused step (the general sampler is disabled to prove it):
    the C step, or with it off the NumPy/torch one; tied rows may step aside, and
    then give Hugging Face's token too."""
    decided = []
    c_call = sample_step.sample_top_k

    def counted(*args):
        tok = c_call(*args) if c_step else None
        decided.append(tok is not None)
        return tok

    monkeypatch.setattr(sample_step, "sample_top_k", counted)
    procs = TAILS[tail]()
    picker = sample_step.token_picker(procs, do_sample=True)
    ids = torch.randint(0, v, (b, 12), generator=torch.Generator().manual_seed(1))
    if kind != "ties":
        monkeypatch.setattr(sample_step, "sample", lambda probs: pytest.fail("general path ran"))
    for seed in range(6):
        x = _logits(b, v, seed, kind)
        assert _same_draws(picker, procs, ids, x, seed), (tail, kind, seed)
    if c_step and kind == "random":
        assert sum(decided) >= 4, "the C step hardly ever decided"


def test_c_step_agrees_with_hf_over_many_draws():
    """The C step's margins: over many rows it decides almost all and is never wrong."""
    from atbcore.backends.cpu_kernels.torch_sampling import sample_top_k

    procs = TAILS["temp_topk_topp"]()
    undecided = 0
    for seed in range(300):
        x = _logits(2, 32000, seed) * (0.5 + seed % 7)
        torch.manual_seed(seed)
        ref, ref_next = _hf_token(procs, None, x.clone(), True), torch.rand(2)
        torch.manual_seed(seed)
        out = sample_top_k(x, 50, 0.8, 1, float(np.float32(1 - 0.9)), 1)
        if out is None:
            undecided += 1
            continue
        assert torch.equal(out, ref) and torch.equal(torch.rand(2), ref_next), seed
    assert undecided < 30


@pytest.mark.parametrize("case", ["nan", "inf", "few finite", "p fill", "k >= vocab"])
def test_sampling_step_edges_as_hf(case):
    v = 3000
    procs = [lp.TemperatureLogitsWarper(0.9), lp.TopKLogitsWarper(3000 if case == "k >= vocab" else 30),
             lp.TopPLogitsWarper(0.8, filter_value=-5.0 if case == "p fill" else -math.inf)]
    picker = sample_step.token_picker(procs, do_sample=True)
    ids = torch.zeros(2, 3, dtype=torch.long)
    x = _logits(2, v, 4)
    if case == "nan":
        x[1, 7] = math.nan
    elif case == "inf":
        x[0, 9] = math.inf
    elif case == "few finite":
        x[:, 10:] = -math.inf
    if case in ("nan", "inf"):  # torch.multinomial refuses the row: so must the step
        with pytest.raises(RuntimeError):
            _hf_token(procs, ids, x.clone(), True)
        with pytest.raises(RuntimeError):
            picker(ids, x.clone())
        return
    for seed in range(4):
        assert _same_draws(picker, procs, ids, x, seed), (case, seed)


@pytest.mark.parametrize("do_sample", [False, True])
def test_picker_without_the_tail(do_sample):
    """Lists that do not end with the tail: accelerate's forms, then argmax / sample."""
    procs = [lp.MinNewTokensLengthLogitsProcessor(2, 5, [2, 7]), lp.RepetitionPenaltyLogitsProcessor(1.2),
             lp.TopPLogitsWarper(0.9), lp.MinPLogitsWarper(0.05)]
    picker = sample_step.token_picker(procs, do_sample)
    ids = torch.randint(0, 8000, (2, 4), generator=torch.Generator().manual_seed(3))
    for seed in range(4):
        assert _same_draws(picker, procs, ids, _logits(2, 8000, seed), seed, do_sample)


@pytest.mark.parametrize("n", [1, 311, 312, 313, 624, 32000, 151936])
@pytest.mark.parametrize("before", [0, 1, 311, 623, 624, 1000])
def test_mt19937_uniforms_are_torchs(n, before):
    """The kept draws equal ``uniform_``'s, and the generator ends where it leaves it."""
    for gen in (None, torch.Generator()):
        g = torch.default_generator if gen is None else gen
        g.manual_seed(n + before)
        torch.rand(before, dtype=torch.float64, generator=g)
        state = g.get_state()
        ref = torch.empty(n, dtype=torch.float64).uniform_(generator=g).numpy()
        ref_next = torch.rand(4, generator=g)
        want = np.sort(np.random.default_rng(n).choice(n, size=min(n, 50), replace=False))
        g.set_state(state)
        got = mt19937_uniforms(n, want, gen)
        assert got is not None, "the C kernels did not load"
        assert np.array_equal(got, ref[want])
        assert torch.equal(torch.rand(4, generator=g), ref_next)


@pytest.mark.parametrize("v", [32000, 50257, 151936, 256, 77])
def test_softmax_at_scattered_columns_is_the_full_rows(v):
    assert sample_step._compact_exact(v), "the compact row is not exact here: the fast path is off"
    g = torch.Generator().manual_seed(v)
    for trial in range(30):
        k = 1 + int(torch.randint(0, min(v, 300), (1,), generator=g))
        cols = np.sort(torch.randperm(v, generator=g)[:k].numpy())
        vals = (torch.randn(k, generator=g) * (1 + trial % 9)).numpy()
        row = torch.full((1, v), -math.inf)
        row[0, cols] = torch.from_numpy(vals)
        ref = row.softmax(-1)[0, cols].numpy()
        assert np.array_equal(sample_step.softmax_at(vals, cols, v), ref), trial


@pytest.mark.parametrize("c_kernels", [True, False])
def test_in_place_processors_as_hf(monkeypatch, c_kernels):
    if not c_kernels:
        from atb_torch.models import processors

        monkeypatch.setattr(processors, "repetition_penalty_", lambda *a: False)
    v = 5000
    ids = torch.randint(0, v, (3, 40), generator=torch.Generator().manual_seed(2))
    ids[:, 5] = ids[:, 6]  # a repeated token: scattered twice
    cases = [lp.TemperatureLogitsWarper(0.7), lp.TemperatureLogitsWarper(1.9),
             lp.MinLengthLogitsProcessor(50, [2, 9, v + 3]), lp.MinLengthLogitsProcessor(10, 2),
             lp.MinNewTokensLengthLogitsProcessor(30, 20, torch.tensor([4])),
             lp.RepetitionPenaltyLogitsProcessor(1.3), lp.RepetitionPenaltyLogitsProcessor(0.7),
             lp.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=30)]
    for hf in cases:
        (fast,) = accelerate([hf])
        assert fast is not hf, type(hf)
        for seed in range(3):
            x = _logits(3, v, seed)
            ref = hf(ids, x.clone())
            assert torch.equal(fast(ids, x.clone()), ref), (type(hf), seed)
    big = ids.clone()
    big[0, 33] = v + 1  # an id past the vocabulary: the installed release's own rule
    for hf in (lp.RepetitionPenaltyLogitsProcessor(1.3),
               lp.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=30)):
        x = _logits(3, v, 0)
        (fast,) = accelerate([hf])
        try:
            ref = hf(big, x.clone())
        except (RuntimeError, IndexError):
            with pytest.raises((RuntimeError, IndexError)):
                fast(big, x.clone())
        else:
            assert torch.equal(fast(big, x.clone()), ref)


def test_in_place_after_a_foreign_processor_clones():
    """A processor atb does not know may return a tensor it keeps: the in-place one
    after it works on a copy."""
    held = torch.randn(1, 300)
    kept = held.clone()
    procs = accelerate([lambda ids, s: held, lp.TemperatureLogitsWarper(0.5)])
    out = procs[1](torch.zeros(1, 2, dtype=torch.long), procs[0](None, torch.zeros(1, 300)))
    assert torch.equal(held, kept) and torch.equal(out, kept / 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_greedy_picker_reads_the_logits_as_torch_argmax(dtype):
    """Greedy without processors: the picker only reads (``reads_only``, so generate
    passes the logits without an fp32 copy) and gives torch's argmax, first maximum on
    ties and a NaN counting as the maximum, in every logits dtype."""
    pick = sample_step.token_picker([], False)
    assert getattr(pick, "reads_only", False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 32003, generator=g).to(dtype)
    x[1, 100] = x[1, 7] = 50.0          # a tie: the first
    x[2, 9] = float("nan")              # a NaN wins
    x[3, -1] = float("inf")
    before = x.clone()
    got = pick(None, x)
    assert torch.equal(got, x.argmax(dim=-1)) and got.tolist()[1:] == [7, 9, 32002]
    assert torch.equal(x.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       before.view(torch.int16 if dtype != torch.float32 else torch.int32))
    # with a processor the picker works on its private copy as before
    procs = [lp.MinLengthLogitsProcessor(5, eos_token_id=7)]
    pick2 = sample_step.token_picker(procs, False)
    assert not getattr(pick2, "reads_only", False)
    ids = torch.zeros(4, 2, dtype=torch.long)
    ref = procs[0](ids, x.float().clone()).argmax(dim=-1)
    assert torch.equal(pick2(ids, x.float().clone()), ref)
