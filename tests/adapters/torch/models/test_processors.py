"""atb's faster logits processors give Hugging Face's scores bit for bit (the oracle:
the Hugging Face processor they replace), on random, tied and masked scores."""

import math

import pytest
import torch
from transformers.generation import logits_process as lp

from atb_torch.models.processors import accelerate


def _scores(kind, b=3, v=5000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g) * 3
    if kind == "ties":  # coarse values: many exact ties, some at the cut
        x = (x * 2).round() / 2
    elif kind == "masked":  # -inf columns, as after top-k or bad words
        x[:, torch.randperm(v, generator=g)[: v // 2]] = -math.inf
    elif kind == "top_k":  # few finite values, as after top-k: the short sort path
        x[:, torch.randperm(v, generator=g)[: v - 40]] = -math.inf
    elif kind == "peaked":
        x[:, 7] += 30
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "masked", "top_k", "peaked"])
@pytest.mark.parametrize("top_p,keep", [(0.9, 1), (0.5, 1), (0.99, 3), (0.1, 20), (1.0, 1)])
def test_top_p_same_as_hf(kind, top_p, keep):
    hf = lp.TopPLogitsWarper(top_p, min_tokens_to_keep=keep)
    (fast,) = accelerate([hf])
    ids = torch.zeros(3, 4, dtype=torch.long)
    for seed in range(4):
        x = _scores(kind, seed=seed)
        ref = hf(ids, x.clone())
        out = fast(ids, x.clone())
        assert torch.equal(out, ref), (kind, top_p, keep, seed)
        assert torch.isinf(ref).any() or top_p == 1.0  # the cut removed something


@pytest.mark.parametrize("eos", [2, [2, 9], torch.tensor([4, 300])])
def test_min_length_processors_same_as_hf(eos):
    procs = [lp.MinLengthLogitsProcessor(7, eos), lp.MinNewTokensLengthLogitsProcessor(3, 4, eos)]
    fast = accelerate(procs)
    x = _scores("random", v=400)
    for length in (2, 6, 7, 9):
        ids = torch.zeros(3, length, dtype=torch.long)
        for hf, f in zip(procs, fast):
            assert torch.equal(f(ids, x.clone()), hf(ids, x.clone())), (type(hf), length)


@pytest.mark.parametrize("kind", ["random", "ties", "masked", "nan"])
@pytest.mark.parametrize("top_k,keep", [(50, 1), (1, 1), (3, 8), (6000, 1)])
def test_top_k_same_as_hf(kind, top_k, keep):
    hf = lp.TopKLogitsWarper(top_k, min_tokens_to_keep=keep)
    (fast,) = accelerate([hf])
    assert fast is not hf
    ids = torch.zeros(3, 4, dtype=torch.long)
    for seed in range(3):
        x = _scores("ties" if kind == "ties" else "masked" if kind == "masked" else "random",
                    seed=seed)
        if kind == "nan":
            x[1, 17] = math.nan
        ref = hf(ids, x.clone())
        out = fast(ids, x.clone())
        assert torch.equal(out.isnan(), ref.isnan()), (kind, top_k, seed)
        assert torch.equal(out.nan_to_num(), ref.nan_to_num()), (kind, top_k, seed)


@pytest.mark.parametrize("top_k", [50, 40, 200])
def test_top_k_then_top_p_same_as_hf(top_k):
    """The sampling default (top-k 50 before top-p): few finite scores, so the
    cumulative sum covers only the kept tail."""
    procs = [lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(top_k), lp.TopPLogitsWarper(0.9)]
    fast = accelerate(procs)
    assert len(fast) == 2, "top-k and top-p were not fused"
    ids = torch.zeros(2, 4, dtype=torch.long)
    for seed in range(6):
        x = _scores("random", b=2, v=32000, seed=seed)
        ref, out = x.clone(), x.clone()
        for hf in procs:
            ref = hf(ids, ref)
        for f in fast:
            out = f(ids, out)
        assert torch.equal(out, ref), (top_k, seed)
        assert int(torch.isfinite(ref).sum()) < 2 * top_k


