"""The NPU attention, paged-cache and w8 kernels through the torch_npu conformance
double on CPU tensors: each against the op's NumPy reference (DESIGN.md section 5),
each documented constraint a reason, and the double rejecting invalid calls."""

import numpy as np
import pytest
import torch

from atbcore.backends import get_backend
from atbcore.backends.npu import nnal_reason, use_npu_module
from atbcore.backends.torch.device_kernels import DEVICE_KERNELS
from atbcore.numerics import assert_close
from atbcore.ops.linear import quantize_w8
from atbcore.ops.registry import get_op
from npu_double import ContractViolation, NpuDouble
from oracle import as_torch, rand

get_backend("torch").load()


@pytest.fixture
def npu():
    with use_npu_module(NpuDouble("A2")) as double:
        yield double


def _torch_ins(ins):
    return {n: None if x is None else as_torch(x) for n, x in ins.items()}


def _run(op, params, ins):
    opdef = get_op(op)
    p = opdef.make_params(params)
    tins = _torch_ins(ins)
    dk = DEVICE_KERNELS[(op, "npu")]
    assert dk.why_not(p, tins) is None
    got = dk.fn(p, tins)
    ref = opdef.reference(p, {n: None if x is None else np.array(x, copy=True)
                              for n, x in ins.items()})
    return got, ref, tins


def _why(op, params, ins):
    p = get_op(op).make_params(params)
    return DEVICE_KERNELS[(op, "npu")].why_not(p, _torch_ins(ins))


CASES = [  # (layout, Sq, Skv, params, extras)
    ("BSH", 6, 6, {"causal": True}, {}),                 # sparse_mode 3
    ("BNSD", 5, 9, {"causal": True}, {}),                # chunked prefill, bottom-right
    ("BSND", 4, 4, {}, {}),                              # no mask at all
    ("BSH", 5, 5, {"causal": True, "window": 2}, {"seq_lens": [5, 3]}),  # explicit mask
    ("BNSD", 3, 7, {}, {"mask": "bool"}),                # a bool mask, True = attend
]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout,sq,skv,params,extra", CASES)
def test_flash_attention_prefill(npu, dtype, layout, sq, skv, params, extra):
    b, h, hk, d = 2, 4, 2, 16
    shape = {"BSH": lambda s, n: (b, s, n * d), "BNSD": lambda s, n: (b, n, s, d),
             "BSND": lambda s, n: (b, s, n, d)}[layout]
    ins = {"q": rand(shape(sq, h), dtype, 1), "k": rand(shape(skv, hk), dtype, 2),
           "v": rand(shape(skv, hk), dtype, 3), "mask": None, "seq_lens": None}
    if "seq_lens" in extra:
        ins["seq_lens"] = np.array(extra["seq_lens"], np.int32)
    if extra.get("mask"):
        m = np.random.default_rng(4).random((b, 1, sq, skv)) > 0.3
        m[..., 0] = True
        ins["mask"] = m
    (o,), (ref,), _ = _run("FlashAttention", {"num_heads": h, "num_kv_heads": hk, "head_dim": d,
                                              "layout": layout, **params}, ins)
    assert_close(o, ref, dtype, what=f"npu FlashAttention {layout}")
    assert npu.calls == ["npu_fusion_attention"]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_flash_attention_decode_uses_fused_infer(npu, dtype):
    b, h, hk, d, skv = 3, 8, 2, 32, 11
    ins = {"q": rand((b, 1, h * d), dtype, 5), "k": rand((b, skv, hk * d), dtype, 6),
           "v": rand((b, skv, hk * d), dtype, 7), "seq_lens": np.array([11, 4, 1], np.int64)}
    (o,), (ref,), _ = _run("FlashAttention", {"num_heads": h, "causal": True}, ins)
    assert_close(o, ref, dtype, what="npu decode FlashAttention")
    assert npu.calls == ["npu_fused_infer_attention_score"]


def test_flash_attention_decode_on_310p_uses_incre():
    b, h, hk, d, skv = 2, 4, 2, 32, 9
    ins = {"q": rand((b, h, 1, d), "fp16", 5), "k": rand((b, hk, skv, d), "fp16", 6),
           "v": rand((b, hk, skv, d), "fp16", 7), "seq_lens": np.array([9, 3], np.int64)}
    with use_npu_module(NpuDouble("310P")) as double:
        (o,), (ref,), _ = _run("FlashAttention", {"num_heads": h, "window": 2}, ins)
        assert_close(o, ref, "fp16", what="npu decode FlashAttention (310P)")
        assert double.calls == ["npu_incre_flash_attention"]
        prefill = {**ins, "q": rand((b, h, 4, d), "fp16", 8), "seq_lens": None}
        assert "310P has no prefill" in _why("FlashAttention", {"num_heads": h}, prefill)
        bf = {n: None if x is None else x.astype(np.float32) if x.dtype != np.int64 else x
              for n, x in ins.items()}
        assert "takes fp16" in _why("FlashAttention", {"num_heads": h}, bf)


