"""FlashAttention: torch kernel vs the NumPy reference over dtypes, shapes, layouts,
masks, windows and per-batch lengths; torch SDPA with an explicit full mask as an
independent oracle; the seed's MhaV3 call."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from oracle import FLOATS, as_torch, check_op, rand


def make_qkv(b, sq, skv, h, hkv, d, dtype="fp32", layout="BSH", seed=0):
    """q, k, v NumPy arrays in ``layout`` (generated as BNSD, then rearranged)."""
    q = rand((b, h, sq, d), dtype, seed)
    k = rand((b, hkv, skv, d), dtype, seed + 1)
    v = rand((b, hkv, skv, d), dtype, seed + 2)
    return [from_bnsd(x, layout) for x in (q, k, v)]


def from_bnsd(x, layout):
    if layout == "BNSD":
        return x
    x = x.transpose(0, 2, 1, 3)  # [B, N, S, D] -> [B, S, N, D]
    return np.ascontiguousarray(x.reshape(x.shape[0], x.shape[1], -1) if layout == "BSH" else x)


def sdpa_oracle(q, k, v, *, causal=False, window=None, mask=None, lens=None, scale=None):
    """float64 torch SDPA (math) with an explicit full [B, 1|H, Sq, Skv] mask built from
    tril/triu; q/k/v NumPy BNSD. Rows seeing no key are zeros by definition."""
    q, k, v = (torch.from_numpy(np.asarray(x, dtype=np.float64)) for x in (q, k, v))
    b, h, sq, _ = q.shape
    skv = k.shape[2]
    full = torch.zeros(b, 1, sq, skv, dtype=torch.bool)
    for i in range(b):
        n = skv if lens is None else int(lens[i])
        m = torch.ones(sq, skv, dtype=torch.bool)
        m[:, n:] = False
        off = max(n - sq, 0)  # query row r sits at max(n - sq, 0) + r
        if causal or window:
            m &= torch.ones(sq, skv, dtype=torch.bool).tril(diagonal=off)
        if window:
            m &= torch.ones(sq, skv, dtype=torch.bool).triu(diagonal=off - window + 1)
        full[i, 0] = m
    attn = full
    if mask is not None:
        um = torch.from_numpy(np.asarray(mask, dtype=np.bool_ if mask.dtype == np.bool_
                                         else np.float64))
        attn = attn & um if um.dtype == torch.bool else \
            torch.where(attn, um, torch.tensor(float("-inf"), dtype=torch.float64))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale,
                                       enable_gqa=k.shape[1] != h)
    seen = attn.any(-1, keepdim=True) if attn.dtype == torch.bool else \
        (attn > float("-inf")).any(-1, keepdim=True)
    return torch.where(seen, o, 0.0).numpy()


def run(params, inputs, backend="torch"):
    op = atb.Builder(backend=backend).build_operation("FlashAttention", params)
    ins = [as_torch(x) if backend == "torch" and isinstance(x, np.ndarray) else x for x in inputs]
    out, = op.execute(ins)
    return out, op


# (name, params, B, Sq, Skv, H, Hkv, D)
CASES = [
    ("mha_causal", {"num_heads": 2, "causal": True}, 2, 7, 7, 2, 2, 16),
    ("gqa_hd72", {"num_heads": 4, "num_kv_heads": 2, "causal": True}, 2, 9, 9, 4, 2, 72),
    ("mqa_seq1", {"num_heads": 4, "num_kv_heads": 1}, 3, 1, 1, 4, 1, 16),
    ("decode", {"num_heads": 4, "causal": True}, 2, 1, 17, 4, 2, 32),
    ("chunked_prefill", {"num_heads": 2, "causal": True, "scale": 0.3}, 2, 5, 12, 2, 1, 8),
    ("noncausal_cross", {"num_heads": 2}, 1, 6, 11, 2, 2, 24),
    ("seq2049_gqa", {"num_heads": 2, "num_kv_heads": 1, "causal": True}, 1, 2049, 2049, 2, 1, 64),
    ("seq2049_window_hd72", {"num_heads": 2, "window": 300}, 1, 2049, 2049, 2, 1, 72),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, dtype):
    _, params, b, sq, skv, h, hkv, d = case
    check_op("FlashAttention", params, make_qkv(b, sq, skv, h, hkv, d, dtype))


@pytest.mark.parametrize("case", CASES[:6], ids=[c[0] for c in CASES[:6]])
def test_reference_matches_sdpa_oracle(case):
    """The oracle itself against torch SDPA with an explicit mask (and so the kernel)."""
    _, params, b, sq, skv, h, hkv, d = case
    q, k, v = make_qkv(b, sq, skv, h, hkv, d, "fp32", layout="BNSD")
    gold = sdpa_oracle(q, k, v, causal=params.get("causal", False), scale=params.get("scale"))
    for backend in ("numpy", "torch"):
        got, _ = run(dict(params, layout="BNSD"), [q, k, v], backend)
        atb.assert_close(got, gold, "fp32", f"{case[0]} {backend} vs SDPA oracle")


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_layouts_agree(layout, dtype):
    """The same data in every layout gives the same result, in that layout."""
    params = {"num_heads": 4, "num_kv_heads": 2, "causal": True, "layout": layout}
    ins = make_qkv(2, 6, 10, 4, 2, 8, dtype, layout)
    check_op("FlashAttention", params, ins)
    got, _ = run(params, ins)
    gold = sdpa_oracle(*make_qkv(2, 6, 10, 4, 2, 8, dtype, "BNSD"), causal=True)
    atb.assert_close(got, from_bnsd(gold, layout).astype(np.float32), dtype, layout)


def test_default_layout_by_rank():
    q, k, v = make_qkv(1, 4, 4, 2, 2, 8, layout="BNSD")
    got, _ = run({}, [q, k, v])  # 4-D without params: BNSD, heads from the shape
    atb.assert_close(got, sdpa_oracle(q, k, v), "fp32")
    q3, k3, v3 = make_qkv(1, 4, 4, 2, 2, 8, layout="BSH")
    got3, _ = run({"head_dim": 8}, [q3, k3, v3])  # 3-D: BSH, heads = hidden / head_dim
    atb.assert_close(got3, from_bnsd(sdpa_oracle(q, k, v), "BSH"), "fp32")


MASKS = [  # (name, shape builder, bool?)
    ("add_2d", lambda b, h, sq, skv: (sq, skv), False),
    ("add_b1", lambda b, h, sq, skv: (b, 1, sq, skv), False),
    ("add_bh", lambda b, h, sq, skv: (b, h, sq, skv), False),
    ("bool_2d", lambda b, h, sq, skv: (sq, skv), True),
    ("bool_bh", lambda b, h, sq, skv: (b, h, sq, skv), True),
    ("bool_key_padding", lambda b, h, sq, skv: (b, 1, 1, skv), True),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name,shape,is_bool", MASKS, ids=[m[0] for m in MASKS])
def test_given_masks(name, shape, is_bool, dtype, causal):
    b, sq, skv, h, hkv, d = 2, 6, 9, 4, 2, 16
    q, k, v = make_qkv(b, sq, skv, h, hkv, d, dtype, "BNSD")
    if is_bool:
        mask = rand(shape(b, h, sq, skv), "fp32", 7) > -0.8
        mask[..., 0] = True  # keep a key per row so padding-only rows are not all rows
    else:
        mask = rand(shape(b, h, sq, skv), dtype, 7, scale=2.0)
    params = {"causal": causal}
    check_op("FlashAttention", params, [q, k, v, mask])
    got, _ = run(params, [q, k, v, mask])
    gold = sdpa_oracle(q, k, v, causal=causal, mask=mask)
    atb.assert_close(got, gold.astype(np.float32), dtype, f"{name} vs SDPA oracle")


def test_fully_masked_rows_are_zero():
    q, k, v = make_qkv(1, 3, 5, 2, 2, 8, layout="BNSD")
    mask = np.ones((3, 5), bool)
    mask[1] = False
    fmask = np.where(mask, 0.0, -np.inf).astype(np.float32)
    for m in (mask, fmask):
        for backend in ("torch", "numpy"):
            got, _ = run({}, [q, k, v, m], backend)
            got = np.asarray(atb.tensor.to_numpy(got))
            assert np.all(got[:, :, 1] == 0) and np.all(np.isfinite(got))
            atb.assert_close(got, sdpa_oracle(q, k, v, mask=m), "fp32")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("sq,skv,causal,window", [
    (1, 13, True, None), (4, 13, True, None), (13, 13, True, None), (13, 13, False, None),
    (5, 13, True, 3), (600, 600, True, None)])
def test_seq_lens(sq, skv, causal, window, dtype):
    """Per-batch kv lengths, rows aligned to each length; 600 rows take two chunks."""
    b, h, hkv, d = 3, 4, 2, 16
    q, k, v = make_qkv(b, sq, skv, h, hkv, d, dtype, "BNSD")
    lens = np.array([skv, max(1, skv // 2), max(1, skv - 3)], np.int32)
    params = {"causal": causal, "window": window}
    check_op("FlashAttention", params, [q, k, v, lens])
    got, _ = run(params, [q, k, v, lens])
    gold = sdpa_oracle(q, k, v, causal=causal, window=window, lens=lens)
    atb.assert_close(got, gold.astype(np.float32), dtype, "seq_lens vs SDPA oracle")


@pytest.mark.parametrize("window", [1, 4, 40])
def test_sliding_window_vs_oracle(window):
    q, k, v = make_qkv(2, 700, 700, 2, 1, 16, "fp32", "BNSD", seed=3)
    got, _ = run({"window": window}, [q, k, v])
    atb.assert_close(got, sdpa_oracle(q, k, v, window=window), "fp32", f"window {window}")
    # decode-style: fewer queries than keys, bottom-right aligned
    got, _ = run({"window": window}, [q[:, :, -9:], k, v])
    atb.assert_close(got, sdpa_oracle(q[:, :, -9:], k, v, window=window), "fp32")


def test_mask_with_seq_lens_and_window_bf16():
    b, sq, skv, h, d = 2, 7, 15, 2, 8
    q, k, v = make_qkv(b, sq, skv, h, 1, d, "bf16", "BNSD")
    mask = rand((b, 1, sq, skv), "fp32", 9)
    lens = np.array([15, 9], np.int64)
    params = {"window": 5, "causal": True}
    check_op("FlashAttention", params, [q, k, v, mask, lens])
    got, _ = run(params, [q, k, v, lens, mask])  # extras bind by dtype, in any order
    gold = sdpa_oracle(q, k, v, causal=True, window=5, mask=mask, lens=lens)
    atb.assert_close(got, gold.astype(np.float32), "bf16")


def test_packed_qkv_single_input():
    """One 3-D input is packed [B, S, (H + 2*Hkv)*D] (q heads, then k, then v)."""
    q, k, v = make_qkv(2, 5, 5, 4, 2, 8)
    packed = np.concatenate([q, k, v], axis=-1)
    params = {"num_heads": 4, "num_kv_heads": 2, "causal": True}
    check_op("FlashAttention", params, [packed])
    got, _ = run(params, [packed])
    want, _ = run(params, [q, k, v])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    lens = np.array([5, 2], np.int32)
    got, _ = run(params, [packed, None, None, lens])
    want, _ = run(params, [q, k, v, lens])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_seed_mhav3_call():
    """Seed usage: MhaV3 with seed-style params and a TensorDesc output placeholder."""
    b, s = 1, 8
    gen = torch.Generator().manual_seed(0)
    Q = torch.randn(b, s, 32 * 128, generator=gen).half()
    K = torch.randn(b, s, 8 * 128, generator=gen).half()
    V = torch.randn(b, s, 8 * 128, generator=gen).half()
    op = atb.Builder().build_operation("MhaV3", {
        "head_num": 32, "kv_head_num": 8, "size_per_head": 128, "scale": 1.0 / 128 ** 0.5,
        "is_causal": True, "fuse_qkv": True, "support_flash": True, "dtype": atb.Dtype.FP16})
    outputs = [atb.TensorDesc(shape=list(Q.shape), dtype=atb.Dtype.FP16)]
    op.execute([Q, K, V], outputs)
    out = outputs[0]
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    assert op.params.hints == {"fuse_qkv": True, "support_flash": True}
    # q: [B, S, H*D] -> [B, H, S, D]
    bnsd = [x.float().view(b, s, -1, 128).transpose(1, 2).numpy() for x in (Q, K, V)]
    gold = from_bnsd(sdpa_oracle(*bnsd, causal=True), "BSH")
    atb.assert_close(out, gold, "fp16", "MhaV3 seed call vs SDPA oracle")


@pytest.mark.parametrize("alias", ["SelfAttention", "MhaV2", "MhaV3", "SelfAttentionOperation"])
def test_aliases_resolve(alias):
    assert atb.get_op(alias).name == "FlashAttention"


def test_head_dim_72_runs_on_torch_without_fallback():
    q, k, v = make_qkv(1, 33, 33, 2, 1, 72)
    got, op = run({"num_heads": 2, "causal": True}, [q, k, v])
    assert op.last_backend == "torch" and op.last_fallbacks == []
    bnsd = make_qkv(1, 33, 33, 2, 1, 72, layout="BNSD")
    atb.assert_close(got, from_bnsd(sdpa_oracle(*bnsd, causal=True), "BSH"), "fp32")


def test_writes_into_given_output_and_numpy_backend():
    q, k, v = make_qkv(2, 4, 6, 2, 2, 8, "fp16")
    out = torch.zeros(q.shape, dtype=torch.float16)
    op = atb.Builder().build_operation("FlashAttention", {"num_heads": 2, "causal": True})
    res = op.execute([torch.from_numpy(x) for x in (q, k, v)], [out])
    assert res[0] is out
    ref, = atb.Builder(backend="numpy").build_operation(
        "FlashAttention", {"num_heads": 2, "causal": True}).execute([q, k, v])
    assert isinstance(ref, np.ndarray) and ref.dtype == np.float16
    atb.assert_close(out, ref, "fp16")
