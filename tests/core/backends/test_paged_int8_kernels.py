"""The int8 KV cache kernels against the float64 NumPy references: the C decode
kernel reading int8 rows in place (scores and softmax weights scaled by the rows'
scales) on the AVX-512 tile path (D multiple of 16) and the plain path (odd D),
GQA, several blocks per row, a sliding window, 1 and 2 threads bit-equal; the
torch composite (multi-query, dequantizing the rows read); the quantizing write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import torch_ops as ck
from atbcore.backends.torch.paged_int8 import paged_attention_int8, reshape_and_cache_int8
from atbcore.ops.paged_int8 import quantize_int8_np
from atbcore.ops.registry import get_op
from atbcore.tensor import convert

pytestmark = pytest.mark.skipif(ck.why_not(torch.zeros(1)) is not None,
                                reason="the C kernels are not built here")


def _caches(rng, nb, bs, hkv, d):
    x = rng.standard_normal((nb, bs, hkv, d)) * rng.uniform(0.1, 4, (nb, bs, hkv, 1))
    return quantize_int8_np(x)


def _call(rng, *, b, h, hkv, d, nb, bs, lens, qlens=None, window=None, dtype=np.float32):
    kc, ks = _caches(rng, nb, bs, hkv, d)
    vc, vs = _caches(rng, nb, bs, hkv, d)
    per = -(-max(lens) // bs)
    tables = np.stack([rng.permutation(nb)[:per] for _ in range(b)]).astype(np.int32)
    t = b if qlens is None else sum(qlens)
    ins = {"query": rng.standard_normal((t, h, d)).astype(dtype), "key_cache": kc,
           "value_cache": vc, "key_scale": ks, "value_scale": vs, "block_tables": tables,
           "context_lens": np.array(lens, np.int32),
           "q_seq_lens": None if qlens is None else np.array(qlens, np.int32)}
    op = get_op("PagedAttentionInt8")
    p = op.make_params({"num_heads": h, "num_kv_heads": hkv, "window": window})
    return op, p, ins


def _torch(ins):
    return {n: None if x is None else convert(np.ascontiguousarray(x), "torch")
            for n, x in ins.items()}


def _threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("d,window,b,lens,nb", [(64, None, 3, [37, 5, 16], 12),
                                                (24, None, 3, [37, 5, 16], 12),
                                                (128, 7, 3, [37, 5, 16], 12),
                                                (64, None, 4, [600, 333, 17, 512], 40)])
def test_c_decode_reads_int8_rows_against_the_reference(d, window, b, lens, nb):
    rng = np.random.default_rng(d + b)
    op, p, ins = _call(rng, b=b, h=8, hkv=2, d=d, nb=nb, bs=16, lens=lens, window=window)
    want = op.reference(p, ins)[0]
    one = _threads(1, lambda: paged_attention_int8(p, _torch(ins))[0].numpy())
    two = _threads(2, lambda: paged_attention_int8(p, _torch(ins))[0].numpy())
    np.testing.assert_allclose(one, want, rtol=1e-4, atol=1e-5)
    assert np.array_equal(one, two)


def test_bf16_query_and_multi_query_composite():
    rng = np.random.default_rng(5)
    from atbcore.dtypes import Dtype

    op, p, ins = _call(rng, b=2, h=4, hkv=1, d=32, nb=6, bs=8, lens=[20, 9],
                       dtype=Dtype.BF16.numpy)
    want = op.reference(p, ins)[0].astype(np.float32)
    got = paged_attention_int8(p, _torch(ins))[0].float().numpy()
    np.testing.assert_allclose(got, want, rtol=4e-3, atol=4e-3)
    op, p, ins = _call(rng, b=2, h=4, hkv=2, d=16, nb=6, bs=8, lens=[20, 9], qlens=[3, 9])
    want = op.reference(p, ins)[0]
    got = paged_attention_int8(p, _torch(ins))[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("xdt,sdt", [(np.float32, np.float16), ("bf16", np.float16),
                                     (np.float16, np.float32)])
def test_quantizing_write_is_bit_equal_to_the_reference_with_odd_sizes(xdt, sdt):
    from atbcore.backends.torch.paged_int8 import quantize_int8
    from atbcore.dtypes import Dtype

    rng = np.random.default_rng(9)
    xdt = Dtype.BF16.numpy if xdt == "bf16" else xdt
    k = (rng.standard_normal((7, 3, 13)) * 3).astype(xdt)
    v = (rng.standard_normal((7, 3, 13)) * 1e-3).astype(xdt)
    k[2, 1] = 0.0
    kc = np.zeros((4, 5, 3, 13), np.int8)
    sc = np.zeros((4, 5, 3), sdt)
    slots = np.array([0, 19, -1, 7, 3, 12, 8], np.int64)
    op = get_op("ReshapeAndCacheInt8")
    p = op.make_params({})
    ins = dict(key=k, value=v, key_cache=kc, value_cache=kc.copy(), key_scale=sc,
               value_scale=sc.copy(), slot_mapping=slots)
    got = reshape_and_cache_int8(p, _torch({n: np.copy(x) for n, x in ins.items()}))  # C
    want = op.reference(p, {n: np.copy(x) for n, x in ins.items()})
    for g, w in zip(got, want):
        assert np.array_equal(convert(g, "numpy"), w)
    assert not got[0][0, 2].any() and got[0][0, 0].any()  # slot -1 skipped; slot 0 = token 0
    q, s = quantize_int8(convert(k, "torch"), convert(sc, "torch").dtype)  # the torch path
    wq, ws = quantize_np = quantize_int8_np(k, sdt)
    assert np.array_equal(q.numpy(), wq) and np.array_equal(convert(s, "numpy"), ws)
