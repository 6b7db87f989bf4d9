"""The decode-step ops on the framework-free C kernels (``numpy_c``; the MindSpore
and Paddle backends wrap the same specs): PagedAttention with one query per
sequence, paged RopeKVCache, Embedding's row gather, Split's row copies and the
panel weight layout, each against the NumPy reference, with the C calls counted."""

import numpy as np
import pytest

import atbcore as atb
from atbcore.backends.cpu_kernels import available, bindings
from atbcore.dtypes import Dtype
from atbcore.errors import InputError
from atbcore.numerics import assert_close
from oracle import FLOATS, rand, run

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels did not build here")


def _c(op, params, ins):
    calls: list[str] = []
    bindings.SINKS.append(calls)
    try:
        got = atb.Builder(backend="numpy_c").build_operation(op, params).execute(list(ins))
    finally:
        bindings.SINKS.remove(calls)
    return got, calls


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("window", [None, 3])
def test_paged_decode_attention_is_one_c_call(dt, window):
    q = rand((3, 4, 16), dt, 1)                                  # [B, H, D]
    kc, vc = rand((6, 4, 2, 16), dt, 2), rand((6, 4, 2, 16), dt, 3)  # [blocks, bs, KV, D]
    tables = np.array([[4, 1], [0, 5], [2, 3]], np.int32)
    lens = np.array([5, 8, 1], np.int32)
    params = {"num_heads": 4, "num_kv_heads": 2, "window": window}
    ins = [q, kc, vc, tables, lens]
    got, calls = _c("PagedAttention", params, ins)
    assert calls == ["decode_attention"]
    assert_close(got[0], run("PagedAttention", params, ins, "numpy")[0], dt, "paged decode")
    # several query tokens of one sequence (a prefill) go to the reference kernel
    q2 = rand((4, 4, 16), dt, 4)
    ins2 = [q2, kc, vc, tables[:1], np.array([5], np.int32), np.array([4], np.int32)]
    got2, calls2 = _c("PagedAttention", params, ins2)
    assert "decode_attention" not in calls2
    assert_close(got2[0], run("PagedAttention", params, ins2, "numpy")[0], dt, "paged prefill")


@pytest.mark.parametrize("dt", FLOATS)
def test_paged_rope_kv_cache_rotates_and_writes_in_one_c_call(dt):
    b, s, hq, hk, d = 1, 3, 4, 2, 16
    q, k, v = rand((b, s, hq * d), dt, 1), rand((b, s, hk * d), dt, 2), rand((b, s, hk * d), dt, 3)
    kc, vc = rand((2, 8, hk, d), dt, 4), rand((2, 8, hk, d), dt, 5)
    pos = np.array([5, 6, 7], np.int64)
    slots = np.array([13, 14, 2], np.int32)
    params = {"num_heads": hq, "num_kv_heads": hk}
    ref_kc, ref_vc = kc.copy(), vc.copy()
    want = run("RopeKVCache", params, [q, k, v, ref_kc, ref_vc, pos, None, None, slots], "numpy")
    got, calls = _c("RopeKVCache", params, [q, k, v, kc, vc, pos, None, None, slots])
    assert calls == ["rope"] and got[1] is kc and got[2] is vc
    assert_close(got[0], want[0], dt, "RopeKVCache q")
    assert_close(kc, want[1], dt, "RopeKVCache key cache")
    assert np.array_equal(vc.view(np.uint8), want[2].view(np.uint8))  # v is copied as is


@pytest.mark.parametrize("dt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("idt", [np.int32, np.int64])
def test_embedding_is_a_checked_c_row_gather(dt, idt):
    table = (rand((50, 8), "fp32", 1, 20.0)).astype(Dtype.of(dt).numpy)
    ids = np.array([[0, 49, 7], [7, 3, 12]], idt)
    got, calls = _c("Embedding", {}, [table, ids])
    assert calls == ["gather_rows"]
    assert np.array_equal(got[0], table[ids])
    with pytest.raises(InputError, match="ids"):
        _c("Embedding", {}, [table, np.array([1, 50], idt)])


@pytest.mark.parametrize("params,shape", [({"sizes": [4, 2, 6]}, (3, 12)),
                                          ({"num": 2, "dim": 0}, (4, 5)),
                                          ({"num": 3, "dim": 1}, (2, 6, 4))])
def test_split_is_row_copies(params, shape):
    x = rand(shape, "fp32", 1)
    got, calls = _c("Split", params, [x])
    want = run("Split", params, [x], "numpy")
    assert len(got) == len(want) and set(calls) <= {"memmove"}
    for g, e in zip(got, want):
        assert np.array_equal(g, e) and g.flags.c_contiguous


def test_panel_weights_give_the_row_major_results(monkeypatch):
    from atbcore.backends.cpu_kernels.native_panels import pack_panels_np
    from atbcore.backends.cpu_kernels.native import view_of

    w = rand((70, 24), "fp32", 2, 0.3)                           # 70: a partial last panel
    p = pack_panels_np(view_of(w)).view(np.float32)
    assert p.shape == (3, 24, 32)
    assert np.array_equal(p[2, :, :6], w[64:].T) and not p[2, :, 6:].any()
    x = rand((3, 24), "fp32", 1)
    packed, = _c("Linear", {}, [x, w])[0]
    monkeypatch.setenv("ATB_PANELS", "0")
    plain, = _c("Linear", {}, [x, w])[0]
    ref, = run("Linear", {}, [x, w], "numpy")
    assert_close(packed, ref, "fp32", "panels")
    assert_close(plain, ref, "fp32", "rows")
    assert np.allclose(packed, plain, rtol=1e-6, atol=1e-6)
