"""Decode attention's chunks of whole rows (a batch of at least 4 rows per thread):
a row's kv heads are read together, as many at a time as its key and value rows
fit in L2 (all of them, a few, or one for long rows), and each head's output has
the same bits as when the row is split per kv head over two threads (fewer than 8
rows), and matches the float64 reference: paged fp32/bf16/fp16 caches with GQA,
a sliding window and a contiguous cache with a key mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.numerics import assert_close

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _ref(q, k, v, lens, window=0, mask=None):
    """float64: q [B, H, D], k/v [B, cap, KV, D], row b's keys [lo_b, lens[b])."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    b, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, h, d))
    for bi, n in enumerate(lens):
        lo = max(0, n - window) if window else 0
        for hi in range(h):
            z = k[bi, lo:n, hi // g] @ q[bi, hi] * d ** -0.5
            if mask is not None:
                z = np.where(mask[bi, lo:n].numpy(), z, -np.inf)
            if z.size == 0 or np.isneginf(z).all():
                continue
            p = np.exp(z - z.max())
            out[bi, hi] = (p / p.sum()) @ v[bi, lo:n, hi // g]
    return out.astype(np.float32)


def _one_and_two_threads(fn):
    from atbcore.backends.cpu_kernels.threads import parked_torch_threads

    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with parked_torch_threads():
                outs.append(fn().clone())
    finally:
        torch.set_num_threads(before)
    return outs


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,kv,window", [(8, 2, 0), (8, 4, 0), (8, 4, 200)])
def test_paged_rows_read_their_kv_heads_together(dt, h, kv, window):
    """5 rows: one thread takes whole rows, two take (row, kv head) chunks. fp32 rows
    of 250 keys take 3 of 4 kv heads and then 1, of 600 keys one at a time."""
    from atbcore.backends.cpu_kernels.torch_decode import paged_decode_attention

    g = torch.Generator().manual_seed(h * kv + window)
    bs, d, width = 16, 64, 40
    lens = [250, 0, 600, 17, 333]
    nb = len(lens) * width
    kc, vc = (torch.randn(nb, bs, kv, d, generator=g).to(dt) for _ in range(2))
    tables = torch.randperm(nb, generator=g).view(len(lens), width).to(torch.int32)
    q = torch.randn(len(lens), h, d, generator=g).to(dt)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    one, two = _one_and_two_threads(lambda: paged_decode_attention(
        q, kc, vc, tables, lens_t, scale=d ** -0.5, window=window or None))
    assert torch.equal(one, two)
    k = kc[tables.long()].flatten(1, 2)    # [B, width * bs, KV, D]
    v = vc[tables.long()].flatten(1, 2)
    assert_close(one.float(), _ref(q, k, v, lens, window), NAMES[dt], f"{h}/{kv} heads")


def test_masked_rows_read_their_kv_heads_together():
    from atbcore.backends.cpu_kernels.torch_decode import decode_attention

    g = torch.Generator().manual_seed(7)
    b, h, kv, d, n = 4, 8, 2, 64, 300
    q = torch.randn(b, h, d, generator=g)
    k, v = (torch.randn(b, n, kv, d, generator=g) for _ in range(2))
    mask = torch.rand(b, n, generator=g) < 0.7
    mask[2] = False                        # a row with every key masked: zeros
    one, two = _one_and_two_threads(
        lambda: decode_attention(q, k, v, n=n, scale=d ** -0.5, key_mask=mask))
    assert torch.equal(one, two)
    assert torch.equal(one[2], torch.zeros(h, d))
    assert_close(one, _ref(q, k, v, [n] * b, mask=mask), "fp32", "masked rows")