def test_flash_attention_reasons(npu):
    q = rand((1, 4, 64), "fp16")
    assert "additive float mask" in _why("FlashAttention", {"num_heads": 2},
                                         {"q": q, "k": q, "v": q, "mask": rand((4, 4), "fp16")})
    big = rand((1, 2, 2 * 800), "fp16")
    assert "head_dim 1-768" in _why("FlashAttention", {"num_heads": 2}, {"q": big, "k": big, "v": big})
    with use_npu_module(NpuDouble("910")):
        assert "A2/A3" in _why("FlashAttention", {"num_heads": 2}, {"q": q, "k": q, "v": q})


def _paged_inputs(dtype, bs=16, lens=(20, 1, 33)):
    t, h, hk, d, nb = len(lens), 4, 2, 32, 12
    kc, vc = rand((nb, bs, hk, d), dtype, 8), rand((nb, bs, hk, d), dtype, 9)
    tables = np.random.default_rng(3).permutation(nb)[:t * 4].reshape(t, 4).astype(np.int32)
    return {"query": rand((t, h, d), dtype, 10), "key_cache": kc, "value_cache": vc,
            "block_tables": tables, "context_lens": np.array(lens, np.int32), "q_seq_lens": None}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_paged_attention_fia_and_atb(dtype):
    ins = _paged_inputs(dtype)
    with use_npu_module(NpuDouble("A2")) as double:
        (o,), (ref,), _ = _run("PagedAttention", {}, ins)
        assert_close(o, ref, dtype, what="npu PagedAttention (FIA)")
        assert double.calls == ["npu_fused_infer_attention_score"]
    # 320 heads: FIA takes <= 256, the ATB op reads the blocks in place
    many = {**ins, "query": rand((3, 320, 32), dtype, 10)}
    with use_npu_module(NpuDouble("A2")) as double:
        (o,), (ref,), _ = _run("PagedAttention", {}, many)
        assert_close(o, ref, dtype, what="npu PagedAttention (ATB)")
        assert double.calls == ["_npu_paged_attention"]
    # 310P: no FIA, and its ATB ops take NZ caches: fp16 decode over the gathered rows
    with use_npu_module(NpuDouble("310P")) as double:
        if dtype == "fp16":
            (o,), (ref,), _ = _run("PagedAttention", {}, ins)
            assert_close(o, ref, dtype, what="npu PagedAttention (310P, gathered)")
            assert double.calls == ["npu_incre_flash_attention"]
        else:
            why = _why("PagedAttention", {}, ins)
            assert "NZ caches" in why and "takes fp16" in why, why
    with use_npu_module(NpuDouble("310P", nnal=False)):
        why = _why("PagedAttention", {}, {**ins, "query": rand((3, 320, 32), dtype, 10)})
        assert "A2/A3" in why and "NNAL" in why and "over gathered rows" in why, why


def test_paged_attention_reasons(npu):
    """What the in-place paged ops refuse; the gathered rows take all of it."""
    from atbcore.backends.npu.attention import _in_place_reason

    def both(params, ins):
        p = get_op("PagedAttention").make_params(params)
        return _in_place_reason(p, _torch_ins(ins)), _why("PagedAttention", params, ins)

    assert "block_size % 16" in both({}, _paged_inputs("fp16", bs=8, lens=(5, 8)))[0]
    assert "fp16/bf16" in both({}, _paged_inputs("fp32"))[0]
    assert "window" in both({"window": 4}, _paged_inputs("fp16"))[0]
    assert "<= 512" in both({}, _paged_inputs("fp16", bs=1024, lens=(20, 1, 600)))[0]
    ones = {**_paged_inputs("fp16"), "q_seq_lens": np.array([1, 1, 1], np.int32)}
    assert both({}, ones) == (None, None)            # decode: one query per sequence
    multi = _paged_inputs("fp16", lens=(20, 2))
    multi.update(query=rand((3, 4, 32), "fp16"), q_seq_lens=np.array([1, 2], np.int32))
    why, gathered = both({}, multi)
    assert "q_seq_lens" in why and gathered is None
    with use_npu_module(NpuDouble("310P")):
        assert "310P has no prefill" in _why("PagedAttention", {}, multi)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_reshape_and_cache(npu, dtype):
    t, hk, d, nb, bs = 5, 2, 16, 4, 16
    ins = {"key": rand((t, hk, d), dtype, 1), "value": rand((t, hk, d), dtype, 2),
           "key_cache": rand((nb, bs, hk, d), dtype, 3), "value_cache": rand((nb, bs, hk, d), dtype, 4),
           "slot_mapping": np.array([0, 17, 63, 5, 32], np.int32)}
    (kc, vc), (rk, rv), tins = _run("ReshapeAndCache", {}, ins)
    assert kc is tins["key_cache"] and vc is tins["value_cache"]  # in place
    assert_close(kc, rk, dtype, what="key cache")
    assert_close(vc, rv, dtype, what="value cache")
    assert npu.calls == ["_npu_reshape_and_cache"]
    assert "slot -1" in _why("ReshapeAndCache", {}, {**ins, "slot_mapping": np.array([0, -1, 2, 3, 4],
                                                                                     np.int32)})
    assert "fp16/bf16/int8" in _why("ReshapeAndCache", {}, {
        n: (x.astype(np.float32) if x.dtype != np.int32 else x) for n, x in ins.items()})


