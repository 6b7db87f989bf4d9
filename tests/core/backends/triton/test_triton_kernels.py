"""Every Triton kernel of the CUDA backend, run through its registration (the torch
backend's "cuda" device kernel) on CPU tensors in Triton's interpreter, against the
op's NumPy reference (DESIGN.md section 5 tolerances) and an independent torch /
Hugging Face oracle. Shapes are small: the interpreter runs programs one by one."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atbcore.backends import get_backend
from atbcore.backends.torch.device_kernels import DEVICE_KERNELS
from atbcore.numerics import assert_close
from atbcore.ops.registry import get_op
from oracle import FLOATS, as_torch, rand

get_backend("torch").load()


def _cuda_kernel(op):
    return DEVICE_KERNELS[(op, "cuda")]


DEVICE = "cpu"


@pytest.fixture(autouse=True)
def _on(device):
    global DEVICE
    DEVICE = device


def _run(op, params, ins, out=None):
    """The op's Triton kernel on torch copies of ``ins`` (on the test device), and its
    NumPy reference."""
    opdef = get_op(op)
    p = opdef.make_params(params)
    tins = {n: None if x is None else _t(x).to(DEVICE) for n, x in ins.items()}
    dk = _cuda_kernel(op)
    assert dk.why_not(p, tins) is None
    raw = dk.fn(p, tins, out=out)
    _run.raw = raw  # the device tensors, for identity checks
    got = [None if g is None else g.cpu() for g in raw]
    ref = opdef.reference(p, {n: None if x is None else np.array(x, copy=True)
                              for n, x in ins.items()})
    return got, ref, tins


def _t(x):
    return as_torch(x)


@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm(dtype):
    x, w = rand((3, 5, 48), dtype, 1), rand((48,), dtype, 2)
    (y,), (ref,), _ = _run("RmsNorm", {"eps": 1e-5}, {"x": x, "weight": w})
    assert_close(y, ref, dtype, what="triton RmsNorm vs numpy")
    torch_ref = F.rms_norm(_t(x).float(), (48,), _t(w).float(), 1e-5)
    assert_close(y, torch_ref.to(y.dtype), dtype, what="triton RmsNorm vs F.rms_norm")


def test_rms_norm_weight_offset_odd_width_and_out_buffer():
    x, w = rand((7, 37), "bf16", 3), rand((37,), "fp32", 4)
    out = torch.full((7, 37), 9.0, dtype=torch.bfloat16, device=DEVICE)
    (y,), (ref,), _ = _run("RmsNorm", {"eps": 1e-6, "weight_offset": 1.0},
                           {"x": x, "weight": w}, out=[out])
    assert _run.raw[0] is out
    assert_close(y, ref, "bf16", what="triton RmsNorm (1 + w) into out")


@pytest.mark.parametrize("dtype", FLOATS)
def test_add_rms_norm(dtype):
    x, r, w = rand((4, 64), dtype, 5), rand((4, 64), dtype, 6), rand((64,), dtype, 7)
    (y, s), (ref_y, ref_s), _ = _run("AddRmsNorm", {"eps": 1e-6},
                                     {"x": x, "residual": r, "weight": w})
    assert_close(s, ref_s, dtype, what="triton AddRmsNorm sum")
    assert_close(y, ref_y, dtype, what="triton AddRmsNorm norm")
    total = _t(x) + _t(r)
    assert torch.equal(s, total)  # the sum is rounded once, as torch.add rounds it
    assert_close(y, F.rms_norm(total.float(), (64,), _t(w).float(), 1e-6).to(y.dtype), dtype,
                 what="triton AddRmsNorm vs F.rms_norm")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op,params,torch_act", [
    ("SwiGLU", {}, F.silu),
    ("GeGLU", {}, F.gelu),
    ("GeGLU", {"approximate": "tanh"}, lambda g: F.gelu(g, approximate="tanh")),
])
def test_gated_activation_split(dtype, op, params, torch_act):
    x = rand((3, 2, 2 * 40), dtype, 8)
    (y,), (ref,), _ = _run(op, params, {"x": x})
    assert y.shape == (3, 2, 40)
    assert_close(y, ref, dtype, what=f"triton {op} vs numpy")
    g, u = _t(x).float().chunk(2, -1)
    assert_close(y, (torch_act(g) * u).to(y.dtype), dtype, what=f"triton {op} vs torch")


def test_swiglu_separate_up_into_out():
    g, u = rand((5, 33), "fp16", 9), rand((5, 33), "fp16", 10)
    out = torch.zeros(5, 33, dtype=torch.float16, device=DEVICE)
    (y,), (ref,), _ = _run("SwiGLU", {}, {"x": g, "up": u}, out=[out])
    assert _run.raw[0] is out
    assert_close(y, ref, "fp16", what="triton SwiGLU(gate, up)")


def _hf_rope(x, cos, sin):
    """Hugging Face's LLaMA rotary embedding (an independent oracle): x [B, H, S, D]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    y, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return y


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_rope_kv_cache_decode_positions(dtype, layout):
    b, s, hq, hk, d, smax = 2, 3, 4, 2, 32, 10
    shape = (lambda h: (b, s, h * d)) if layout == "BSH" else (lambda h: (b, h, s, d))
    q, k, v = rand(shape(hq), dtype, 11), rand(shape(hk), dtype, 12), rand(shape(hk), dtype, 13)
    kc, vc = rand((b, smax, hk, d), dtype, 14), rand((b, smax, hk, d), dtype, 15)
    pos = np.array([[7, 2, 5], [0, 9, 4]], dtype=np.int64)
    params = {"num_heads": hq, "num_kv_heads": hk, "head_dim": d, "layout": layout,
              "rotary_type": "neox"}
    ins = {"q": q, "k": k, "v": v, "key_cache": kc, "value_cache": vc, "position_ids": pos}
    (qo, kco, vco), (rq, rkc, rvc), tins = _run("RopeKVCache", params, ins)
    assert _run.raw[1] is tins["key_cache"] and _run.raw[2] is tins["value_cache"]  # in place
    assert_close(qo, rq, dtype, what="triton RopeKVCache q")
    assert_close(kco, rkc, dtype, what="triton RopeKVCache key cache")
    assert_close(vco, rvc, dtype, what="triton RopeKVCache value cache")
    # untouched rows keep their old contents
    untouched = np.ones((b, smax), bool)
    untouched[np.arange(b)[:, None], pos] = False
    assert np.array_equal(kco.float().numpy()[untouched], np.asarray(kc, np.float32)[untouched])
    # Hugging Face's rotate_half on the q heads
    ang = pos[..., None] * 10000.0 ** (-np.arange(0, d, 2) / d)
    emb = torch.from_numpy(np.concatenate([ang, ang], -1))                # [B, S, D]
    qh = _t(q).double()
    qh = qh.reshape(b, s, hq, d).transpose(1, 2) if layout == "BSH" else qh
    hf = _hf_rope(qh, emb.cos(), emb.sin())
    got = qo.reshape(b, s, hq, d).transpose(1, 2) if layout == "BSH" else qo
    assert_close(got, hf.to(qo.dtype), dtype, what="triton RopeKVCache q vs HF rotate_half")


