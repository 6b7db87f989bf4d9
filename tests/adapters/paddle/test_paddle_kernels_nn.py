"""Paddle backend kernels vs the NumPy reference: norms, Linear (dense, merged QKV,
w8), MatMul, RoPE, FlashAttention, in fp32 / fp16 / bf16 (Paddle tensors in and out)."""

import numpy as np
import pytest

pytest.importorskip("paddle", reason="paddlepaddle is not installed")

from atbcore.ops.linear import quantize_w8  # noqa: E402
from oracle import rand  # noqa: E402
from paddle_cases import FLOATS, check_paddle  # noqa: E402

import paddle  # noqa: E402
from atb_paddle.backend import common  # noqa: E402
from atb_paddle.backend.common import PATHS, fused_reason, reset_paths  # noqa: E402


@pytest.mark.parametrize("dtype", FLOATS)
def test_norms(dtype, kernel_path):
    reset_paths()
    x, r = rand((2, 5, 769), dtype, 1), rand((2, 5, 769), dtype, 2)
    w, b = rand((769,), dtype, 3), rand((769,), dtype, 4)
    check_paddle("RmsNorm", {"eps": 1e-6}, [x, w])
    check_paddle("RmsNorm", {"eps": 1e-6, "weight_offset": 1.0}, [x, w])
    check_paddle("LayerNorm", {"eps": 1e-5}, [x, w, b])
    check_paddle("LayerNorm", {"eps": 1e-5}, [x])
    ref = check_paddle("AddRmsNorm", {}, [x, r, w])
    np.testing.assert_array_equal(ref[1], (x.astype(np.float64) + r.astype(np.float64)).astype(x.dtype))
    check_paddle("AddLayerNorm", {}, [x, r, w, b])
    check_paddle("AddLayerNorm", {}, [x, r])
    # two normalised dims: the fused op gets a flattened weight
    check_paddle("RmsNorm", {"normalized_shape": [5, 769]}, [x, rand((5, 769), dtype, 5)])
    # Paddle's fused norms ran (fp32 data: half inputs were upcast first)
    if kernel_path == "native":  # atb's C kernels ran on the Paddle tensors
        assert PATHS[("RmsNorm", "native")] == 3 and PATHS[("AddLayerNorm", "native")] == 2
        return
    if fused_reason("fused_rms_norm", paddle.zeros([1], dtype="float32")) is not None:
        # no AVX-512F: Paddle's fused norm kernels would die of SIGILL, so compositions ran
        assert PATHS[("RmsNorm", "composed")] >= 2
        assert not any(path.startswith("fused_") for _, path in PATHS)
        return
    assert PATHS[("RmsNorm", "fused_rms_norm")] >= 2
    if dtype == "fp32":
        assert PATHS[("AddRmsNorm", "fused_rms_norm")] == 1
        assert PATHS[("AddLayerNorm", "fused_layer_norm")] == 1


def test_fused_norms_only_where_the_cpu_has_avx512(monkeypatch):
    """Paddle 3.3's CPU fused norm kernels execute AVX-512 instructions on any CPU: they
    are chosen only where /proc/cpuinfo lists avx512f (swiglu's kernel is plain)."""
    t = paddle.zeros([2, 8], dtype="float32")
    monkeypatch.setattr(common, "_avx512", lambda: False)
    for name in ("fused_rms_norm", "fused_layer_norm"):
        assert fused_reason(name, t) == f"{name}'s CPU kernel needs AVX-512F, which this CPU lacks"
    assert fused_reason("swiglu", t) is None
    monkeypatch.setattr(common, "_avx512", lambda: True)
    assert fused_reason("fused_rms_norm", t) is None and fused_reason("fused_layer_norm", t) is None


@pytest.mark.parametrize("dtype", FLOATS)
def test_linear_dense_bias_and_layouts(dtype, kernel_path):
    x, w, b = rand((2, 3, 72), dtype, 1), rand((40, 72), dtype, 2), rand((40,), dtype, 3)
    check_paddle("Linear", {}, [x, w, b])
    check_paddle("Linear", {"bias": False}, [x, w])
    check_paddle("Linear", {"transpose_weight": False}, [x, np.ascontiguousarray(w.T)])
    check_paddle("MatMul", {"transpose_b": True}, [x, w])
    check_paddle("MatMul", {}, [rand((3, 1, 4, 8), dtype, 4), rand((2, 8, 5), dtype, 5)])
    check_paddle("MatMul", {"transpose_a": True}, [rand((2, 8, 4), dtype, 6), rand((8, 5), dtype, 7)])