def test_nnal_is_looked_for_in_the_environment(monkeypatch, tmp_path):
    with use_npu_module(NpuDouble("A2", nnal=None)):
        monkeypatch.delenv("ATB_HOME_PATH", raising=False)
        assert "ATB_HOME_PATH is not set" in nnal_reason()
        monkeypatch.setenv("ATB_HOME_PATH", str(tmp_path))
        assert "libatb.so" in nnal_reason()
        (tmp_path / "lib").mkdir()
        (tmp_path / "lib" / "libatb.so").write_bytes(b"")
        assert nnal_reason() is None
    assert nnal_reason() == "torch_npu is not installed"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_linear_w8(npu, dtype):
    x = rand((2, 3, 64), dtype, 1)
    w = torch.from_numpy(rand((48, 64), "fp32", 2))
    wq, s = quantize_w8(w)
    s = s.to(torch.bfloat16 if dtype == "bf16" else torch.float16)  # scales in x's dtype
    b = rand((48,), dtype, 3)
    ins = {"x": x, "weight": wq.numpy(), "bias": b, "scale": s.float().numpy()}
    opdef = get_op("Linear")
    p = opdef.make_params({"quant": "w8"})
    tins = {**_torch_ins(ins), "scale": s}
    dk = DEVICE_KERNELS[("Linear", "npu")]
    assert dk.why_not(p, tins) is None
    (y,) = dk.fn(p, tins)
    # the NPU op is W8A16: x stays in its half dtype (the op's reference reads x as the
    # CPU kernels do, in int8 blocks of 32, which a half x cannot carry exactly), so
    # the oracle here is the weight-only product
    ref = (x.astype(np.float64) @ (wq.double() * s.double()[:, None]).numpy().T
           + b.astype(np.float64))
    assert_close(y, ref, dtype, what="npu w8 Linear")
    assert npu.calls == ["npu_weight_quant_batchmatmul"]
    # with the residual the linear_residual fusion gives it: the NPU op rounds its
    # product, then the add rounds again, so the oracle is the unfused pair
    r = rand((2, 3, 48), dtype, 4)
    (yr,) = dk.fn(p, {**tins, "residual": _torch_ins({"r": r})["r"]})
    (pair,) = get_op("ResidualAdd").reference(get_op("ResidualAdd").make_params({}),
                                              {"x": ref.astype(x.dtype), "residual": r})
    assert_close(yr, pair, dtype, what="npu w8 Linear + residual")
    # fp32 scales holding values of x's dtype are taken (converted once, exactly);
    # fp32 scales that would round are not
    s32 = s.float()
    assert dk.why_not(p, {**tins, "scale": s32}) is None
    (y32,) = dk.fn(p, {**tins, "scale": s32})
    assert torch.equal(y32, y)
    off = s32 * (1 + 2.0 ** -20)
    assert "rounding them here" in dk.why_not(p, {**tins, "scale": off})
    assert "not weight-only" in dk.why_not(opdef.make_params({}), tins)


def test_the_double_rejects_invalid_attention_calls(npu):
    q = torch.zeros(1, 2, 4, 16, dtype=torch.float16)
    with pytest.raises(ContractViolation, match="compressed mask"):
        npu.npu_fusion_attention(q, q, q, 2, "BNSD", atten_mask=torch.ones(4, 4, dtype=torch.bool),
                                 scale=1.0, sparse_mode=3)
    with pytest.raises(ContractViolation, match="fp16/bf16 only"):
        npu.npu_fused_infer_attention_score(q.float(), q.float(), q.float(), num_heads=2,
                                            input_layout="BNSD")
    with pytest.raises(ContractViolation, match="int32"):
        npu._npu_reshape_and_cache(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16),
                                   torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16),
                                   torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ContractViolation, match="NNAL"):
        NpuDouble("A2", nnal=False)._npu_reshape_and_cache(None, None, None, None, None)
    with pytest.raises(ContractViolation, match="int8 \\(K, N\\)"):
        npu.npu_weight_quant_batchmatmul(torch.zeros(2, 8, dtype=torch.float16),
                                         torch.zeros(4, 8, dtype=torch.int8),
                                         torch.ones(4, dtype=torch.float16))