@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_kv_cache_paged_slots(dtype):
    """The core's in-place cache form: tokens written at flat slots of paged blocks
    (rows of other sequences untouched), rotated at their own positions."""
    b, s, hq, hk, d, nb, bs = 2, 3, 4, 2, 32, 5, 4
    q, k, v = (rand((b, s, h * d), dtype, i) for h, i in ((hq, 31), (hk, 32), (hk, 33)))
    kc, vc = rand((nb, bs, hk, d), dtype, 34), rand((nb, bs, hk, d), dtype, 35)
    pos = np.array([[9, 10, 11], [0, 1, 2]], dtype=np.int64)
    slots = np.array([13, 14, 15, 4, 5, 6], dtype=np.int32)  # blocks 3 and 1: rows 1..3, 0..2
    params = {"num_heads": hq, "num_kv_heads": hk, "head_dim": d}
    ins = {"q": q, "k": k, "v": v, "key_cache": kc, "value_cache": vc, "position_ids": pos,
           "slot_mapping": slots}
    (qo, kco, vco), (rq, rkc, rvc), tins = _run("RopeKVCache", params, ins)
    assert _run.raw[1] is tins["key_cache"]  # in place
    assert_close(qo, rq, dtype, what="triton paged RopeKVCache q")
    assert_close(kco, rkc, dtype, what="triton paged RopeKVCache key cache")
    assert_close(vco, rvc, dtype, what="triton paged RopeKVCache value cache")
    untouched = np.ones(nb * bs, bool)
    untouched[slots] = False
    flat = kco.float().numpy().reshape(nb * bs, hk, d)
    assert np.array_equal(flat[untouched], np.asarray(kc, np.float32).reshape(-1, hk, d)[untouched])


def test_rope_kv_cache_partial_rotary_offset_and_given_tables():
    b, s, h, d, rd, smax = 1, 4, 2, 24, 16, 8
    q, k, v = (rand((b, s, h, d), "fp32", i) for i in (16, 17, 18))
    kc, vc = np.zeros((b, smax, h, d), np.float32), np.zeros((b, smax, h, d), np.float32)
    params = {"rotary_dim": rd, "position_offset": 3, "base": 500.0}
    (qo, kco, vco), (rq, rkc, rvc), _ = _run(
        "RopeKVCache", params, {"q": q, "k": k, "v": v, "key_cache": kc, "value_cache": vc})
    for got, ref, name in ((qo, rq, "q"), (kco, rkc, "key cache"), (vco, rvc, "value cache")):
        assert_close(got, ref, "fp32", what=f"triton RopeKVCache partial rotary {name}")
    # cos/sin given per token [S, rd], no position ids
    ang = np.arange(s)[:, None] * 1000.0 ** (-np.arange(0, rd, 2) / rd)
    full = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(full).astype(np.float32), np.sin(full).astype(np.float32)
    kc2, vc2 = np.zeros_like(kc), np.zeros_like(vc)
    (qo, kco, _), (rq, rkc, _), _ = _run(
        "RopeKVCache", {"rotary_dim": rd},
        {"q": q, "k": k, "v": v, "key_cache": kc2, "value_cache": vc2, "cos": cos, "sin": sin})
    assert_close(qo, rq, "fp32", what="triton RopeKVCache with given cos/sin q")
    assert_close(kco, rkc, "fp32", what="triton RopeKVCache with given cos/sin key cache")


