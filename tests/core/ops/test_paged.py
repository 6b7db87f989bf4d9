"""ReshapeAndCache (in-place cache writes) and PagedAttention: torch kernels vs the
NumPy reference, PagedAttention vs FlashAttention over the same tokens laid out
contiguously, in-place semantics on every backend, and bad input."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import FLOATS, as_torch, check_error, check_op, rand


def slots_for(tables, lens, bs):
    """Slot of every token of every sequence, in order: block * bs + offset."""
    return np.concatenate([tables[b][np.arange(n) // bs] * bs + np.arange(n) % bs
                           for b, n in enumerate(lens)]).astype(np.int32)


def paged_layout(lens, bs, hkv, d, dtype="fp32", seed=0, spare=3):
    """Per-sequence k/v ``[n, Hkv, D]``, and caches holding them through shuffled block
    tables (rows padded with -1); caches are filled with ReshapeAndCache."""
    rng = np.random.default_rng(seed)
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + spare
    ids = rng.permutation(nb)
    tables = np.full((len(lens), max(need) + 1), -1, np.int32)
    at = 0
    for b, k in enumerate(need):
        tables[b, :k] = ids[at:at + k]
        at += k
    ks = [rand((n, hkv, d), dtype, seed + 10 + b) for b, n in enumerate(lens)]
    vs = [rand((n, hkv, d), dtype, seed + 50 + b) for b, n in enumerate(lens)]
    kc = rand((nb, bs, hkv, d), dtype, seed + 1)  # garbage everywhere not written
    vc = rand((nb, bs, hkv, d), dtype, seed + 2)
    op = atb.Builder().build_operation("ReshapeAndCache")
    kc_t, vc_t = as_torch(kc), as_torch(vc)
    op.execute([as_torch(np.concatenate(ks)), as_torch(np.concatenate(vs)), kc_t, vc_t,
                torch.from_numpy(slots_for(tables, lens, bs))])
    return ks, vs, atb.tensor.to_numpy(kc_t), atb.tensor.to_numpy(vc_t), tables


# ------------------------------------------------------------------ ReshapeAndCache


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("t,nb,bs,hkv,d", [(1, 2, 4, 1, 8), (7, 5, 4, 2, 72), (33, 8, 16, 2, 16)])
def test_reshape_and_cache_matches_reference_and_loop(t, nb, bs, hkv, d, dtype):
    k, v = rand((t, hkv, d), dtype, 1), rand((t, hkv, d), dtype, 2)
    kc, vc = rand((nb, bs, hkv, d), dtype, 3), rand((nb, bs, hkv, d), dtype, 4)
    slots = np.random.default_rng(5).permutation(nb * bs)[:t].astype(np.int64)
    slots[::3] = -1  # padding tokens are not stored
    ref_k, ref_v = check_op("ReshapeAndCache", {}, [k, v, kc, vc, slots])
    want_k, want_v = kc.copy(), vc.copy()
    for i, s in enumerate(slots):
        if s >= 0:
            want_k[s // bs, s % bs], want_v[s // bs, s % bs] = k[i], v[i]
    np.testing.assert_array_equal(ref_k, want_k)
    np.testing.assert_array_equal(ref_v, want_v)


def test_reshape_and_cache_is_in_place_for_torch_caches():
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    ptr = kc.data_ptr()
    op = atb.Builder().build_operation("ReshapeAndCache")
    assert op.opdef.inplace == {0: 2, 1: 3}
    out_k, out_v = op.execute([k, v, kc, vc, torch.tensor([5, -1, 15], dtype=torch.int32)])
    assert out_k is kc and out_v is vc and kc.data_ptr() == ptr
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(kc[3, 3], k[2])
    assert torch.equal(vc[1, 1], v[0]) and torch.equal(vc[3, 3], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # nothing else written


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_reshape_and_cache_is_in_place_for_numpy_caches(backend, dtype):
    """NumPy caches are written in place by the reference backend and, through a
    zero-copy DLPack view, by the torch backend."""
    k, v = rand((2, 1, 8), dtype, 1), rand((2, 1, 8), dtype, 2)
    kc, vc = np.zeros((3, 2, 1, 8), k.dtype), np.zeros((3, 2, 1, 8), k.dtype)
    op = atb.Builder(backend=backend).build_operation("ReshapeAndCache")
    out_k, _ = op.execute([k, v, kc, vc, np.array([4, 1], np.int32)])
    np.testing.assert_array_equal(kc[2, 0], k[0])
    np.testing.assert_array_equal(kc[0, 1], k[1])
    np.testing.assert_array_equal(vc[2, 0], v[0])
    assert np.shares_memory(out_k, kc)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("bad", [16, -2])
def test_slot_out_of_range_writes_nothing(backend, bad):
    k, v = rand((3, 2, 8), "fp32", 1), rand((3, 2, 8), "fp32", 2)
    kc, vc = np.zeros((4, 4, 2, 8), np.float32), np.zeros((4, 4, 2, 8), np.float32)
    slots = np.array([0, 5, bad], np.int32)  # valid slots first: a partial write would show
    caches = [as_torch(kc), as_torch(vc)] if backend == "torch" else [kc, vc]
    ins = [as_torch(k), as_torch(v)] if backend == "torch" else [k, v]
    op = atb.Builder(backend=backend).build_operation("ReshapeAndCache")
    with pytest.raises(atb.InputError, match=f"slot_mapping.*0..15.*{bad}"):
        op.execute(ins + caches + [slots])
    for c in caches:
        assert not np.asarray(atb.tensor.to_numpy(c)).any()
    check_error("ReshapeAndCache", {}, [k, v, kc, vc, slots], atb.InputError, "slot_mapping",
                str(bad), backend=backend, outputs=[kc + 1, vc + 1])


KC = rand((4, 4, 2, 8), "fp32", 3)
RC_BAD = [
    ("key_rank", [rand((3, 16)), rand((3, 2, 8)), KC, KC, np.arange(3)], atb.ShapeError,
     ["'key' rank"]),
    ("cache_rank", [rand((3, 2, 8)), rand((3, 2, 8)), rand((16, 2, 8)), KC, np.arange(3)],
     atb.ShapeError, ["'key_cache' rank"]),
    ("tokens", [rand((3, 2, 8)), rand((4, 2, 8)), KC, KC, np.arange(3)], atb.ShapeError,
     ["'value' tokens"]),
    ("heads", [rand((3, 1, 8)), rand((3, 1, 8)), KC, KC, np.arange(3)], atb.ShapeError,
     ["'key_cache' shape"]),
    ("head_dim", [rand((3, 2, 4)), rand((3, 2, 4)), KC, KC, np.arange(3)], atb.ShapeError,
     ["'key_cache' shape"]),
    ("value_cache_blocks", [rand((3, 2, 8)), rand((3, 2, 8)), KC, rand((5, 4, 2, 8)),
                            np.arange(3)], atb.ShapeError, ["'value_cache' shape"]),
    ("cache_dtype", [rand((3, 2, 8)), rand((3, 2, 8)), KC.astype(np.float16), KC,
                     np.arange(3)], atb.DtypeError, ["'key_cache' dtype", "FP16"]),
    ("key_int", [np.zeros((3, 2, 8), np.int32), np.zeros((3, 2, 8), np.int32), KC, KC,
                 np.arange(3)], atb.DtypeError, ["'key' dtype", "INT32"]),
    ("slots_float", [rand((3, 2, 8)), rand((3, 2, 8)), KC, KC, rand((3,))], atb.DtypeError,
     ["'slot_mapping' dtype"]),
    ("slots_len", [rand((3, 2, 8)), rand((3, 2, 8)), KC, KC, np.arange(4)], atb.ShapeError,
     ["'slot_mapping' shape", "[3]", "[4]"]),
    ("missing", [rand((3, 2, 8)), rand((3, 2, 8)), KC, KC], atb.InputError,
     ["number of inputs"]),
]


@pytest.mark.parametrize("inputs,exc,frags", [b[1:] for b in RC_BAD], ids=[b[0] for b in RC_BAD])
def test_reshape_and_cache_bad_input(inputs, exc, frags):
    for backend in ("torch", "numpy"):
        check_error("ReshapeAndCache", {}, inputs, exc, *frags, backend=backend,
                    outputs=[KC.copy(), KC.copy()])


def test_reshape_and_cache_wrong_number_of_outputs():
    check_error("ReshapeAndCache", {}, [rand((3, 2, 8)), rand((3, 2, 8)), KC.copy(), KC.copy(),
                                        np.arange(3)], atb.InputError, "number of outputs",
                outputs=[KC.copy(), KC.copy(), KC.copy()])