def test_merged_qkv_linear_equals_three_projections():
    """One [q|k|v] weight (GQA: 4 q heads, 2 kv heads of 16) = three Linears, split."""
    h, d = 64, 16
    x = rand((2, 5, h), "fp32", 1)
    wq, wk, wv = rand((4 * d, h), "fp32", 2), rand((2 * d, h), "fp32", 3), rand((2 * d, h), "fp32", 4)
    qkv, = check_paddle("Linear", {"out_features": 8 * d}, [x, np.concatenate([wq, wk, wv])])
    parts = [check_paddle("Linear", {}, [x, w])[0] for w in (wq, wk, wv)]
    np.testing.assert_allclose(qkv, np.concatenate(parts, axis=-1), rtol=1e-6, atol=1e-6)
    check_paddle("Split", {"sizes": [4 * d, 2 * d, 2 * d]}, [qkv])


@pytest.mark.parametrize("dtype", FLOATS)
def test_linear_w8(dtype, kernel_path):
    x, w, b = rand((3, 5, 64), dtype, 1), rand((48, 64), "fp32", 2), rand((48,), dtype, 3)
    wq, s = quantize_w8(w)
    check_paddle("Linear", {"quant": "w8"}, [x, wq, s])
    check_paddle("Linear", {"quant": "w8", "bias": True}, [x, wq, b, s])
    check_paddle("Linear", {"quant": "w8", "transpose_weight": False},
                 [x, np.ascontiguousarray(wq.T), s])


