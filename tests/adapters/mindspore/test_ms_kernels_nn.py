"""The MindSpore backend's kernels vs the NumPy reference (DESIGN.md §5) in fp32,
fp16 and bf16: norms (incl. Add+Norm), Linear (bias, [in, out], merged QKV, w8),
MatMul, RoPE, FlashAttention (causal, GQA, windows, masks, KV-cache decode with
seq_lens, packed QKV, query chunking) and the paged KV cache ops."""

import numpy as np
import pytest

pytest.importorskip("mindspore", reason="mindspore is not installed")

from atbcore.ops.linear import quantize_w8  # noqa: E402
from ms_cases import FLOATS, check_ms  # noqa: E402
from oracle import rand  # noqa: E402

import atb_mindspore.backend.attention as ms_attention  # noqa: E402


@pytest.mark.parametrize("dt", FLOATS)
def test_norms(dt, kernel_path):
    x, r = rand([2, 5, 16], dt, 1), rand([2, 5, 16], dt, 2)
    w, b = rand([16], dt, 3), rand([16], dt, 4)
    check_ms("LayerNorm", {"eps": 1e-5}, [x, w, b])
    check_ms("LayerNorm", {"eps": 1e-5}, [x])
    check_ms("LayerNorm", {"normalized_shape": [5, 16]}, [x, rand([5, 16], dt, 5)])
    check_ms("RmsNorm", {"eps": 1e-6}, [x, w],
             path="composed" if kernel_path == "framework" else "C kernel atb_rms_norm")
    check_ms("RmsNorm", {"eps": 1e-6, "weight_offset": 1.0}, [x, w])
    y, s = check_ms("AddRmsNorm", {"eps": 1e-6}, [x, r, w])
    assert s.dtype == x.dtype
    check_ms("AddLayerNorm", {"eps": 1e-6}, [x, r, w, b])


def test_norm_hidden_769_fp32_weight_on_half_input(kernel_path):
    x = rand([3, 769], "fp16", 1, 3.0)
    check_ms("RmsNorm", {}, [x, rand([769], "fp32", 2)])
    check_ms("LayerNorm", {}, [x, rand([769], "fp32", 3), rand([769], "fp32", 4)])


@pytest.mark.parametrize("dt", FLOATS)
def test_linear(dt, kernel_path):
    x = rand([2, 3, 24], dt, 1)
    w, b = rand([40, 24], dt, 2, 0.2), rand([40], dt, 3)
    check_ms("Linear", {}, [x, w, b])
    check_ms("Linear", {"bias": False}, [x[0], w])
    check_ms("Linear", {"transpose_weight": False}, [x, rand([24, 40], dt, 5, 0.2)])
    check_ms("MatMul", {"transpose_b": True}, [rand([2, 1, 5, 8], dt, 1), rand([3, 7, 8], dt, 2)])
    check_ms("MatMul", {"transpose_a": True}, [rand([8, 5], dt, 1), rand([8, 6], dt, 2)])


@pytest.mark.parametrize("dt", FLOATS)
def test_linear_merged_qkv_then_split(dt):
    """A merged QKV projection (one [Hq*D + 2*Hkv*D, in] weight) equals three."""
    x = rand([2, 4, 32], dt, 1)
    wq, wk, wv = rand([32, 32], dt, 2, 0.2), rand([16, 32], dt, 3, 0.2), rand([16, 32], dt, 4, 0.2)
    qkv, = check_ms("Linear", {}, [x, np.concatenate([wq, wk, wv])])
    q, = check_ms("Linear", {}, [x, wq])
    np.testing.assert_array_equal(qkv[..., :32], q)
    check_ms("Split", {"sizes": [32, 16, 16]}, [qkv])


@pytest.mark.parametrize("dt", FLOATS)
def test_linear_w8(dt, kernel_path):
    x = rand([5, 72], dt, 1)
    wq, s = quantize_w8(rand([48, 72], "fp32", 7))
    check_ms("Linear", {"quant": "w8"}, [x, wq, s])
    check_ms("Linear", {"quant": "w8"}, [x, wq, rand([48], dt, 3), s])
    check_ms("Linear", {"quant": "w8", "transpose_weight": False}, [x, np.ascontiguousarray(wq.T), s])


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("rt", ["half", "interleave"])
def test_rope(dt, rt, kernel_path):
    q, k = rand([2, 5, 4 * 8], dt, 1), rand([2, 5, 2 * 8], dt, 2)
    check_ms("RoPE", {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "rotary_type": rt},
             [q, k], path="composed" if kernel_path == "framework" else "C kernel atb_rope")
    check_ms("RoPE", {"head_dim": 8, "rotary_type": rt, "position_offset": 3000}, [q])
    pos = np.array([[0, 7, 2900, 3, 4], [1, 1, 1, 1, 1]], np.int64)
    check_ms("RoPE", {"num_heads": 4, "rotary_dim": 4, "rotary_type": rt}, [q, k, pos])
    check_ms("RoPE", {"layout": "BNSD", "rotary_type": rt}, [rand([2, 4, 5, 8], dt, 3), pos])
    check_ms("RoPE", {"layout": "BSND", "rotary_type": rt}, [rand([2, 5, 4, 8], dt, 3)])
    c, s = rand([10, 8], "fp32", 4), rand([10, 8], "fp32", 5)
    check_ms("RoPE", {"num_heads": 4, "rotary_type": rt}, [q, pos % 10, c, s])


