"""Numerics at the edges (issue 19): NaN/Inf propagate as in torch's plain
arithmetic, a negative attention scale is computed (not NaN), a huge window is
plain causal attention, an all-NaN softmax row stays NaN, the NumPy reference
matches torch on non-finite q/k, and sampling treats NaN logits by one rule on
every backend. Second oracle: torch.nn.functional written out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb

BACKENDS = ["torch", "numpy"]
NAN, INF = float("nan"), float("inf")


def run(op, params, inputs, backend):
    ins = [x.clone() if backend == "torch" else x.numpy().copy() for x in inputs]
    out = atb.Builder(backend=backend).build_operation(op, params).execute(ins)
    return [o if isinstance(o, torch.Tensor) else torch.from_numpy(np.asarray(o)) for o in out]


def same_nonfinite(got, want):
    """NaN where want is NaN, the same infinities, finite values close."""
    got, want = got.double(), want.double()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isposinf(), want.isposinf()) and torch.equal(got.isneginf(), want.isneginf())
    fin = want.isfinite()
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-5)


def math_attention(q, k, v, scale, causal):
    """q [B, H, S, D], k/v [B, H, S, D]: softmax(q k^T * scale, causal) v, masked keys
    dropped before the softmax (so a NaN there does not leak)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -INF)
    return torch.softmax(s, -1) @ v.double()


def poisoned(shape, value, seed=0, where=((0, 0, 1, 2),)):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    for idx in where:
        x[idx] = value
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_elementwise_and_norm_ops_propagate_like_torch(backend, value):
    x = poisoned((2, 3, 8), value, where=((0, 1, 2),))
    w = torch.randn(8)
    same_nonfinite(run("RmsNorm", {"eps": 1e-6}, [x, w], backend)[0],
                   F.rms_norm(x.double(), (8,), w.double(), eps=1e-6))
    same_nonfinite(run("LayerNorm", {}, [x, w, w], backend)[0],
                   F.layer_norm(x.double(), (8,), w.double(), w.double()))
    same_nonfinite(run("Softmax", {}, [x], backend)[0], torch.softmax(x.double(), -1))
    same_nonfinite(run("Relu", {}, [x], backend)[0], F.relu(x.double()))
    same_nonfinite(run("Elewise", {"elewise_type": "add"}, [x, x], backend)[0], x.double() * 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal, seq", [(True, 7), (False, 7), (True, 80)])
def test_negative_scale_is_computed(backend, causal, seq):
    # 80 x 80 scores: the C attention on the CPU; 7: torch SDPA, whose causal kernel
    # alone gives 75% NaN for a negative scale
    q, k, v = (torch.randn(1, 2, seq, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    out, = run("FlashAttention", {"scale": -0.3, "causal": causal}, [q, k, v], backend)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), math_attention(q, k, v, -0.3, causal),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_flash_attention_negative_scale_matches_its_parts(backend):
    q, k, v = (torch.randn(1, 6, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    params = {"num_heads": 2, "causal": True, "scale": -0.3, "layout": "BSND"}
    fused, = run("RopeFlashAttention", params, [q, k, v], backend)
    qr, kr = run("RoPE", {"layout": "BSND"}, [q, k], "numpy")
    want = math_attention(qr.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2), -0.3, True)
    assert fused.isfinite().all()
    torch.testing.assert_close(fused.double(), want.transpose(1, 2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seq", [7, 80])
def test_window_past_int32_is_causal_attention(backend, seq):
    q, k, v = (torch.randn(2, seq, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    base = {"num_heads": 2}
    causal, = run("FlashAttention", {**base, "causal": True}, [q, k, v], backend)
    for window in (2 ** 32 + 1, 2 ** 31, 2 ** 40):
        wide, = run("FlashAttention", {**base, "window": window}, [q, k, v], backend)
        torch.testing.assert_close(wide, causal, rtol=1e-5, atol=1e-6)
    near, = run("FlashAttention", {**base, "window": 3}, [q, k, v], backend)
    assert (near - causal).abs().max() > 1e-3  # a real window still changes the result


def test_paged_attention_window_past_int32_is_causal():
    from atbcore.ops.samples import sample_call

    params, ins = sample_call("PagedAttention")
    t = [torch.from_numpy(x) for x in ins]
    plain, = run("PagedAttention", params, t, "torch")
    wide, = run("PagedAttention", {**params, "window": 2 ** 32 + 1}, t, "torch")
    ref, = run("PagedAttention", {**params, "window": 2 ** 32 + 1}, t, "numpy")
    torch.testing.assert_close(wide, plain)
    torch.testing.assert_close(wide, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("where", ["q", "k"])
def test_attention_reference_matches_torch_on_nonfinite_qk(backend, value, where):
    q, k, v = (torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    (q if where == "q" else k)[0, 0, 2, 3] = value
    out, = run("FlashAttention", {"causal": True}, [q, k, v], backend)
    want = math_attention(q, k, v, 8 ** -0.5, True)
    same_nonfinite(out, want)
    if where == "k" and value != value:  # rows before a NaN key do not see it: finite
        assert out[0, 0, :2].isfinite().all() and out[0, 0, 2:].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_scaled_masked_softmax_keeps_all_nan_rows_nan(backend, causal):
    x = torch.randn(2, 4, 4)
    x[0, 1] = NAN
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[3] = False  # row 3: every key masked -> zeros by definition
    y, = run("ScaledMaskedSoftmax", {"causal": causal, "scale": 0.5}, [x, mask], backend)
    assert y[0, 1].isnan().all()
    assert torch.equal(y[:, 3], torch.zeros(2, 4))
    keep = mask & (torch.ones(4, 4, dtype=torch.bool).tril() if causal else mask)
    want = torch.softmax((x.double() * 0.5).masked_fill(~keep, -INF), -1)
    torch.testing.assert_close(y[1, :3].double(), want[1, :3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_sampling_with_nan_logits_is_the_same_on_both_backends(temperature, seed):
    logits = torch.randn(6, 12, generator=torch.Generator().manual_seed(seed))
    logits[0, 3] = logits[0, 5] = NAN       # NaN counts as -inf: never picked
    logits[1] = NAN                         # nothing to pick from: id 0
    logits[2] = -INF
    logits[3, [2, 7]] = INF                 # +inf logits share the mass
    logits[4, ::2] = NAN
    params = {"temperature": temperature, "seed": seed, "top_p": 0.9}
    got, = run("TopkToppSampling", params, [logits], "torch")
    ref, = run("TopkToppSampling", params, [logits], "numpy")
    assert torch.equal(got, ref)
    assert got[0].item() not in (3, 5) and got[4].item() % 2 == 1
    assert got[1].item() == 0 and got[2].item() == 0 and got[3].item() in (2, 7)
    finite = torch.where(logits[5].isnan(), -INF, logits[5])
    if temperature == 0.0:
        assert got[5].item() == int(finite.argmax())