def test_top_p_with_nan_scores_as_hf():
    hf = lp.TopPLogitsWarper(0.9)
    (fast,) = accelerate([hf])
    x = _scores("masked")
    x[0, 3] = math.nan
    ids = torch.zeros(3, 4, dtype=torch.long)
    ref, out = hf(ids, x.clone()), fast(ids, x.clone())
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())


def test_unknown_and_subclassed_processors_kept():
    class Mine(lp.TopPLogitsWarper):
        pass

    procs = [lp.TypicalLogitsWarper(0.9), Mine(0.9), lp.EpsilonLogitsWarper(0.01)]
    assert accelerate(procs) == procs


@pytest.mark.parametrize("shape,kept", [((1, 32000), 0.002), ((3, 5000), 0.5), ((2, 700), 1.0),
                                        ((3, 12000), 0.01)])  # draws in chunks across rows
@pytest.mark.parametrize("c_mt", [True, False])
def test_sampler_draws_what_multinomial_draws(monkeypatch, shape, kept, c_mt):
    """Same token and the same generator state after (the next draw agrees too), with
    the uniforms from the C MT19937 or from torch's uniform_."""
    from atb_torch.models import sampler

    if not c_mt:
        monkeypatch.setattr(sampler, "mt19937_uniforms", lambda n, want: None)

    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(*shape, generator=g) * 3, -1)
    probs[torch.rand(*shape, generator=g) > kept] = 0
    probs[:, 0] += 1e-3  # no row left empty
    for seed in range(20):
        torch.manual_seed(seed)
        torch.rand(seed)  # start anywhere in the generator's block
        ref = torch.multinomial(probs, 1).squeeze(1), torch.rand(3)
        torch.manual_seed(seed)
        torch.rand(seed)
        out = sampler.sample(probs), torch.rand(3)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), seed
    assert sampler._verified == [True], "atb's draw did not run (torch.multinomial did)"


@pytest.mark.parametrize("case", ["ties at k", "nan", "top_p removes nothing", "p fill",
                                  "tiny top_p", "few finite", "keep"])
def test_fused_top_k_top_p_edges_same_as_hf(case):
    """The fused pair against Hugging Face's two processors where the fast form must
    step aside or handle an edge: ties at the k-th value, NaN, no cut, top-p's own
    fill value, a cut inside the kept values, fewer finite scores than k."""
    from atb_torch.models import top_p

    assert top_p._tail_softmax_exact(), "the aligned-tail softmax is not exact here"
    k, p, keep, fill = 20, 0.9, 1, -math.inf
    if case == "top_p removes nothing":
        p = 1.0
    elif case == "p fill":
        fill = -1e4
    elif case == "tiny top_p":
        p = 0.05
    elif case == "keep":
        p, keep = 0.05, 7
    procs = [lp.TopKLogitsWarper(k), lp.TopPLogitsWarper(p, filter_value=fill,
                                                          min_tokens_to_keep=keep)]
    fast = accelerate(procs)
    assert len(fast) == 1
    ids = torch.zeros(3, 4, dtype=torch.long)
    for seed, v in ((0, 5000), (1, 5000), (2, 4096), (3, 4096)):  # 4096: the aligned tail
        x = _scores("ties" if case == "ties at k" else "random", v=v, seed=seed)
        if case == "nan":
            x[0, 11] = math.nan
        elif case == "few finite":
            x[:, 10:] = -math.inf
        ref = procs[1](ids, procs[0](ids, x.clone()))
        out = fast[0](ids, x.clone())
        assert torch.equal(out.isnan(), ref.isnan()), (case, seed)
        assert torch.equal(out.nan_to_num(), ref.nan_to_num()), (case, seed)


@pytest.mark.parametrize("bad", ["nan", "inf", "zero row"])
def test_sampler_leaves_invalid_rows_to_multinomial(bad):
    """Rows torch.multinomial refuses are handed to it, so the error is torch's own."""
    from atb_torch.models import sampler

    probs = torch.full((2, 40), 1 / 40)
    if bad == "nan":
        probs[1, 3] = math.nan
    elif bad == "inf":
        probs[0, 0] = math.inf
    else:
        probs[1] = 0
    with pytest.raises(RuntimeError):
        torch.multinomial(probs, 1)
    with pytest.raises(RuntimeError):
        sampler.sample(probs)
