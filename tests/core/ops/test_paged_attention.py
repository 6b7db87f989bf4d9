"""PagedAttention: torch kernel vs the NumPy reference; vs FlashAttention over the
same tokens laid out contiguously (decode and multi-token queries, GQA, batches of
different lengths); bad input."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import FLOATS, as_torch, check_error, check_op, rand
from test_paged import paged_layout


def run(op, params, inputs, backend="torch"):
    ins = [as_torch(x) if backend == "torch" and isinstance(x, np.ndarray) else x
           for x in inputs]
    out, = atb.Builder(backend=backend).build_operation(op, params).execute(ins)
    return np.asarray(atb.tensor.to_numpy(out))


# (name, context lens, q_seq_lens or None, H, Hkv, D, block_size)
CASES = [
    ("decode_mha", [5, 1, 9], None, 2, 2, 16, 4),
    ("decode_gqa_hd72", [17, 3], None, 4, 2, 72, 8),
    ("decode_mqa_one_block", [3], None, 4, 1, 8, 4),
    ("multi_token_gqa", [9, 6, 4], [3, 1, 4], 4, 2, 16, 4),
    ("prefill_whole_context", [7, 12], [7, 12], 2, 1, 8, 4),
    ("decode_context_2049", [2049, 700], None, 2, 1, 64, 16),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, dtype):
    _, lens, qlens, h, hkv, d, bs = case
    _, _, kc, vc, tables = paged_layout(lens, bs, hkv, d, dtype)
    t = len(lens) if qlens is None else sum(qlens)
    ins = [rand((t, h, d), dtype, 7), kc, vc, tables, np.array(lens, np.int32)]
    if qlens is not None:
        ins.append(np.array(qlens, np.int64))
    check_op("PagedAttention", {"num_heads": h, "num_kv_heads": hkv}, ins)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 3)])
@pytest.mark.parametrize("case", CASES[:5], ids=[c[0] for c in CASES[:5]])
def test_vs_flash_attention_per_sequence(case, causal, window, dtype):
    """Each sequence's queries are its last q_seq_lens positions: FlashAttention over
    its contiguous keys (Sq < Skv, bottom-right aligned) gives the same rows."""
    _, lens, qlens, h, hkv, d, bs = case
    ks, vs, kc, vc, tables = paged_layout(lens, bs, hkv, d, dtype, seed=3)
    ql = [1] * len(lens) if qlens is None else qlens
    q = rand((sum(ql), h, d), dtype, 9)
    ins = [q, kc, vc, tables, np.array(lens, np.int32)] + \
        ([] if qlens is None else [np.array(qlens, np.int32)])
    params = {"causal": causal, "window": window, "scale": 0.2}
    got = run("PagedAttention", params, ins)
    start = 0
    for b, (n, m) in enumerate(zip(lens, ql)):
        # [S, N, D] -> BNSD [1, N, S, D]
        qb, kb, vb = (x.transpose(1, 0, 2)[None] for x in (q[start:start + m], ks[b], vs[b]))
        want = run("FlashAttention", dict(params, layout="BNSD"), [qb, kb, vb])
        atb.assert_close(got[start:start + m], want[0].transpose(1, 0, 2), dtype,
                         f"sequence {b} paged vs flash")
        start += m


@pytest.mark.parametrize("dtype", FLOATS)
def test_decode_batch_vs_flash_attention_with_seq_lens(dtype):
    """A decode batch against one FlashAttention call on right-padded contiguous
    caches with seq_lens (BSND layout)."""
    lens, h, hkv, d, bs = [13, 4, 9, 1], 8, 2, 32, 4
    ks, vs, kc, vc, tables = paged_layout(lens, bs, hkv, d, dtype, seed=5)
    q = rand((len(lens), h, d), dtype, 6)
    got = run("PagedAttention", {}, [q, kc, vc, tables, np.array(lens, np.int32)])
    skv = max(lens)
    kpad = np.zeros((len(lens), skv, hkv, d), q.dtype)
    vpad = np.full((len(lens), skv, hkv, d), 7.0, q.dtype)  # padding must not leak in
    for b, n in enumerate(lens):
        kpad[b, :n], vpad[b, :n] = ks[b], vs[b]
    want = run("FlashAttention", {"causal": True, "layout": "BSND"},
               [q[:, None], kpad, vpad, np.array(lens, np.int32)])
    atb.assert_close(got, want[:, 0], dtype, "paged decode vs flash with seq_lens")


def test_cache_garbage_and_table_padding_are_ignored():
    """Blocks not in a sequence's table, slots past its context and -1 table padding
    never reach the result."""
    lens, bs = [6, 3], 4
    ks, vs, kc, vc, tables = paged_layout(lens, bs, 1, 8, seed=8)
    q = rand((2, 2, 8), "fp32", 1)
    base = run("PagedAttention", {}, [q, kc, vc, tables, np.array(lens, np.int32)])
    used = {(int(tables[b, i // bs]), i % bs) for b, n in enumerate(lens) for i in range(n)}
    kc2, vc2 = kc.copy(), vc.copy()
    for blk in range(kc.shape[0]):
        for off in range(bs):
            if (blk, off) not in used:
                kc2[blk, off], vc2[blk, off] = 1e4, -1e4
    for backend in ("torch", "numpy"):
        got = run("PagedAttention", {}, [q, kc2, vc2, tables, np.array(lens, np.int32)],
                  backend)
        atb.assert_close(got, base, "fp32", backend)


Q = rand((2, 4, 8))
KC = rand((6, 4, 2, 8), seed=1)
BT = np.array([[0, 1], [2, 3]], np.int32)
CTX = np.array([5, 8], np.int32)
PA_BAD = [
    ("query_rank", {}, [rand((2, 32)), KC, KC, BT, CTX], atb.ShapeError, ["'query' rank"]),
    ("cache_rank", {}, [Q, rand((24, 2, 8)), KC, BT, CTX], atb.ShapeError, ["'key_cache' rank"]),
    ("value_cache_shape", {}, [Q, KC, rand((6, 4, 2, 16)), BT, CTX], atb.ShapeError,
     ["'value_cache' shape"]),
    ("kv_heads_not_dividing", {}, [rand((2, 4, 8)), rand((6, 4, 3, 8)), rand((6, 4, 3, 8)), BT,
                                   CTX], atb.ShapeError, ["kv heads must divide heads"]),
    ("head_dim_mismatch", {}, [rand((2, 4, 16)), KC, KC, BT, CTX], atb.ShapeError,
     ["'key_cache' head_dim"]),
    ("params_heads", {"num_heads": 8}, [Q, KC, KC, BT, CTX], atb.ShapeError,
     ["num_heads", "expected 8", "given 4"]),
    ("params_kv_heads", {"num_kv_heads": 1}, [Q, KC, KC, BT, CTX], atb.ShapeError,
     ["num_kv_heads"]),
    ("query_dtype", {}, [Q.astype(np.int32), KC, KC, BT, CTX], atb.DtypeError, ["'query' dtype"]),
    ("cache_dtype", {}, [Q, KC.astype(np.float16), KC, BT, CTX], atb.DtypeError,
     ["'key_cache' dtype"]),
    ("params_dtype", {"dtype": "bf16"}, [Q, KC, KC, BT, CTX], atb.DtypeError, ["BF16"]),
    ("tables_float", {}, [Q, KC, KC, BT.astype(np.float32), CTX], atb.DtypeError,
     ["'block_tables' dtype"]),
    ("tables_rank", {}, [Q, KC, KC, BT[0], CTX], atb.ShapeError, ["'block_tables' rank"]),
    ("ctx_shape", {}, [Q, KC, KC, BT, np.array([5, 8, 1], np.int32)], atb.ShapeError,
     ["'context_lens' shape"]),
    ("tokens_vs_batch", {}, [rand((3, 4, 8)), KC, KC, BT, CTX], atb.ShapeError,
     ["one per sequence", "expected 2", "given 3"]),
    ("ctx_over_capacity", {}, [Q, KC, KC, BT, np.array([5, 9], np.int32)], atb.InputError,
     ["'context_lens' values", "1..8"]),
    ("ctx_zero", {}, [Q, KC, KC, BT, np.array([0, 8], np.int32)], atb.InputError,
     ["'context_lens' values"]),
    ("block_id_out_of_range", {}, [Q, KC, KC, np.array([[0, 6], [2, 3]], np.int32), CTX],
     atb.InputError, ["'block_tables' row 0", "0..5"]),
    ("q_seq_lens_sum", {}, [rand((4, 4, 8)), KC, KC, BT, CTX, np.array([2, 1], np.int32)],
     atb.InputError, ["sum of 'q_seq_lens'", "expected 4", "given 3"]),
    ("q_seq_lens_over_ctx", {}, [rand((7, 4, 8)), KC, KC, BT, CTX, np.array([6, 1], np.int32)],
     atb.InputError, ["'q_seq_lens' values"]),
    ("missing", {}, [Q, KC, KC, BT], atb.InputError, ["number of inputs"]),
]


@pytest.mark.parametrize("name,params,inputs,exc,frags", PA_BAD, ids=[b[0] for b in PA_BAD])
def test_paged_attention_bad_input(name, params, inputs, exc, frags):
    for backend in ("torch", "numpy"):
        check_error("PagedAttention", params, inputs, exc, *frags, backend=backend,
                    outputs=[np.full(inputs[0].shape, 3.0, np.float32)])


def test_paged_attention_bad_outputs():
    check_error("PagedAttention", {}, [Q, KC, KC, BT, CTX], atb.InputError, "number of outputs",
                outputs=[Q.copy(), Q.copy()])
    check_error("PagedAttention", {}, [Q, KC, KC, BT, CTX], atb.ShapeError, "output",
                outputs=[np.zeros((2, 4, 9), np.float32)])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 4)])
@pytest.mark.parametrize("first", [0, 1])
def test_multi_token_queries_over_contiguous_rows(first, causal, window, dtype, monkeypatch):
    """The in-place cache form's layout (row b of the batch is block first + b, one
    block holding each whole context, equal q_seq_lens): the C flash path reads the
    rows in place; equal to the NumPy reference and to FlashAttention per sequence."""
    lens, s, h, hkv, d, cap = [9, 5, 12], 3, 4, 2, 16, 16
    kc = rand((first + 3, cap, hkv, d), dtype, 11)
    vc = rand((first + 3, cap, hkv, d), dtype, 12)
    tables = np.arange(first, first + 3, dtype=np.int32)[:, None]
    q = rand((3 * s, h, d), dtype, 13)
    params = {"num_heads": h, "num_kv_heads": hkv, "causal": causal, "window": window,
              "scale": 0.25}
    ins = [q, kc, vc, tables, np.array(lens, np.int32), np.full(3, s, np.int64)]
    import atbcore.backends.torch.paged as paged

    calls = []
    real = paged.prefill_attention
    monkeypatch.setattr(paged, "prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    check_op("PagedAttention", params, ins)
    got = run("PagedAttention", params, ins)
    assert calls  # the in-place path ran (not the per-sequence gathering one)
    for b, n in enumerate(lens):
        qb = q[b * s:(b + 1) * s].transpose(1, 0, 2)[None]
        kb, vb = (c[first + b, :n].transpose(1, 0, 2)[None] for c in (kc, vc))
        want = run("FlashAttention", dict(params, layout="BNSD"), [qb, kb, vb])
        atb.assert_close(got[b * s:(b + 1) * s], want[0].transpose(1, 0, 2), dtype,
                         f"sequence {b} contiguous rows vs flash")