@pytest.mark.parametrize("dt", FLOATS)
def test_flash_attention(dt, monkeypatch):
    monkeypatch.setattr(ms_attention, "CHUNK", 3)  # several query chunks per call
    B, S, H, Hkv, D = 2, 7, 4, 2, 8
    q, k, v = rand([B, S, H * D], dt, 1), rand([B, S, Hkv * D], dt, 2), rand([B, S, Hkv * D], dt, 3)
    p = {"num_heads": H, "num_kv_heads": Hkv}
    check_ms("FlashAttention", p, [q, k, v], path="chunked")
    check_ms("FlashAttention", {**p, "causal": True}, [q, k, v])
    check_ms("FlashAttention", {**p, "causal": True, "window": 3}, [q, k, v])
    check_ms("FlashAttention", {**p, "causal": True, "scale": 0.3}, [q[:, -2:], k, v])
    # decode over a KV cache: one new query, per-batch valid lengths
    check_ms("FlashAttention", {**p, "causal": True}, [q[:, -1:], k, v, np.array([5, 7], np.int64)])
    check_ms("FlashAttention", p, [q, k, v, rand([S, S], dt, 4)])
    check_ms("FlashAttention", p, [q, k, v, rand([B, 1, S, S], "fp32", 4) > -1])
    check_ms("FlashAttention", p, [np.concatenate([q, k, v], -1)])
    check_ms("FlashAttention", {}, [rand([B, H, S, D], dt, 5), rand([B, Hkv, S + 2, D], dt, 6),
                                    rand([B, Hkv, S + 2, D], dt, 7)])
    check_ms("FlashAttention", {"layout": "BSND", "causal": True},
             [rand([B, S, H, D], dt, 5), rand([B, S, 1, D], dt, 6), rand([B, S, 1, D], dt, 7)])


def test_flash_attention_head_dim_72_long_sequence():
    """head_dim 72 (not a multiple of 16) and S 2049 (several 512-row chunks)."""
    q, k, v = rand([1, 2049, 72], "fp16", 1), rand([1, 2049, 72], "fp16", 2), rand([1, 2049, 72], "fp16", 3)
    check_ms("FlashAttention", {"num_heads": 1, "causal": True}, [q, k, v])


def _paged(lens, bs, hkv, d, dt, seed=0):
    nb = sum(-(-n // bs) for n in lens) + 2
    kc, vc = rand([nb, bs, hkv, d], dt, seed), rand([nb, bs, hkv, d], dt, seed + 1)
    perm = np.random.default_rng(seed).permutation(nb)
    tables = np.full((len(lens), max(-(-n // bs) for n in lens)), -1, np.int32)
    i = 0
    for b, n in enumerate(lens):
        tables[b, :-(-n // bs)] = perm[i:i + -(-n // bs)]
        i += -(-n // bs)
    return kc, vc, tables


@pytest.mark.parametrize("dt", FLOATS)
def test_paged_attention(dt):
    kc, vc, tables = _paged([5, 1, 9], 4, 2, 8, dt)
    lens = np.array([5, 1, 9], np.int32)
    check_ms("PagedAttention", {}, [rand([3, 4, 8], dt, 3), kc, vc, tables, lens])
    check_ms("PagedAttention", {"window": 3}, [rand([3, 4, 8], dt, 3), kc, vc, tables, lens])
    check_ms("PagedAttention", {}, [rand([6, 4, 8], dt, 3), kc, vc, tables, lens,
                                    np.array([2, 1, 3], np.int64)])


@pytest.mark.parametrize("dt", ["fp32", "fp16"])
def test_reshape_and_cache_in_place(dt, kernel_path):
    import atbcore as atb
    from atbcore.tensor import to_numpy
    from ms_cases import to_ms

    kc, vc, _ = _paged([5, 9], 4, 2, 8, dt)
    k, v = rand([4, 2, 8], dt, 5), rand([4, 2, 8], dt, 6)
    slots = np.array([3, -1, 17, 8], np.int64)
    check_ms("ReshapeAndCache", {}, [k, v, kc, vc, slots])
    mkc, mvc = to_ms(kc), to_ms(vc)
    op = atb.Builder(backend="mindspore").build_operation("ReshapeAndCache")
    outs = op.execute([to_ms(k), to_ms(v), mkc, mvc, to_ms(slots)])
    assert outs[0] is mkc and outs[1] is mvc           # the caller's caches, written in place
    got = to_numpy(mkc).reshape(-1, 2, 8)
    np.testing.assert_array_equal(got[[3, 17, 8]], k[[0, 2, 3]])
    np.testing.assert_array_equal(np.delete(got, [3, 17, 8], 0),
                                  np.delete(kc.reshape(-1, 2, 8), [3, 17, 8], 0))


def test_bf16_cache_write_falls_back_with_reason():
    """MindSpore 2.10 has no bf16 index-put CPU kernel: the next backend writes the
    MindSpore cache in place through DLPack."""
    import atbcore as atb
    from atbcore.tensor import to_numpy
    from ms_cases import to_ms

    kc, vc, _ = _paged([5], 4, 2, 8, "bf16")
    k = rand([1, 2, 8], "bf16", 5)
    mkc = to_ms(kc)
    op = atb.Builder().build_operation("ReshapeAndCache")
    op.execute([to_ms(k), to_ms(k), mkc, to_ms(vc), to_ms(np.array([6], np.int64))])
    assert op.last_fallbacks and op.last_fallbacks[0][0] == "mindspore"
    assert "bf16" in op.last_fallbacks[0][1][0].lower() or "BF16" in op.last_fallbacks[0][1][0]
    np.testing.assert_array_equal(to_numpy(mkc)[1, 2], k[0])
