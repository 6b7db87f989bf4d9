"""The C decode kernels: one-token cache attention and RoPE with the cache write,
against float64 NumPy references and torch's scaled_dot_product_attention."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atbcore.backends.cpu_kernels import available
from atbcore.errors import DtypeError, ShapeError
from atbcore.numerics import assert_close

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _ref_attention(q, k, v, lo, n, scale, mask=None):
    """float64 NumPy: q [B, H, D], k/v [B, cap, KV, D] -> [B, H, D]; zeros where all masked."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    b, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, h, d))
    for bi in range(b):
        for hi in range(h):
            keys, vals = k[bi, lo:n, hi // g], v[bi, lo:n, hi // g]
            z = keys @ q[bi, hi] * scale
            if mask is not None:
                z = np.where(mask[bi, lo:n].numpy(), z, -np.inf)
            if np.isneginf(z).all():
                continue
            p = np.exp(z - z.max())
            out[bi, hi] = (p / p.sum()) @ vals
    return out


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,kv,d,lo,n", [(1, 8, 2, 64, 0, 129), (3, 4, 4, 32, 5, 40),
                                           (2, 6, 1, 80, 0, 1), (2, 16, 8, 128, 100, 700)])
def test_decode_attention_matches_references(dt, b, h, kv, d, lo, n):
    from atbcore.backends.cpu_kernels.torch_decode import decode_attention

    g = torch.Generator().manual_seed(b * 100 + h + d + n)
    cap = n + 7
    q = torch.randn(b, h, d, generator=g).to(dt)
    k = torch.randn(b, cap, kv, d, generator=g).to(dt)
    v = torch.randn(b, cap, kv, d, generator=g).to(dt)
    scale = d ** -0.5
    y = decode_attention(q, k, v, n=n, lo=lo, scale=scale)
    assert y.shape == q.shape and y.dtype == dt
    assert_close(y, _ref_attention(q, k, v, lo, n, scale).astype(np.float32), NAMES[dt],
                 "decode_attention")
    sdpa = F.scaled_dot_product_attention(q.float()[:, :, None], k[:, lo:n].float().transpose(1, 2),
                                          v[:, lo:n].float().transpose(1, 2), scale=scale,
                                          enable_gqa=True)[:, :, 0]
    assert_close(y.float(), sdpa, NAMES[dt], "decode_attention vs SDPA")


def test_decode_attention_mask_and_fully_masked_row():
    from atbcore.backends.cpu_kernels.torch_decode import decode_attention

    g = torch.Generator().manual_seed(3)
    b, h, kv, d, cap = 3, 4, 2, 16, 50
    q, k, v = (torch.randn(*s, generator=g) for s in ((b, h, d), (b, cap, kv, d), (b, cap, kv, d)))
    mask = torch.rand(b, cap, generator=g) > 0.4
    mask[2] = False                                    # a row with no real key
    y = decode_attention(q, k, v, n=45, scale=0.3, key_mask=mask)
    ref = _ref_attention(q, k, v, 0, 45, 0.3, mask)
    assert_close(y, ref.astype(np.float32), "fp32", "masked decode_attention")
    assert torch.equal(y[2], torch.zeros(h, d))
    m4 = mask[:2, None, None, :45]
    sdpa = F.scaled_dot_product_attention(q[:2, :, None], k[:2, :45].transpose(1, 2),
                                          v[:2, :45].transpose(1, 2), attn_mask=m4, scale=0.3,
                                          enable_gqa=True)[:, :, 0]
    assert_close(y[:2], sdpa, "fp32", "masked decode_attention vs SDPA")


def test_decode_attention_strided_views_threads_and_bound_out():
    from atbcore.backends.cpu_kernels.threads import parked_torch_threads
    from atbcore.backends.cpu_kernels.torch_decode import decode_attention_bound

    g = torch.Generator().manual_seed(5)
    b, h, kv, d, cap = 2, 8, 2, 64, 4096
    qkv = torch.randn(b, (h + 2 * kv) * d, generator=g)     # q is a strided view of it
    q = qkv[:, :h * d].view(b, h, d)
    cache = torch.randn(2, b, cap, kv, d, generator=g)      # [2, B, cap, KV, D] like the plan's
    out = torch.full((b, h, d), 7.0)
    call = decode_attention_bound(q, cache[0], cache[1], scale=0.125, out=out)
    ref = _ref_attention(q, cache[0], cache[1], 10, 4000, 0.125).astype(np.float32)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):                              # large enough to split across threads
            torch.set_num_threads(threads)
            out.fill_(7.0)
            assert call(10, 4000) is out
            assert_close(out, ref, "fp32", f"bound decode_attention, {threads} threads")
        with parked_torch_threads():
            assert torch.get_num_threads() == 1
            out.fill_(7.0)
            call(10, 4000)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert_close(out, ref, "fp32", "decode_attention with torch parked")