def _paged_inputs(dtype, lens, h=4, hkv=2, d=40, nb=30, bs=4, mb=24, seed=20):
    rng = np.random.default_rng(seed)
    b = len(lens)
    tables = rng.permutation(nb * 3)[:b * mb].reshape(b, mb) % nb
    return {"query": rand((b, h, d), dtype, seed + 1),
            "key_cache": rand((nb, bs, hkv, d), dtype, seed + 2),
            "value_cache": rand((nb, bs, hkv, d), dtype, seed + 3),
            "block_tables": tables.astype(np.int32),
            "context_lens": np.array(lens, np.int32)}


def _sdpa_oracle(ins, window=None):
    """torch SDPA on gathered, GQA-expanded keys per sequence (independent oracle)."""
    q, kc, vc = (_t(ins[n]).float() for n in ("query", "key_cache", "value_cache"))
    outs = []
    for b, n in enumerate(ins["context_lens"]):
        tab = torch.from_numpy(ins["block_tables"][b].astype(np.int64))
        k, v = kc[tab].flatten(0, 1)[:n], vc[tab].flatten(0, 1)[:n]      # [n, Hkv, D]
        if window:
            k, v = k[max(0, n - window):], v[max(0, n - window):]
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[b][:, None], k, v)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", FLOATS)
def test_paged_decode_attention_gqa(dtype):
    ins = _paged_inputs(dtype, [5, 33, 1])
    (o,), (ref,), _ = _run("PagedAttention", {}, ins)
    assert_close(o, ref, dtype, what="triton PagedAttention vs numpy")
    assert_close(o, _sdpa_oracle(ins).to(o.dtype), dtype, what="triton PagedAttention vs SDPA")


@pytest.mark.parametrize("window", [None, 20])
def test_paged_decode_attention_split_k_and_window(window):
    from atbcore.backends.triton.paged import paged_decode_attention

    ins = _paged_inputs("fp32", [96, 70, 9], h=6, hkv=2, d=16, seed=30)
    t = {n: _t(x).to(DEVICE) for n, x in ins.items()}
    args = (t["query"], t["key_cache"], t["value_cache"], t["block_tables"], t["context_lens"],
            16 ** -0.5)
    one = paged_decode_attention(*args, window=window, splits=1)
    split = paged_decode_attention(*args, window=window, splits=3)    # 3 x 32 keys
    one, split = one.cpu(), split.cpu()
    assert_close(split, one, "fp32", what="split-K vs one pass")
    ref = _sdpa_oracle(ins, window)
    assert_close(split, ref, "fp32", what="split-K vs SDPA")
    p = {} if window is None else {"window": window}
    (o,), (nref,), _ = _run("PagedAttention", p, ins)
    assert_close(o, nref, "fp32", what="triton PagedAttention (window) vs numpy")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout,extra", [
    ("BSH", {"position_offset": 5}),
    ("BSND", {"rotary_dim": 16, "base": 500.0}),
])
def test_rope(dtype, layout, extra):
    b, s, hq, hk, d = 2, 3, 4, 2, 32
    shape = (lambda h: (b, s, h * d)) if layout == "BSH" else (lambda h: (b, s, h, d))
    q, k = rand(shape(hq), dtype, 21), rand(shape(hk), dtype, 22)
    params = {"num_heads": hq, "num_kv_heads": hk, "head_dim": d, "layout": layout, **extra}
    (qo, ko), (rq, rk), _ = _run("RoPE", params, {"q": q, "k": k})
    assert_close(qo, rq, dtype, what="triton RoPE q")
    assert_close(ko, rk, dtype, what="triton RoPE k")


def test_rope_q_only_with_position_ids_into_out():
    q = rand((2, 4, 3, 16), "bf16", 23)
    pos = np.array([[0, 70, 3, 9], [1, 2, 3, 4]], np.int64)
    out = torch.zeros(2, 4, 3, 16, dtype=torch.bfloat16, device=DEVICE)
    (qo,), (rq,), _ = _run("RoPE", {"layout": "BSND"}, {"q": q, "position_ids": pos},
                           out=[out])
    assert _run.raw[0] is out
    assert_close(qo, rq, "bf16", what="triton RoPE q with position ids")
