"""The C prefill attention (csrc/flash.c): packed variable-length sequences and padded
batches, against the op's float64 NumPy reference and torch's scaled_dot_product_attention;
and the FlashAttention op taking it on the CPU (the packed LLM prefill's use is tested
with the model runner)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from atbcore.backends.cpu_kernels import available
from atbcore.backends.cpu_kernels.counting import LaunchCounter
from atbcore.errors import DtypeError, ShapeError
from atbcore.numerics import assert_close
from atbcore.ops.attention import ref_attention

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _packed(lens, h, kv, d, dt, seed, kv_lens=None):
    """q [T, H, D] and k/v [Tk, KV, D] as slices of one packed QKV buffer (strided)."""
    g = torch.Generator().manual_seed(seed)
    t, tk = sum(lens), sum(kv_lens or lens)
    q = torch.randn(t, (h + 2) * d, generator=g).to(dt)[:, :h * d].view(t, h, d)
    kvb = torch.randn(tk, 2 * kv * d, generator=g).to(dt)
    return q, kvb[:, :kv * d].view(tk, kv, d), kvb[:, kv * d:].view(tk, kv, d)


def _ref_packed(q, k, v, lens, kv_lens, scale, causal, window):
    """float64 NumPy reference per sequence: [T, H, D]."""
    out, a, c = [], 0, 0
    for nq, nk in zip(lens, kv_lens):
        qs = q[a:a + nq].double().numpy().transpose(1, 0, 2)[None]
        ks = k[c:c + nk].double().numpy().transpose(1, 0, 2)[None]
        vs = v[c:c + nk].double().numpy().transpose(1, 0, 2)[None]
        if nq:
            out.append(ref_attention(qs, ks, vs, scale=scale, causal=causal,
                                     window=window)[0].transpose(1, 0, 2))
        a, c = a + nq, c + nk
    return np.concatenate(out) if out else np.zeros((0,) + tuple(q.shape[1:]))


def _sdpa_packed(q, k, v, lens, scale, window=None):
    """torch SDPA per sequence (causal, equal q and kv lengths)."""
    out, a = [], 0
    for n in lens:
        qs, ks, vs = (x[a:a + n].float().transpose(0, 1)[None] for x in (q, k, v))
        if window:
            i = torch.arange(n)
            m = (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, scale=scale,
                                               enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=True)
        out.append(o[0].transpose(0, 1))
        a += n
    return torch.cat(out)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,kv,d", [(8, 2, 64), (4, 4, 32), (6, 1, 80), (4, 2, 128), (2, 1, 256)])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 7)])
def test_packed_matches_references(dt, h, kv, d, causal, window):
    from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention

    lens = [1, 5, 63, 64, 65, 130] if d <= 128 else [3, 70]
    q, k, v = _packed(lens, h, kv, d, dt, seed=h * 7 + d)
    scale = d ** -0.5
    y = prefill_attention(q, k, v, scale=scale, q_lens=lens, causal=causal, window=window)
    assert y.shape == q.shape and y.dtype == dt
    ref = _ref_packed(q, k, v, lens, lens, scale, causal, window)
    assert_close(y, ref.astype(np.float32), NAMES[dt], "prefill_attention vs NumPy")
    if causal:
        assert_close(y.float(), _sdpa_packed(q, k, v, lens, scale, window), NAMES[dt],
                     "prefill_attention vs SDPA")


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_padded_batch_kv_lens_and_bottom_right_rows(dt):
    """[B, Sq, H, D] against [B, Skv, KV, D] with per-row key counts: chunked prefill
    (Sq < L: rows at the end), a right-padded row (Sq > L) and a row with no keys."""
    from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention

    g = torch.Generator().manual_seed(5)
    b, sq, skv, h, kv, d = 4, 37, 90, 4, 2, 64
    q = torch.randn(b, sq, h, d, generator=g).to(dt)
    k = torch.randn(b, skv, kv, d, generator=g).to(dt)
    v = torch.randn(b, skv, kv, d, generator=g).to(dt)
    lens = [90, 50, 20, 0]
    out = torch.full((b, sq, h, d), 7.0, dtype=dt)
    for causal, window in ((True, None), (False, None), (True, 9)):
        prefill_attention(q, k, v, scale=0.2, kv_lens=lens, causal=causal, window=window,
                          out=out)
        ref = ref_attention(q.double().numpy().transpose(0, 2, 1, 3),
                            k.double().numpy().transpose(0, 2, 1, 3),
                            v.double().numpy().transpose(0, 2, 1, 3), scale=0.2, causal=causal,
                            window=window, kv_lens=lens).transpose(0, 2, 1, 3)
        assert_close(out, ref.astype(np.float32), NAMES[dt], f"padded causal={causal} w={window}")
        assert (out[3] == 0).all()  # no key: zeros


def test_bnsd_views_and_strided_out():
    """Transposed (BNSD) inputs and an output view with gaps are read and written in place."""
    from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention

    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 8, 300, 64, generator=g)          # [B, H, S, D]
    k, v = torch.randn(2, 2, 300, 64, generator=g), torch.randn(2, 2, 300, 64, generator=g)
    buf = torch.zeros(2, 300, 8, 80)
    out = buf[..., 8:72]
    prefill_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.125,
                      out=out)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert_close(out, sdpa.transpose(1, 2), "fp32", "BNSD views")
    assert (buf[..., :8] == 0).all() and (buf[..., 72:] == 0).all()


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,kv,d", [(12, 12, 32), (6, 2, 20), (3, 1, 36), (5, 5, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_query_lanes_any_head_dim(dt, h, kv, d, causal):
    """Queries of whole 8-lane groups are widened and transposed 8 x 8 in registers
    (AVX2 builds; bf16 pairs where VDPBF16PS runs them), the rest lane by lane: head
    dims with a tail past the last 8, lane counts (rows x query heads per KV head)
    below, at and past multiples of 8. Against the float64 reference; one thread and
    two bit-equal; the packed-QKV strided q gives the bits of its contiguous copy."""
    from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention

    lens = [1, 2, 3, 8, 9, 16, 17, 66, 131]
    q, k, v = _packed(lens, h, kv, d, dt, seed=h * 11 + d)
    scale = d ** -0.5
    two = prefill_attention(q, k, v, scale=scale, q_lens=lens, causal=causal)
    ref = _ref_packed(q, k, v, lens, lens, scale, causal, None)
    assert_close(two, ref.astype(np.float32), NAMES[dt], "prefill_attention vs NumPy")
    assert torch.equal(two, prefill_attention(q.contiguous(), k, v, scale=scale, q_lens=lens,
                                              causal=causal))
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = prefill_attention(q, k, v, scale=scale, q_lens=lens, causal=causal)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def test_threads_agree_and_run_on_torch_team():
    """One thread and two give the same result; big jobs go to the OpenMP team."""
    from atbcore.backends.cpu_kernels import bindings
    from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention

    lens = [200, 13, 77]
    q, k, v = _packed(lens, 8, 2, 64, torch.float32, seed=3)
    before = bindings.pool_stats()["team_jobs"]
    two = prefill_attention(q, k, v, scale=0.125, q_lens=lens)
    used_team = bindings.pool_stats()["team_jobs"] > before
    with torch.no_grad():
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            one = prefill_attention(q, k, v, scale=0.125, q_lens=lens)
        finally:
            torch.set_num_threads(old)
    assert torch.equal(one, two)
    assert used_team == (torch.get_num_threads() > 1)


def test_bad_inputs_raise_and_write_nothing():
    from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention

    lens = [4, 6]
    q, k, v = _packed(lens, 4, 2, 16, torch.float32, seed=1)
    out = torch.full(q.shape, 3.0)
    bad = [
        (ShapeError, dict(q_lens=[4, 5])),                      # lengths do not sum to T
        (ShapeError, dict(q_lens=[11, -1])),
        (ShapeError, dict(q_lens=None)),                        # packed needs lengths
        (ShapeError, dict(q_lens=lens, kv_lens=[4])),
        (ShapeError, dict(q_lens=lens, window=0)),
    ]
    for err, kw in bad:
        with pytest.raises(err, match="prefill_attention"):
            prefill_attention(q, k, v, scale=1.0, out=out, **kw)
    with pytest.raises(ShapeError, match="head_dim"):
        prefill_attention(torch.zeros(2, 1, 512), torch.zeros(2, 1, 512), torch.zeros(2, 1, 512),
                          scale=1.0, q_lens=[2])
    with pytest.raises(ShapeError, match="heads"):
        prefill_attention(torch.zeros(2, 3, 16), torch.zeros(2, 2, 16), torch.zeros(2, 2, 16),
                          scale=1.0, q_lens=[2])
    with pytest.raises(DtypeError, match="prefill_attention"):
        prefill_attention(q, k.double(), v.double(), scale=1.0, q_lens=lens)
    with pytest.raises(ShapeError, match="kv_lens"):
        prefill_attention(q.view(1, 10, 4, 16), k.reshape(1, 10, 2, 16), v.reshape(1, 10, 2, 16),
                          scale=1.0, kv_lens=[11], out=out.view(1, 10, 4, 16))
    assert (out == 3.0).all()


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(0, 150), min_size=1, max_size=5),
       g=st.sampled_from([1, 2, 4, 8]), window=st.sampled_from([None, 1, 5, 64]))
def test_random_packings_match_reference(lens, g, window):
    from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention

    if sum(lens) == 0:
        lens = lens + [1]
    kv = 2 if g <= 4 else 1
    q, k, v = _packed(lens, g * kv, kv, 32, torch.float32, seed=sum(lens) + g)
    y = prefill_attention(q, k, v, scale=0.3, q_lens=lens, window=window)
    assert_close(y, _ref_packed(q, k, v, lens, lens, 0.3, True, window).astype(np.float32),
                 "fp32", f"lens {lens} g {g} window {window}")


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("params,sq,skv,lens", [
    ({"causal": True}, 260, 260, None),                  # long causal: C
    ({"causal": True}, 9, 40, None),                     # chunked prefill rows: C
    ({"window": 16}, 70, 70, None),                      # window: C
    ({"causal": False}, 12, 30, [30, 17]),               # per-row key counts: C
    ({"causal": False}, 80, 80, None),                   # full attention, big enough: C
])
def test_flash_attention_op_takes_c_kernel(layout, params, sq, skv, lens):
    """The FlashAttention op's torch kernel runs the C prefill attention on the CPU
    where positions apply, one launch, equal to the reference."""
    import atbcore as atb

    g = torch.Generator().manual_seed(sq + skv)
    b, h, kv, d = 2, 4, 2, 32
    q = torch.randn(b, h, sq, d, generator=g)
    k, v = torch.randn(b, kv, skv, d, generator=g), torch.randn(b, kv, skv, d, generator=g)

    def lay(x):
        return {"BNSD": x, "BSND": x.transpose(1, 2).contiguous(),
                "BSH": x.transpose(1, 2).reshape(b, x.shape[2], -1)}[layout]
    op = atb.Builder(backend="torch").build_operation(
        "FlashAttention", dict(params, num_heads=h, num_kv_heads=kv, layout=layout))
    ins = [lay(q), lay(k), lay(v)] + ([torch.tensor(lens, dtype=torch.int32)] if lens else [])
    with LaunchCounter() as c:
        out, = op.execute(ins)
    assert c.ops == ["prefill_attention"]
    scale = d ** -0.5
    ref = ref_attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), scale=scale,
                        causal=params.get("causal", False), window=params.get("window"),
                        kv_lens=lens)
    assert_close(out, lay(torch.from_numpy(ref).float()), "fp32", f"FlashAttention {layout}")


def test_tiny_blocks_run_the_c_kernel_and_keep_nan_rows():
    """A block under 64 x 64 scores also runs the C kernel: torch's fused SDPA drops
    the NaN of a row whose only visible key is NaN (issue 19), the C kernel does not."""
    import atbcore as atb

    q, k, v = (torch.randn(1, 8, 4, 16) for _ in range(3))
    op = atb.Builder(backend="torch").build_operation("FlashAttention",
                                                      {"num_heads": 4, "layout": "BSND"})
    with LaunchCounter() as c:
        out, = op.execute([q, k, v])
    assert c.ops == ["prefill_attention"]
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert_close(out, sdpa.transpose(1, 2), "fp32", "tiny block")
    k[0, 0, 0, 0] = float("nan")  # head 0's key 0: the only key row 0 sees under causal
    causal = atb.Builder(backend="torch").build_operation(
        "FlashAttention", {"num_heads": 4, "layout": "BSND", "causal": True})
    out, = causal.execute([q, k, v])
    assert out[:, :, 0].isnan().all()  # every row of head 0 sees key 0
    assert out[:, :, 1:].isfinite().all()


def test_masked_call_logs_why_sdpa_ran(caplog):
    """An explicit mask keeps SDPA, and the log says so (once at INFO)."""
    import logging

    import atbcore as atb

    q, k, v = (torch.randn(1, 100, 2, 16) for _ in range(3))
    mask = torch.rand(100, 100) > 0.3
    op = atb.Builder(backend="torch").build_operation("FlashAttention",
                                                      {"num_heads": 2, "layout": "BSND"})
    with caplog.at_level(logging.DEBUG, logger="atb"), LaunchCounter() as c:
        out, = op.execute([q, k, v, mask])
    assert "prefill_attention" not in c.ops
    assert any("FlashAttention: C kernel skipped (an explicit mask)" in r.getMessage()
               for r in caplog.records)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask)
    assert_close(out, ref.transpose(1, 2), "fp32", "masked")