def test_decode_attention_errors_name_the_problem_and_write_nothing():
    from atbcore.backends.cpu_kernels.torch_decode import decode_attention, decode_attention_bound

    q, k = torch.randn(1, 6, 16), torch.randn(1, 10, 4, 16)
    out = torch.zeros(1, 6, 16)
    with pytest.raises(ShapeError, match="multiple of KV heads"):
        decode_attention(q, k, k, n=5, scale=1.0, out=out)
    with pytest.raises(DtypeError, match="v"):
        decode_attention(torch.randn(1, 4, 16), k, k.half(), n=5, scale=1.0)
    call = decode_attention_bound(torch.randn(1, 4, 16), k, k, scale=1.0)
    with pytest.raises(ShapeError, match="key range"):
        call(0, 11)
    with pytest.raises(ShapeError, match="key_mask"):
        decode_attention(torch.randn(1, 4, 16), k, k, n=5, scale=1.0,
                         key_mask=torch.ones(1, 4, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(1, 6, 16))


def _ref_rope(x, cos, sin):
    """rotate-half RoPE in float64: x [..., D], cos/sin [..., D] broadcastable."""
    x = x.double().numpy()
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_rope_cache_bound_rotates_q_and_writes_the_cache_slot(dt):
    from atbcore.backends.cpu_kernels.torch_decode import rope_cache_bound

    g = torch.Generator().manual_seed(11)
    b, hq, hk, d, cap = 2, 4, 2, 32, 20
    qkv = torch.randn(b, (hq + 2 * hk) * d, generator=g).to(dt)
    q, k, v = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d], qkv[:, (hq + hk) * d:]
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    ang = torch.rand(b, 1, d // 2, generator=g, dtype=torch.float64) * 6
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().float(), ang.sin().float()       # per-row tables [B, 1, D]
    cache = torch.zeros(2, b, cap, hk, d, dtype=dt)
    write = rope_cache_bound(q, k, v, cos, sin, cache[0], cache[1], head_dim=d, rotary_dim=d)
    write(13)
    c, s = cos.double().numpy(), sin.double().numpy()     # [B, 1, D] against [B, H, D]
    want_q = _ref_rope(q0.view(b, hq, d), c, s).reshape(b, hq * d)
    want_k = _ref_rope(k0.view(b, hk, d), c, s)
    assert_close(q, want_q.astype(np.float32), NAMES[dt], "q rotated in place")
    assert_close(cache[0, :, 13], want_k.astype(np.float32), NAMES[dt], "rotated k in the cache")
    assert torch.equal(cache[1, :, 13], v0.view(b, hk, d))
    assert torch.equal(k, k0)                             # k itself is read, not rotated
    others = torch.ones(cap, dtype=torch.bool)
    others[13] = False
    assert not cache[:, :, others].any()                  # only slot 13 written
    with pytest.raises(ValueError, match="cache length"):
        write(cap)


@pytest.mark.parametrize("dt,tdt,window", [(torch.float32, torch.int32, None),
                                           (torch.bfloat16, torch.int64, 5),
                                           (torch.float16, torch.int32, 40)])
def test_paged_decode_attention_reads_blocks_in_place(dt, tdt, window):
    from atbcore.backends.cpu_kernels.torch_decode import paged_decode_attention

    g = torch.Generator().manual_seed(21)
    nb, bs, kv, d, h = 40, 4, 2, 64, 8
    kc = torch.randn(nb, bs, kv, d, generator=g).to(dt)
    vc = torch.randn(nb, bs, kv, d, generator=g).to(dt)
    lens = torch.tensor([1, 9, 23], dtype=tdt)
    tables = torch.randperm(nb, generator=g)[:3 * 6].view(3, 6).to(tdt)  # scattered blocks
    q = torch.randn(3, h, d, generator=g).to(dt)
    y = paged_decode_attention(q, kc, vc, tables, lens, scale=0.125, window=window)
    for b, n in enumerate(lens.tolist()):
        k = kc[tables[b].long()].flatten(0, 1)[None]                  # [1, 6*bs, KV, D]
        v = vc[tables[b].long()].flatten(0, 1)[None]
        lo = max(0, n - window) if window else 0
        ref = _ref_attention(q[b:b + 1], k, v, lo, n, 0.125).astype(np.float32)
        assert_close(y[b:b + 1], ref, NAMES[dt], f"paged row {b}")


@pytest.mark.parametrize("rows", [12, 5])  # a chunk per row / per (row, kv head)
def test_paged_decode_attention_uneven_rows_split_over_threads(rows):
    """Rows of uneven lengths (a zero-length one, ties, unsorted) big enough to split
    over the pool: the longest rows go first, each row's output equals the float64
    reference, and one or two threads give the same bits."""
    from atbcore.backends.cpu_kernels.threads import parked_torch_threads
    from atbcore.backends.cpu_kernels.torch_decode import paged_decode_attention

    g = torch.Generator().manual_seed(rows)
    bs, kv, d, h, width = 16, 2, 64, 8, 40
    nb = rows * width
    kc, vc = torch.randn(nb, bs, kv, d, generator=g), torch.randn(nb, bs, kv, d, generator=g)
    tables = torch.randperm(nb, generator=g).view(rows, width).to(torch.int32)
    lens = torch.tensor([300, 0, 17, 640, 300, 5, 129, 640, 64, 1, 250, 333][:rows],
                        dtype=torch.int32)
    q = torch.randn(rows, h, d, generator=g)
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with parked_torch_threads():
                outs.append(paged_decode_attention(q, kc, vc, tables, lens, scale=0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    for b, n in enumerate(lens.tolist()):
        k = kc[tables[b].long()].flatten(0, 1)[None]
        v = vc[tables[b].long()].flatten(0, 1)[None]
        ref = _ref_attention(q[b:b + 1], k, v, 0, n, 0.125).astype(np.float32)
        assert_close(outs[1][b:b + 1], ref, "fp32", f"row {b} of {rows} ({n} keys)")


def test_paged_decode_attention_mqa_and_bad_lengths():
    from atbcore.backends.cpu_kernels.torch_decode import paged_decode_attention

    g = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(8, 4, 1, 16, generator=g), torch.randn(8, 4, 1, 16, generator=g)
    q = torch.randn(2, 2, 16, generator=g)
    tables = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    ref = torch.cat([F.scaled_dot_product_attention(
        q[b, :, None], kc[tables[b].long()].flatten(0, 1)[:n].transpose(0, 1),
        vc[tables[b].long()].flatten(0, 1)[:n].transpose(0, 1), scale=0.25,
        enable_gqa=True)[None, :, 0] for b, n in enumerate(lens.tolist())])
    y = paged_decode_attention(q, kc, vc, tables, lens, scale=0.25)
    assert_close(y, ref, "fp32", "paged decode attention (MQA) vs SDPA")
    out = torch.zeros(2, 2, 16)
    with pytest.raises(ShapeError, match="context_lens"):
        paged_decode_attention(q, kc, vc, tables, torch.tensor([5, 9], dtype=torch.int32),
                               scale=0.25, out=out)
    assert torch.equal(out, torch.zeros(2, 2, 16))                    # nothing written


@pytest.mark.parametrize("dt,sdt", [(torch.float32, torch.int32), (torch.bfloat16, torch.int64)])
def test_reshape_and_cache_copies_rows_to_slots(dt, sdt):
    from atbcore.backends.cpu_kernels.torch_decode import reshape_and_cache

    g = torch.Generator().manual_seed(4)
    nb, bs, kv, d = 5, 4, 2, 8
    kc, vc = torch.zeros(nb, bs, kv, d, dtype=dt), torch.zeros(nb, bs, kv, d, dtype=dt)
    k = torch.randn(4, kv * d, generator=g).to(dt)
    v = torch.randn(4, kv * d, generator=g).to(dt)
    slots = torch.tensor([7, -1, 0, 19], dtype=sdt)                   # -1: padding, not stored
    assert reshape_and_cache(k, v, kc, vc, slots)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // bs, s % bs] = k[t].view(kv, d)
            want_v[s // bs, s % bs] = v[t].view(kv, d)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    before = kc.clone()
    with pytest.raises(ShapeError, match="slot_mapping"):
        reshape_and_cache(k, v, kc, vc, torch.tensor([1, 2, 20, 3], dtype=sdt))
    assert torch.equal(kc, before)                                    # nothing written
    assert not reshape_and_cache(k.half(), v.half(), kc, vc, slots)  # dtype mismatch: caller's path


def test_reshape_and_cache_bound_reads_the_slots_of_each_call():
    """The bound copy packs its arguments once; each call writes at the slots the
    slot tensor holds then, and a bad slot raises with nothing written."""
    from atbcore.backends.cpu_kernels.torch_decode import reshape_and_cache_bound

    nb, bs, kv, d = 3, 4, 2, 16
    kc, vc = torch.zeros(nb, bs, kv, d), torch.zeros(nb, bs, kv, d)
    k, v = torch.randn(2, kv, d), torch.randn(2, kv, d)
    slots = torch.tensor([0, 5], dtype=torch.int32)
    call = reshape_and_cache_bound(k, v, kc, vc, slots)
    for step in range(3):
        slots.copy_(torch.tensor([step, 5 + step], dtype=torch.int32))
        k.add_(1.0)                                                    # new rows, same buffers
        call()
        assert torch.equal(kc[0, step], k[0]) and torch.equal(vc[1, 1 + step], v[1])
    before = kc.clone()
    slots.copy_(torch.tensor([3, 12], dtype=torch.int32))
    with pytest.raises(ShapeError, match="slot_mapping"):
        call()
    assert torch.equal(kc, before)
    assert reshape_and_cache_bound(k.half(), v, kc, vc, slots) is None


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_matches_torch_including_ties_nan_and_inf(dt):
    from atbcore.backends.cpu_kernels.torch_decode import argmax_rows

    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 3001, generator=g).to(dt)
    x[1, 2000] = float("nan")                           # a NaN wins (torch's rule)
    x[1, 2500] = float("nan")
    x[2] = float("-inf")                                # all -inf: index 0
    x[3, 10] = x[3, 2999] = 50.0                        # a tie: the first
    x[4, 3000] = float("inf")
    want = torch.argmax(x, dim=-1)
    assert torch.equal(argmax_rows(x), want)
    assert want.tolist()[1:4] == [2000, 0, 10]
    assert torch.equal(argmax_rows(x[:, ::2]), torch.argmax(x[:, ::2], dim=-1))  # strided rows
    assert torch.equal(argmax_rows(x[::2]), want[::2])               # rows apart, 2-D
    got = argmax_rows(x.view(2, 3, 3001))                             # [.., V]: shape kept
    assert got.shape == (2, 3) and torch.equal(got.reshape(-1), want)
    one = argmax_rows(x[4])                                           # one row, 1-D: 0-d
    assert one.shape == () and int(one) == 3000


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [8, 24, 40, 72, 17])
def test_decode_attention_head_dims_groups_and_key_tails(dt, d):
    """The register tiles' edges (AVX2 builds: 8 keys per score tile, 64 keys per
    value pass, 2 heads x 4 vectors per value tile): head dims with 1..4-vector tails
    and one that is no multiple of 8 (the plain loops), odd groups (G = 3, a one-head
    tile), MHA and GQA, 1..600 keys from several starts, against float64 and SDPA; one and two
    threads give the same bits."""
    from atbcore.backends.cpu_kernels.threads import parked_torch_threads
    from atbcore.backends.cpu_kernels.torch_decode import decode_attention

    g = torch.Generator().manual_seed(d)
    before = torch.get_num_threads()
    try:
        for h, kv in ((3, 1), (8, 2), (2, 2)):
            q = torch.randn(2, h, d, generator=g).to(dt)
            k, v = (torch.randn(2, 605, kv, d, generator=g).to(dt) for _ in range(2))
            for lo, n in ((0, 1), (3, 10), (0, 8), (1, 65), (0, 129), (5, 600)):
                outs = []
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    with parked_torch_threads():
                        outs.append(decode_attention(q, k, v, n=n, lo=lo, scale=d ** -0.5))
                assert torch.equal(outs[0], outs[1]), (h, kv, lo, n)
                ref = _ref_attention(q, k, v, lo, n, d ** -0.5).astype(np.float32)
                assert_close(outs[0].float(), ref, NAMES[dt],
                             f"decode_attention {h}/{kv} [{lo},{n})")
                sdpa = F.scaled_dot_product_attention(
                    q.float()[:, :, None], k[:, lo:n].float().transpose(1, 2),
                    v[:, lo:n].float().transpose(1, 2), scale=d ** -0.5, enable_gqa=True)[:, :, 0]
                assert_close(outs[0].float(), sdpa, NAMES[dt], f"vs SDPA {h}/{kv} [{lo},{n})")
    finally:
        torch.set_num_threads(before)
