"""The one-kernel C implementations of the hot ops (atbcore/backends/cpu_kernels).

Every fused op is checked against its NumPy reference in fp32, bf16 and fp16 on
shapes that cross the kernels' 512-element blocks (hidden 769, 1-row decode,
more rows), against an independent oracle (torch.nn.functional / Hugging Face)
where one exists, and each check also asserts that the C kernel really ran as
one launch. Then: planned ``out`` buffers and in-place RoPE, strided inputs,
RopeKVCache's cache writes and refusals, masks, the logged torch fallback, and
the build's cache and "no compiler" reason.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from atbcore.backends import get_backend
from atbcore.backends.cpu_kernels import available, bindings, build
from atbcore.backends.cpu_kernels.counting import LaunchCounter
from atbcore.backends.torch import TORCH_KERNELS
from atbcore.backends.torch.rope import rope_tables
from atbcore.ops.registry import get_op
from oracle import FLOATS, as_torch, check_error, check_op, rand

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler: the torch composites "
                                "run (covered by the op tests)")
get_backend("torch").load()


def run_c(op, params, ins, out=None, kernel="any"):
    """Call the torch kernel directly; assert it was exactly one C launch."""
    p = get_op(op).make_params(params)
    bound = dict.fromkeys(get_op(op).input_names) | ins
    with LaunchCounter() as c:
        res = TORCH_KERNELS[op].fn(p, bound) if out is None else TORCH_KERNELS[op].fn(p, bound, out=out)
    assert c.launches == 1 and (kernel == "any" or c.ops == [kernel]), c.ops
    return res


def ref(op, params, ins):
    p = get_op(op).make_params(params)
    np_ins = {n: None if t is None else atb.tensor.to_numpy(t) for n, t in ins.items()}
    return get_op(op).reference(p, dict.fromkeys(get_op(op).input_names) | np_ins)


# ------------------------------------------------------------------ each op vs the reference
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("op", ["RmsNorm", "AddRmsNorm", "LayerNorm", "AddLayerNorm"])
def test_norms_match_reference(op, rows, dtype):
    h = 769
    ins = {"x": rand([rows, h], dtype, 1, scale=3), "weight": rand([h], dtype, 2) + 1}
    if op.startswith("Add"):
        ins["residual"] = rand([rows, h], dtype, 3)
    if op.endswith("LayerNorm"):
        ins["bias"] = rand([h], dtype, 4)
    params = {"weight_offset": 0.5} if op == "RmsNorm" else {}
    check_op(op, params, [ins[n] for n in get_op(op).input_names if n in ins])
    got = run_c(op, params, {n: as_torch(v) for n, v in ins.items()})
    for g, r in zip(got, ref(op, params, ins)):
        atb.assert_close(g, r, dtype, what=f"{op} C kernel")


def test_norms_match_torch_functional_fp32():
    x, w, b = torch.randn(5, 3, 4096), torch.randn(4096) + 1, torch.randn(4096)
    y, = run_c("RmsNorm", {"eps": 1e-5}, {"x": x, "weight": w})
    atb.assert_close(y, F.rms_norm(x.double(), [4096], w.double(), 1e-5), "fp32")
    y, = run_c("LayerNorm", {}, {"x": x + 100, "weight": w, "bias": b})   # a large mean
    atb.assert_close(y, F.layer_norm((x + 100).double(), [4096], w.double(), b.double()), "fp32")
    y, = run_c("LayerNorm", {"normalized_shape": [3, 4096]}, {"x": x, "weight": None, "bias": None})
    atb.assert_close(y, F.layer_norm(x.double(), [3, 4096]), "fp32")


def test_rms_norm_matches_hf_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = LlamaRMSNorm(512, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.randn(512))
    x = torch.randn(2, 7, 512).to(torch.bfloat16)
    y, = run_c("RmsNorm", {"eps": 1e-6}, {"x": x, "weight": m.weight.detach()})
    atb.assert_close(y, m.double()(x.double()).detach(), "bf16")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op,params", [("SwiGLU", {}), ("GeGLU", {}), ("GeGLU", {"approximate": "tanh"}),
                                       ("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("SiLU", {}),
                                       ("QuickGelu", {}), ("Relu", {}),
                                       ("Activation", {"activation_type": "geglu_tanh"})])
def test_activations_match_reference(op, params, dtype):
    x = rand([3, 1538], dtype, 1, scale=3)
    check_op(op, params, [x])
    y, = run_c(op, params, {"x": as_torch(x)}, kernel="activation")
    atb.assert_close(y, ref(op, params, {"x": x})[0], dtype, what=op)
    if get_op(op).Params(**params).activation_name() in ("swiglu", "geglu", "geglu_tanh"):
        gate, up = x[:, :769], x[:, 769:]                      # the two-input form
        y2, = run_c(op, params, {"x": as_torch(gate), "up": as_torch(up)})
        assert torch.equal(y, y2)


def test_activations_match_torch_over_a_wide_range():
    x = torch.linspace(-30, 30, 200_001)
    for op, params, fn in (("Gelu", {}, F.gelu), ("SiLU", {}, F.silu),
                           ("Gelu", {"approximate": "tanh"}, lambda t: F.gelu(t, approximate="tanh"))):
        y, = run_c(op, params, {"x": x})
        atb.assert_close(y, fn(x.double()), "fp32", what=f"{op} {params} on [-30, 30]")


def test_plugin_activation_is_not_replaced_by_the_c_kernel(caplog):
    from atbcore.ops.activation import _REGISTRY, register_activation

    saved = _REGISTRY["silu"]
    try:
        register_activation("silu", lambda a: 2 * a, lambda t: 2 * t)    # a plugin's "silu"
        x = torch.randn(4, 8)
        with caplog.at_level(logging.INFO, logger="atb"):
            y, = TORCH_KERNELS["SiLU"].fn(get_op("SiLU").make_params({}), {"x": x})
        assert torch.equal(y, 2 * x)
        assert "not a built-in formula" in caplog.text and "torch composite" in caplog.text
    finally:
        _REGISTRY["silu"] = saved


@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_and_masks_match_reference(dtype):
    x = rand([2, 3, 5, 600], dtype, 1, scale=4)
    check_op("Softmax", {}, [x])
    y, = run_c("Softmax", {}, {"x": as_torch(x)}, kernel="softmax")
    atb.assert_close(y, torch.softmax(as_torch(x).double(), -1), dtype, what="softmax vs torch")
    masks = [rand([5, 600], "fp16", 2),                              # additive, other dtype
             rand([2, 1, 5, 600], "fp32", 3) > 0,                    # bool, broadcast heads
             rand([5, 1], dtype, 4)]                                 # broadcast along the row
    for m in masks:
        for causal in (False, True):
            params = {"scale": 0.3, "causal": causal}
            check_op("ScaledMaskedSoftmax", params, [x, m])
            y, = run_c("ScaledMaskedSoftmax", params, {"x": as_torch(x), "mask": as_torch(m)})
            atb.assert_close(y, ref("ScaledMaskedSoftmax", params, {"x": x, "mask": m})[0], dtype)


def test_fully_masked_rows_are_zero_and_causal_is_bottom_right():
    x = torch.randn(1, 3, 8)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1] = False                                                  # row 1 sees nothing
    y, = run_c("ScaledMaskedSoftmax", {"causal": True}, {"x": x, "mask": mask})
    assert torch.equal(y[0, 1], torch.zeros(8))
    # query 0 of 3 sits at position 5 of 8: keys 6, 7 are masked
    assert torch.equal(y[0, 0, 6:], torch.zeros(2)) and y[0, 0, :6].sum().item() == pytest.approx(1)
    want = torch.softmax(x[0, 2].double(), -1)
    atb.assert_close(y[0, 2], want, "fp32")


# ------------------------------------------------------------------ RoPE and RopeKVCache
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout,rtype,rd", [("BSH", "half", None), ("BNSD", "interleave", None),
                                             ("BSND", "half", 24)])
def test_rope_matches_reference(layout, rtype, rd, dtype):
    b, s, h, hkv, d = 2, 5, 4, 2, 40
    shape = {"BSH": lambda n: [b, s, n * d], "BSND": lambda n: [b, s, n, d],
             "BNSD": lambda n: [b, n, s, d]}[layout]
    q, k = rand(shape(h), dtype, 1), rand(shape(hkv), dtype, 2)
    pos = np.array([[3, 0, 9, 17, 2], [1, 2, 3, 4, 5]])
    params = {"num_heads": h, "num_kv_heads": hkv, "head_dim": d, "layout": layout,
              "rotary_type": rtype, "rotary_dim": rd}
    for ins in ({"q": q, "k": k, "position_ids": pos}, {"q": q, "k": k}, {"q": q}):
        check_op("RoPE", params, list(ins.values()))
        got = run_c("RoPE", params, {n: as_torch(v) for n, v in ins.items()}, kernel="rope")
        for g, r in zip(got, ref("RoPE", params, ins)):
            atb.assert_close(g, r, dtype, what=f"RoPE {layout} {rtype}")


def test_rope_in_place_on_packed_qkv_slices_is_one_kernel():
    b, s, h, d = 1, 6, 4, 16
    qkv = torch.randn(b, s, 3 * h * d)
    q, k = qkv[..., :h * d], qkv[..., h * d:2 * h * d]                  # strided views
    want = ref("RoPE", {"num_heads": h}, {"q": q.numpy().copy(), "k": k.numpy().copy()})
    v_before = qkv[..., 2 * h * d:].clone()
    rope_tables(d, 10000.0, "half", s)                                 # built once, not counted
    got = run_c("RoPE", {"num_heads": h}, {"q": q, "k": k}, out=[q, k])
    assert got[0] is q and got[1] is k                                  # written in place
    atb.assert_close(q, want[0], "fp32")
    atb.assert_close(k, want[1], "fp32")
    assert torch.equal(qkv[..., 2 * h * d:], v_before)                  # v untouched


def test_kernels_write_into_given_out_buffers():
    x, w, r = torch.randn(3, 100), torch.randn(100), torch.randn(3, 100)
    arena = torch.zeros(1000)
    y, s = arena[:300].view(3, 100), arena[300:600].view(3, 100)
    got = run_c("AddRmsNorm", {}, {"x": x, "residual": r, "weight": w}, out=[y, s])
    assert got[0] is y and got[1] is s and arena[600:].abs().sum() == 0
    for g, want in zip(got, ref("AddRmsNorm", {}, {"x": x.numpy(), "residual": r.numpy(),
                                                   "weight": w.numpy()})):
        atb.assert_close(g, want, "fp32")
    o = torch.empty(3, 50)
    assert run_c("SwiGLU", {}, {"x": x}, out=[o])[0] is o
    o = torch.empty(3, 100)
    assert run_c("Softmax", {}, {"x": x}, out=[o])[0] is o
    atb.assert_close(o, torch.softmax(x.double(), -1), "fp32")


def test_strided_rows_are_read_without_a_copy():
    big = torch.randn(4, 300)
    x = big[:, :200]                                                    # row stride 300
    y, = run_c("RmsNorm", {}, {"x": x, "weight": torch.ones(200)})
    atb.assert_close(y, F.rms_norm(x.double(), [200], eps=1e-6), "fp32")


def _cache_case(dtype="fp32", layout="BSND"):
    b, s, h, hkv, d, smax = 2, 3, 4, 2, 8, 10
    shape = (lambda n: [b, s, n, d]) if layout == "BSND" else (lambda n: [b, s, n * d])
    ins = {"q": rand(shape(h), dtype, 1), "k": rand(shape(hkv), dtype, 2),
           "v": rand(shape(hkv), dtype, 3), "key_cache": rand([b, smax, hkv, d], dtype, 4),
           "value_cache": rand([b, smax, hkv, d], dtype, 5),
           "position_ids": np.array([[7, 8, 9], [0, 4, 5]])}
    return {"num_heads": h, "num_kv_heads": hkv, "layout": layout}, ins


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", ["BSND", "BSH"])
def test_rope_kv_cache_matches_reference_and_writes_in_place(dtype, layout):
    params, ins = _cache_case(dtype, layout)
    check_op("RopeKVCache", params, list(ins.values()))
    t = {n: as_torch(v) for n, v in ins.items()}
    before = t["key_cache"].clone()
    got = run_c("RopeKVCache", params, t, kernel="rope")
    assert got[1] is t["key_cache"] and got[2] is t["value_cache"]
    want = ref("RopeKVCache", params, {n: np.array(v, copy=True) for n, v in ins.items()})
    for g, r in zip(got, want):
        atb.assert_close(g, r, dtype, what="RopeKVCache")
    # rows nobody wrote keep their contents; written k rows are RoPE's k
    keep = torch.ones(10, dtype=torch.bool)
    keep[[7, 8, 9]] = False
    assert torch.equal(got[1][0, keep], before[0, keep])
    k_rot = ref("RoPE", params, {n: ins[n] for n in ("q", "k", "position_ids")})[1]
    atb.assert_close(got[1][1, 4], np.asarray(k_rot).reshape(2, 3, 2, 8)[1, 1], dtype)


def test_rope_kv_cache_refuses_positions_outside_the_cache_and_writes_nothing():
    params, ins = _cache_case()
    ins["position_ids"] = np.array([[1, 2, 10], [0, 1, 2]])             # 10 >= S_max
    check_error("RopeKVCache", params, list(ins.values()), atb.InputError, "position_ids", "< 10")
    t = {n: as_torch(v) for n, v in ins.items()}
    before = t["key_cache"].clone(), t["value_cache"].clone()
    with pytest.raises(atb.InputError, match="RopeKVCache"):         # the kernel itself checks
        TORCH_KERNELS["RopeKVCache"].fn(get_op("RopeKVCache").make_params(params), t)
    assert torch.equal(t["key_cache"], before[0]) and torch.equal(t["value_cache"], before[1])
    bad = dict(ins, key_cache=rand([2, 10, 3, 8], "fp32", 4))
    check_error("RopeKVCache", params, list(bad.values()), atb.ShapeError, "key_cache")


def test_rope_kv_cache_decode_step_matches_hf_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, h, d, smax, step = 1, 2, 16, 12, 7
    q, k, v = torch.randn(b, 1, h, d), torch.randn(b, 1, h, d), torch.randn(b, 1, h, d)
    kc, vc = torch.zeros(b, smax, h, d), torch.zeros(b, smax, h, d)
    pos = torch.tensor([[step]])
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([step * inv, step * inv])[None, None]                # [1, 1, D]
    want_q, want_k = apply_rotary_pos_emb(q.double().transpose(1, 2), k.double().transpose(1, 2),
                                          ang.cos(), ang.sin())
    op = atb.Builder().build_operation("RopeKVCache", {"num_heads": h, "num_kv_heads": h})
    q_out, kc2, vc2 = op.execute([q, k, v, kc, vc, pos])
    atb.assert_close(q_out, want_q.transpose(1, 2), "fp32")
    atb.assert_close(kc[:, step], want_k.transpose(1, 2)[:, 0], "fp32")
    assert torch.equal(vc[:, step], v[:, 0]) and kc[:, :step].abs().sum() == 0


# ------------------------------------------------------------------ fallback and build
def test_without_the_library_the_composite_runs_and_says_why(monkeypatch, caplog):
    monkeypatch.setitem(bindings._STATE, "reason", "no C compiler found (test)")
    x, w = torch.randn(2, 64), torch.randn(64)
    with caplog.at_level(logging.INFO, logger="atb"), LaunchCounter() as c:
        y, = TORCH_KERNELS["RmsNorm"].fn(get_op("RmsNorm").make_params({}), {"x": x, "weight": w})
    assert all(o.startswith("aten.") for o in c.ops) and c.launches > 1
    assert "RmsNorm: C kernel skipped (no C compiler found (test)) -> torch composite" in caplog.text
    atb.assert_close(y, F.rms_norm(x.double(), [64], w.double(), 1e-6), "fp32")


def test_build_is_cached_and_reports_a_missing_compiler(monkeypatch, tmp_path):
    first = build.build_library()
    again = build.build_library()
    assert again.path == first.path and not again.compiled            # loaded from the cache
    assert first.path.is_relative_to(build.cache_dir())
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    none = build.build_library()
    assert none.path is None and "no C compiler found" in none.reason and "CC" in none.reason


def test_generic_build_compiles_and_exports_every_entry_point(monkeypatch, tmp_path):
    import ctypes

    monkeypatch.setenv("ATB_CPU_ISA", "generic")
    monkeypatch.setenv("ATB_CPU_KERNELS_CACHE", str(tmp_path))
    res = build.build_library()
    assert res.isa == "generic" and res.compiled and res.path.parent.parent == tmp_path
    lib = ctypes.CDLL(str(res.path))
    assert all(hasattr(lib, n) for n in bindings.ENTRY_POINTS)


def test_a_failing_isa_build_falls_back_and_is_not_retried(monkeypatch, tmp_path):
    monkeypatch.setenv("ATB_CPU_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "isa_flags", lambda: [("bogus", ("-mno-such-flag",)),
                                                     ("generic", ())])
    first = build.build_library()
    assert first.isa == "generic" and first.compiled
    markers = list(tmp_path.glob(f"*/{build.FAILED_NAME}"))
    assert len(markers) == 1 and "no-such-flag" in markers[0].read_text()
    again = build.build_library()
    assert again.isa == "generic" and not again.compiled and again.path == first.path
