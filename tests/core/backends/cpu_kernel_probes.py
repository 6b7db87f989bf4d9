"""Bad calls of the C-kernel wrappers, run one after another in a child process.

Each probe builds its tensors, makes one bad call and reports one JSON line:
``{"probe": name, "got": "AtbError" | "no error" | "<ExceptionType>",
"untouched": bool}`` (``untouched``: every buffer the call could have written still
holds what it held before). The line ``{"start": name}`` is printed (flushed)
before each call, so when a wrapper lets a bad call reach the C code and it
crashes, the parent sees which probe killed the process. Run as a script by
``test_cpu_kernel_probes.py``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from atbcore.backends.cpu_kernels import torch_decode as cd
from atbcore.backends.cpu_kernels import torch_ops as co
from atbcore.backends.cpu_kernels import torch_prefill as cp
from atbcore.errors import AtbError

PROBES: dict[str, object] = {}


def probe(fn):
    PROBES[fn.__name__] = fn
    return fn


def _sentinel(*shape, dtype=torch.float32):
    return torch.full(shape, 7.0, dtype=dtype)


# ------------------------------------------------------------------ norms
@probe
def rms_norm_short_weight():  # the segfault: a 1-element weight for 2**24 columns
    return lambda: co.rms_norm(torch.randn(2, 1 << 24), torch.ones(1), 1 << 24, 1e-6), []


@probe
def rms_norm_n_not_the_trailing_extent():
    return lambda: co.rms_norm(torch.randn(3, 10), torch.ones(12), 12, 1e-6), []


@probe
def layer_norm_short_bias():
    return lambda: co.layer_norm(torch.randn(4, 64), torch.ones(64), torch.zeros(8), 64,
                                 1e-5), []


@probe
def rms_norm_residual_wrong_shape():
    return lambda: co.rms_norm(torch.randn(4, 64), torch.ones(64), 64, 1e-6,
                               residual=torch.randn(2, 64)), []


@probe
def rms_norm_residual_other_dtype():
    return lambda: co.rms_norm(torch.randn(4, 64), torch.ones(64), 64, 1e-6,
                               residual=torch.randn(4, 64).half()), []


@probe
def rms_norm_out_wrong_shape():
    out = _sentinel(4, 32)
    return lambda: co.rms_norm(torch.randn(4, 64), torch.ones(64), 64, 1e-6, out=out), [out]


@probe
def rms_norm_meta_out():
    out = torch.empty(4, 64, device="meta")
    return lambda: co.rms_norm(torch.randn(4, 64), torch.ones(64), 64, 1e-6, out=out), []


@probe
def rms_norm_float64():
    return lambda: co.rms_norm(torch.randn(4, 64, dtype=torch.float64), None, 64, 1e-6), []


@probe
def rms_norm_not_a_tensor():
    return lambda: co.rms_norm([[1.0, 2.0]], None, 2, 1e-6), []


@probe
def rms_norm_eps_not_a_number():
    return lambda: co.rms_norm(torch.randn(4, 64), None, 64, "small"), []


# ------------------------------------------------------------------ activations
@probe
def activation_short_up():
    return lambda: co.activation(torch.randn(8, 256), "silu", up=torch.randn(8, 16)), []


@probe
def activation_short_bias():
    return lambda: co.activation(torch.randn(8, 256), "gelu", bias=torch.randn(3)), []


@probe
def activation_short_bias_up():
    return lambda: co.activation(torch.randn(8, 256), "silu", split=True,
                                 bias_up=torch.randn(4)), []


@probe
def activation_up_other_dtype():
    return lambda: co.activation(torch.randn(8, 64), "silu",
                                 up=torch.randn(8, 64).bfloat16()), []


@probe
def activation_split_odd_width():
    return lambda: co.activation(torch.randn(8, 65), "silu", split=True), []


@probe
def activation_unknown_name():
    return lambda: co.activation(torch.randn(8, 64), "swishy"), []


@probe
def activation_out_wrong_shape():
    out = _sentinel(8, 128)  # split=True gives [8, 64]
    return lambda: co.activation(torch.randn(8, 128), "silu", split=True, out=out), [out]


# ------------------------------------------------------------------ softmax
@probe
def softmax_mask_not_broadcastable():
    out = _sentinel(2, 4, 8)
    return lambda: co.softmax(torch.randn(2, 4, 8), mask=torch.ones(3, 8, dtype=torch.bool),
                              out=out), [out]


@probe
def softmax_mask_int_dtype():
    return lambda: co.softmax(torch.randn(2, 8), mask=torch.ones(2, 8, dtype=torch.int32)), []


@probe
def softmax_causal_one_dim():
    return lambda: co.softmax(torch.randn(8), causal=True), []


# ------------------------------------------------------------------ linear_rows
@probe
def linear_rows_k_mismatch():
    out = _sentinel(2, 64)
    return lambda: cd.linear_rows(torch.randn(2, 100), torch.randn(64, 128), out=out), [out]


@probe
def linear_rows_short_bias():
    return lambda: cd.linear_rows(torch.randn(2, 128), torch.randn(64, 128),
                                  bias=torch.randn(3)), []


@probe
def linear_rows_int8_without_scale():
    w = torch.randint(-5, 5, (64, 128), dtype=torch.int8)
    return lambda: cd.linear_rows(torch.randn(2, 128), w), []


@probe
def linear_rows_short_scale():
    w = torch.randint(-5, 5, (64, 128), dtype=torch.int8)
    return lambda: cd.linear_rows(torch.randn(2, 128), w, scale=torch.rand(2)), []


@probe
def linear_rows_short_norm_weight():
    return lambda: cd.linear_rows(torch.randn(2, 128), torch.randn(64, 128), rms_norm_eps=1e-6,
                                  rms_norm_weight=torch.ones(4)), []


@probe
def linear_rows_bound_k_mismatch():
    out = _sentinel(2, 64)
    return lambda: cd.linear_rows_bound(torch.randn(2, 100), torch.randn(64, 128), out), [out]


@probe
def linear_rows_bound_short_bias():
    out = _sentinel(2, 64)
    return lambda: cd.linear_rows_bound(torch.randn(2, 128), torch.randn(64, 128), out,
                                        bias=torch.randn(5)), [out]


@probe
def linear_rows_zero_threads():
    return lambda: cd.linear_rows(torch.randn(2, 128), torch.randn(64, 128), threads=-3), []


# ------------------------------------------------------------------ paged / decode attention
def _paged(tables, lens, kv=2, window=None, out=None):
    kc = torch.randn(4, 16, kv, 32)
    return lambda: cd.paged_decode_attention(torch.randn(2, 4, 32), kc, kc.clone(), tables,
                                             lens, scale=0.2, window=window, out=out)


@probe
def paged_block_id_past_the_cache():  # the case: block id 1 << 28
    out = _sentinel(2, 4, 32)
    t = torch.tensor([[0, 1 << 28], [2, 3]], dtype=torch.int32)
    return _paged(t, torch.tensor([20, 20], dtype=torch.int32), out=out), [out]


@probe
def paged_negative_block_id():
    t = torch.tensor([[0, 1], [-1, 3]], dtype=torch.int64)
    return _paged(t, torch.tensor([20, 20])), []


@probe
def paged_length_past_the_tables():
    t = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return _paged(t, torch.tensor([20, 33], dtype=torch.int32)), []


@probe
def paged_zero_kv_heads():
    t = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return _paged(t, torch.tensor([20, 20], dtype=torch.int32), kv=0), []


@probe
def paged_negative_window():
    t = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return _paged(t, torch.tensor([20, 20], dtype=torch.int32), window=-4), []


@probe
def paged_float_tables():
    return _paged(torch.zeros(2, 2), torch.tensor([20, 20], dtype=torch.int32)), []


@probe
def decode_attention_n_past_the_cache():
    k = torch.randn(2, 16, 2, 32)
    out = _sentinel(2, 4, 32)
    return lambda: cd.decode_attention(torch.randn(2, 4, 32), k, k, n=17, scale=0.1,
                                       out=out), [out]


@probe
def decode_attention_bound_zero_kv_heads():
    k = torch.randn(2, 16, 0, 32)
    return lambda: cd.decode_attention_bound(torch.randn(2, 4, 32), k, k, scale=0.1), []


@probe
def decode_attention_bound_float_range():
    k = torch.randn(2, 16, 2, 32)
    return lambda: cd.decode_attention_bound(torch.randn(2, 4, 32), k, k, scale=0.1)(0, 4.5), []


# ------------------------------------------------------------------ rope
def _rope(q_heads=4, k_heads=2, head_dim=16, batch=2, seq=3, table_len=8, q=None, k=None,
          cos=None, pos=None, tab_offset=0, k_out=None, cache_len=0):
    q = torch.randn(2, 3, 4 * 16) if q is None else q
    k = torch.randn(2, 3, 2 * 16) if k is None else k
    cos = torch.randn(8, 16) if cos is None else cos
    ko = k if k_out is None else k_out
    return lambda: co.rope(q, k, cos, cos.clone(), layout="BSH", head_dim=head_dim,
                           rotary_dim=16, q_heads=q_heads, k_heads=k_heads, interleave=False,
                           batch=batch, seq=seq, table_len=table_len, pos=pos,
                           tab_offset=tab_offset, q_out=q, k_out=ko, cache_len=cache_len), [q, k]


@probe
def rope_lying_q_heads():
    return _rope(q_heads=64)


@probe
def rope_lying_k_heads():
    return _rope(k_heads=9)


@probe
def rope_lying_head_dim():
    return _rope(head_dim=64)


@probe
def rope_lying_batch():
    return _rope(batch=50)


@probe
def rope_lying_seq():
    return _rope(seq=30)


@probe
def rope_table_len_past_the_table():
    return _rope(table_len=4096)


@probe
def rope_negative_tab_offset():
    return _rope(tab_offset=-3)


@probe
def rope_short_positions():
    return _rope(pos=torch.zeros(2, dtype=torch.int64))


@probe
def rope_cache_of_the_wrong_shape():
    return _rope(k_out=torch.zeros(2, 8, 3, 16), cache_len=8)


@probe
def rope_cache_bound_negative_slot():
    q, k, v = torch.randn(2, 64), torch.randn(2, 32), torch.randn(2, 32)
    kc, vc = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    cos = torch.randn(2, 1, 16)
    call = cd.rope_cache_bound(q, k, v, cos, cos.clone(), kc, vc, head_dim=16, rotary_dim=16)
    return lambda: call(-1), [q, k, kc, vc]


@probe
def rope_cache_bound_short_cache():
    q, k, v = torch.randn(2, 64), torch.randn(2, 32), torch.randn(2, 32)
    kc = torch.zeros(1, 8, 2, 16)
    cos = torch.randn(2, 1, 16)
    return lambda: cd.rope_cache_bound(q, k, v, cos, cos.clone(), kc, kc.clone(), head_dim=16,
                                       rotary_dim=16), [q, k, kc]


@probe
def rope_bound_head_dim_not_dividing():
    q, k = torch.randn(2, 64), torch.randn(2, 32)
    cos = torch.randn(2, 1, 12)
    return lambda: cd.rope_bound(q, k, cos, cos.clone(), head_dim=12, rotary_dim=12), [q, k]


@probe
def rope_bound_short_tables():
    q, k = torch.randn(2, 64), torch.randn(2, 32)
    cos = torch.randn(2, 1, 8)
    return lambda: cd.rope_bound(q, k, cos, cos.clone(), head_dim=16, rotary_dim=16), [q, k]


# ------------------------------------------------------------------ cache copy, argmax, prefill
@probe
def reshape_and_cache_slot_past_the_cache():
    kc = torch.zeros(2, 4, 2, 8)
    return lambda: cd.reshape_and_cache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), kc,
                                        kc.clone(), torch.tensor([0, 1, 8])), [kc]


@probe
def reshape_and_cache_wrong_rows():
    kc = torch.zeros(2, 4, 2, 8)
    return lambda: cd.reshape_and_cache(torch.randn(3, 4, 8), torch.randn(3, 4, 8), kc,
                                        kc.clone(), torch.tensor([0, 1, 2])), [kc]


@probe
def reshape_and_cache_more_slots_than_tokens():
    kc = torch.zeros(2, 4, 2, 8)
    return lambda: cd.reshape_and_cache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), kc,
                                        kc.clone(), torch.tensor([0, 1, 2, 3, 4])), [kc]


@probe
def argmax_rows_empty_vocabulary():
    return lambda: cd.argmax_rows(torch.randn(3, 0)), []


@probe
def prefill_zero_kv_heads():
    out = _sentinel(5, 4, 16)
    k = torch.randn(5, 0, 16)
    return lambda: cp.prefill_attention(torch.randn(5, 4, 16), k, k, scale=0.25, q_lens=[5],
                                        out=out), [out]


@probe
def prefill_lengths_past_the_tokens():
    out = _sentinel(5, 4, 16)
    k = torch.randn(5, 2, 16)
    return lambda: cp.prefill_attention(torch.randn(5, 4, 16), k, k, scale=0.25,
                                        q_lens=[3, 3], out=out), [out]


@probe
def prefill_string_lengths():
    k = torch.randn(5, 2, 16)
    return lambda: cp.prefill_attention(torch.randn(5, 4, 16), k, k, scale=0.25,
                                        q_lens=["5"]), []


def main(names: list[str]) -> None:
    for name in names:
        print(json.dumps({"start": name}), flush=True)
        if name == "_abort":  # the harness's own test: a child that dies mid-run
            os.abort()
        call, buffers = PROBES[name]()
        before = [b.clone() for b in buffers]
        try:
            call()
            got = "no error"
        except AtbError:
            got = "AtbError"
        except Exception as e:  # the probe reports every other kind
            got = type(e).__name__
        untouched = all(torch.equal(b, a) for b, a in zip(buffers, before))
        print(json.dumps({"probe": name, "got": got, "untouched": untouched}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(PROBES))
