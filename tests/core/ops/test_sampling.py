"""Argmax and TopkToppSampling: torch vs NumPy reference, torch.argmax oracle,
seeded determinism shared by both backends, support of the top-k/top-p set over
many seeds, and the empirical distribution against the renormalised one."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand

# chi-square critical values at alpha = 1e-3 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df))
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}


def _t(a):
    return atb.tensor.to_torch(np.array(a, copy=True))


def sample(logits, params, backend):
    op = atb.Builder(backend=backend).build_operation("TopkToppSampling", params)
    x = _t(logits) if backend == "torch" else np.array(logits, copy=True)
    ids, = op.execute([x])
    return atb.tensor.to_numpy(ids).copy()


def sample_both(logits, params):
    """Sampled ids; asserts the torch and NumPy backends agree exactly."""
    a, b = sample(logits, params, "torch"), sample(logits, params, "numpy")
    assert a.dtype == np.int64
    np.testing.assert_array_equal(a, b, err_msg=f"torch vs numpy, {params}")
    return a


def allowed_probs(row, top_k, top_p, temperature):
    """Independent oracle: token -> probability after top-k, top-p and renormalising."""
    z = np.asarray(row, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    if top_k:
        order = order[:top_k]
    total = sum(p[i] for i in order)
    kept, acc = [], 0.0
    for i in order:
        kept.append(i)
        acc += p[i] / total
        if acc >= top_p:
            break
    z = sum(p[i] for i in kept)
    return {i: p[i] / z for i in kept}


# ----------------------------------------------------------------------------- Argmax


@pytest.mark.parametrize("dtype", FLOATS + ["int32"])
@pytest.mark.parametrize("shape,dim,keepdim", [((5, 33), -1, False), ((2, 7, 3), 1, True),
                                               ((9,), 0, False), ((4, 6), 0, True)])
def test_argmax(dtype, shape, dim, keepdim):
    if dtype == "int32":
        x = np.random.default_rng(1).integers(-5, 5, size=shape).astype(np.int32)  # many ties
    else:
        x = rand(shape, dtype, 1)
    params = {"dim": dim, "keepdim": keepdim}
    ref, = check_op("Argmax", params, [x])
    assert ref.dtype == np.int64
    op = atb.Builder().build_operation("Argmax", {"axis": dim, "keep_dim": keepdim})
    got, = op.execute([_t(x)])
    assert torch.equal(got, torch.argmax(_t(x), dim=dim, keepdim=keepdim))


def test_argmax_ties_take_the_first():
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], np.float16)
    ref, = check_op("Argmax", {}, [x])
    assert ref.tolist() == [1, 0]


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("dtype", FLOATS)
def test_same_seed_same_ids_on_both_backends(dtype):
    logits = rand((8, 50), dtype, 2, scale=2.0)
    params = {"top_k": 20, "top_p": 0.9, "temperature": 0.7, "seed": 1234}
    first = sample_both(logits, params)
    np.testing.assert_array_equal(first, sample_both(logits, params))
    # Other seeds do change the draw (a flat-ish distribution over 20 tokens).
    others = {tuple(sample_both(logits, dict(params, seed=s))) for s in range(10)}
    assert len(others) > 5


def test_follows_the_specified_inverse_cdf():
    """ids[b] = first token, in descending-probability order, whose cumulative
    probability exceeds u_b = default_rng(seed).random(B)[b]."""
    logits = rand((6, 11), "fp32", 3)
    for seed in (0, 7, 99):
        ids = sample_both(logits, {"seed": seed})
        u = np.random.default_rng(seed).random(6)
        for b in range(6):
            probs = allowed_probs(logits[b], 0, 1.0, 1.0)
            acc, pick = 0.0, None
            for tok in sorted(probs, key=lambda i: (-probs[i], i)):
                acc += probs[tok]
                if acc > u[b]:
                    pick = tok
                    break
            assert ids[b] == pick, (seed, b)


@pytest.mark.parametrize("dtype", FLOATS)
def test_top_k_1_and_temperature_0_are_argmax(dtype):
    logits = rand((7, 40), dtype, 4)
    want = np.argmax(logits.astype(np.float64), axis=-1)
    for seed in range(5):
        np.testing.assert_array_equal(sample_both(logits, {"top_k": 1, "top_p": 0.5,
                                                           "temperature": 1.3, "seed": seed}), want)
        np.testing.assert_array_equal(sample_both(logits, {"temperature": 0.0, "top_k": 5,
                                                           "seed": seed}), want)


@pytest.mark.parametrize("top_k,top_p,temperature", [(8, 1.0, 1.0), (0, 0.6, 1.0),
                                                     (10, 0.5, 0.5), (3, 0.99, 2.0)])
def test_never_samples_outside_top_k_top_p(top_k, top_p, temperature):
    logits = rand((16, 40), "fp16", 5, scale=1.5)
    allowed = [allowed_probs(row, top_k, top_p, temperature) for row in logits.astype(np.float64)]
    seen = [set() for _ in range(16)]
    for seed in range(60):
        ids = sample_both(logits, {"top_k": top_k, "top_p": top_p, "temperature": temperature,
                                   "seed": seed})
        for b, tok in enumerate(ids):
            assert tok in allowed[b], (seed, b, tok, sorted(allowed[b]))
            seen[b].add(int(tok))
    # The filter is not trivially tight: rows with several candidates do vary.
    assert sum(len(s) for s in seen) > 16


@pytest.mark.parametrize("logits,params", [
    ([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0], {"top_k": 5, "top_p": 0.9, "temperature": 0.8}),
    ([0.3, -1.0, 1.2, 0.0, 2.0, -0.5], {}),
    ([1.0, 1.0, 0.5, 3.0, -2.0], {"top_p": 0.9}),  # keeps 3 tokens, two of them tied
])
def test_empirical_distribution_matches(logits, params):
    """10 000 draws (250 identical rows x seeds 0..39, fixed, so the test is
    deterministic) against the renormalised distribution, chi-square at 1e-3."""
    rows = np.tile(np.array(logits, np.float32), (250, 1))
    want = allowed_probs(logits, params.get("top_k", 0), params.get("top_p", 1.0),
                         params.get("temperature", 1.0))
    counts = np.zeros(len(logits))
    for seed in range(40):
        counts += np.bincount(sample_both(rows, dict(params, seed=seed)), minlength=len(logits))
    n = counts.sum()
    assert all(counts[i] == 0 for i in range(len(logits)) if i not in want)
    chi2 = sum((counts[i] - n * q) ** 2 / (n * q) for i, q in want.items())
    assert chi2 < CHI2_999[len(want) - 1], (chi2, counts, want)


X = rand((2, 8))
OUT = [np.zeros(2, np.int64)]
BAD = [
    ("TopkToppSampling", {}, [rand((8,))], atb.ShapeError, ["'logits'", "rank 2"]),
    ("TopkToppSampling", {}, [X.astype(np.int32)], atb.DtypeError, ["'logits'", "INT32"]),
    ("TopkToppSampling", {}, [rand((2, 0))], atb.ShapeError, ["empty"]),
    ("TopkToppSampling", {}, [], atb.InputError, ["number of inputs"]),
    ("Argmax", {"dim": 2}, [X], atb.ShapeError, ["dim 2", "out of range"]),
    ("Argmax", {}, [X.astype(bool)], atb.DtypeError, ["BOOL"]),
    ("Argmax", {}, [rand((2, 0))], atb.ShapeError, ["empty"]),
    ("Argmax", {}, [X, X], atb.InputError, ["number of inputs"]),
]


@pytest.mark.parametrize("op,params,inputs,exc,frags", BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(op, params, inputs, exc, frags):
    check_error(op, params, inputs, exc, *frags, outputs=OUT)


def test_bad_outputs_leave_them_untouched():
    check_error("TopkToppSampling", {}, [X], atb.DtypeError, "output",
                outputs=[np.zeros(2, np.int32)])
    check_error("Argmax", {}, [X], atb.InputError, "number of outputs", outputs=OUT * 2)


@pytest.mark.parametrize("params,frag", [
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"), ({"temperature": -0.1}, "temperature"), ({"seed": -3}, "seed"),
    ({"seed": "abc"}, "seed"), ({"topk": 2, "top_k": 3}, "given twice"),
])
def test_bad_params(params, frag):
    check_error("TopkToppSampling", params, [], atb.ParamsError, frag, build_error=True)