ROPE_CASES = [
    ({"head_dim": 16, "rotary_type": "half"}, "BSH"),
    ({"head_dim": 16, "rotary_type": "interleave"}, "BSH"),
    ({"head_dim": 16, "rotary_dim": 8, "base": 500.0}, "BSND"),
    ({"head_dim": 16, "layout": "BNSD", "rotary_type": "gptj"}, "BNSD"),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("params,layout", ROPE_CASES)
def test_rope(dtype, params, layout, kernel_path):
    shape_q = {"BSH": (2, 5, 4 * 16), "BSND": (2, 5, 4, 16), "BNSD": (2, 4, 5, 16)}[layout]
    shape_k = {"BSH": (2, 5, 2 * 16), "BSND": (2, 5, 2, 16), "BNSD": (2, 2, 5, 16)}[layout]
    q, k = rand(shape_q, dtype, 1), rand(shape_k, dtype, 2)
    check_paddle("RoPE", params, [q, k])
    check_paddle("RoPE", dict(params, position_offset=3000), [q])
    pos = np.array([[0, 7, 2049, 3, 4], [9, 8, 1, 0, 4095]], np.int64)
    check_paddle("RoPE", params, [q, k, pos])
    rd = params.get("rotary_dim", 16)
    cos, sin = rand((6000, rd), "fp32", 3), rand((6000, rd), "fp32", 4)
    check_paddle("RoPE", params, [q, k, pos.astype(np.int32), cos, sin])       # a table by ids
    check_paddle("RoPE", params, [q, cos[:5], sin[:5]])                          # per token


def test_rope_gpu_fusion_is_refused_on_cpu_with_reason():
    import paddle

    from atb_paddle.backend.common import fused_reason

    why = fused_reason("fused_rotary_position_embedding", paddle.ones([1], "float32"))
    assert why and "no CPU kernel" in why


ATTN_CASES = [
    ({"num_heads": 4, "causal": True}, (2, 9, 9)),                    # MHA prefill
    ({"num_heads": 4, "num_kv_heads": 2, "causal": True}, (2, 9, 9)),  # GQA
    ({"num_heads": 4, "num_kv_heads": 1, "causal": True}, (2, 1, 17)),  # MQA decode vs KV cache
    ({"num_heads": 4, "num_kv_heads": 2, "causal": True}, (2, 4, 13)),  # chunked prefill
    ({"num_heads": 4, "num_kv_heads": 2, "window": 3}, (2, 9, 9)),    # sliding window
    ({"num_heads": 4, "causal": False}, (1, 6, 11)),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("params,sizes", ATTN_CASES)
def test_flash_attention(dtype, params, sizes):
    b, sq, skv = sizes
    h, hkv, d = params["num_heads"], params.get("num_kv_heads") or params["num_heads"], 16
    q, k, v = rand((b, sq, h * d), dtype, 1), rand((b, skv, hkv * d), dtype, 2), rand((b, skv, hkv * d), dtype, 3)
    check_paddle("FlashAttention", params, [q, k, v])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_flash_attention_masks_lens_layouts_and_chunks(dtype, monkeypatch):
    import atb_paddle.backend.attention as A

    monkeypatch.setattr(A, "CHUNK", 4)           # several query chunks on small shapes
    reset_paths()
    b, s, h, d = 2, 10, 4, 8
    q, k, v = rand((b, h, s, d), dtype, 1), rand((b, 2, s, d), dtype, 2), rand((b, 2, s, d), dtype, 3)
    lens = np.array([10, 6], np.int32)
    check_paddle("FlashAttention", {"num_heads": h, "causal": True}, [q, k, v, lens])
    add_mask = rand((s, s), dtype, 4, low=-2.0, high=0.0)
    check_paddle("FlashAttention", {"num_heads": h}, [q, k, v, add_mask])
    bool_mask = np.random.default_rng(5).random((b, 1, s, s)) > 0.3
    bool_mask[:, :, 3] = False                                   # a row that sees nothing -> 0
    ref, = check_paddle("FlashAttention", {"num_heads": h}, [q, k, v, bool_mask])
    assert not np.asarray(ref, np.float32)[:, :, 3].any()
    assert PATHS[("FlashAttention", "chunked")] >= 3
    qs = np.ascontiguousarray(q.transpose(0, 2, 1, 3))            # BSND
    ks, vs = (np.ascontiguousarray(t.transpose(0, 2, 1, 3)) for t in (k, v))
    check_paddle("FlashAttention", {"layout": "BSND", "causal": True, "window": 4}, [qs, ks, vs])
    packed = rand((b, s, (h + 2 * 2) * d), dtype, 6)                # one [q|k|v] input
    check_paddle("FlashAttention", {"num_heads": h, "num_kv_heads": 2, "causal": True}, [packed])


def test_flash_attention_paths():
    reset_paths()
    q = rand((1, 8, 32), "fp32", 1)
    check_paddle("FlashAttention", {"num_heads": 2, "causal": True}, [q, q, q])
    assert PATHS[("FlashAttention", "sdpa")] == 1                 # Paddle's own SDPA
    check_paddle("FlashAttention", {"num_heads": 2, "causal": True}, [q[:, :3], q, q])
    assert PATHS[("FlashAttention", "chunked")] == 1              # bottom-right causal mask


@pytest.mark.parametrize("dtype", FLOATS + ["int8"])
def test_reshape_and_cache_in_place(dtype, kernel_path):
    from paddle_cases import to_paddle

    import atbcore as atb

    t, nb, bs, hkv, d = 7, 5, 4, 2, 8
    k, v = rand((t, hkv, d), "fp32", 1, scale=30), rand((t, hkv, d), "fp32", 2, scale=30)
    kc, vc = rand((nb, bs, hkv, d), "fp32", 3, scale=30), rand((nb, bs, hkv, d), "fp32", 4, scale=30)
    k, v, kc, vc = (a.astype(atb.Dtype.of(dtype).numpy) for a in (k, v, kc, vc))
    slots = np.random.default_rng(5).permutation(nb * bs)[:t].astype(np.int64)
    slots[::3] = -1                                           # padding tokens are not stored
    check_paddle("ReshapeAndCache", {}, [k, v, kc, vc, slots])
    kc_p, vc_p = to_paddle(kc), to_paddle(vc)
    outs = atb.Builder(backend="paddle").build_operation("ReshapeAndCache").execute(
        [to_paddle(k), to_paddle(v), kc_p, vc_p, to_paddle(slots)])
    assert outs[0] is kc_p and outs[1] is vc_p               # the caller's caches, written
    got = atb.tensor.to_numpy(kc_p)
    for i, s in enumerate(slots):
        want = k[i] if s >= 0 else None
        if want is not None:
            np.testing.assert_array_equal(got[s // bs, s % bs], want)


@pytest.mark.parametrize("dtype", FLOATS)
def test_paged_attention_decode_and_prefill(dtype):
    rng = np.random.default_rng(0)
    nb, bs, h, hkv, d = 9, 4, 4, 2, 16
    kc, vc = rand((nb, bs, hkv, d), dtype, 1), rand((nb, bs, hkv, d), dtype, 2)
    tables = np.stack([rng.permutation(nb)[:4] for _ in range(2)]).astype(np.int32)
    ctx = np.array([13, 6], np.int32)
    check_paddle("PagedAttention", {}, [rand((2, h, d), dtype, 3), kc, vc, tables, ctx])
    qsl = np.array([3, 2], np.int32)
    check_paddle("PagedAttention", {"num_kv_heads": hkv}, [rand((5, h, d), dtype, 4), kc, vc,
                                                          tables, ctx, qsl])


def test_flash_attention_long_sequence_is_chunked():
    """seq 2049, head_dim 72: Paddle's own SDPA would hold [B, H, S, S] scores on the
    CPU, so queries go in chunks (here with a sliding window and with causal GQA)."""
    reset_paths()
    q = rand((1, 2049, 2 * 72), "fp32", 1)
    kv = rand((1, 2049, 72), "fp32", 2)
    check_paddle("FlashAttention", {"num_heads": 2, "head_dim": 72, "window": 300}, [q, kv, kv])
    check_paddle("FlashAttention", {"num_heads": 2, "head_dim": 72, "causal": True}, [q, kv, kv])
    assert PATHS[("FlashAttention", "chunked")] == 2 and PATHS[("FlashAttention", "sdpa")] == 0
