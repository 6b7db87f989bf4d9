"""The attention, RoPE, cache-copy, argmax and prefill probes of ``cpu_kernel_probes.py``.

Same contract as there (each probe returns the bad call and the buffers it must
leave untouched); they register in the same ``cpu_kernel_probes_registry.PROBES``.
"""

from __future__ import annotations

import torch

from atbcore.backends.cpu_kernels import torch_decode as cd
from atbcore.backends.cpu_kernels import torch_ops as co
from atbcore.backends.cpu_kernels import torch_prefill as cp
from cpu_kernel_probes_registry import probe, sentinel

# ------------------------------------------------------------------ paged / decode attention
def _paged(tables, lens, kv=2, window=None, out=None):
    kc = torch.randn(4, 16, kv, 32)
    return lambda: cd.paged_decode_attention(torch.randn(2, 4, 32), kc, kc.clone(), tables,
                                             lens, scale=0.2, window=window, out=out)


@probe
def paged_block_id_past_the_cache():  # the case: block id 1 << 28
    out = sentinel(2, 4, 32)
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
    out = sentinel(2, 4, 32)
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
    out = sentinel(5, 4, 16)
    k = torch.randn(5, 0, 16)
    return lambda: cp.prefill_attention(torch.randn(5, 4, 16), k, k, scale=0.25, q_lens=[5],
                                        out=out), [out]


@probe
def prefill_lengths_past_the_tokens():
    out = sentinel(5, 4, 16)
    k = torch.randn(5, 2, 16)
    return lambda: cp.prefill_attention(torch.randn(5, 4, 16), k, k, scale=0.25,
                                        q_lens=[3, 3], out=out), [out]


@probe
def prefill_string_lengths():
    k = torch.randn(5, 2, 16)
    return lambda: cp.prefill_attention(torch.randn(5, 4, 16), k, k, scale=0.25,
                                        q_lens=["5"]), []
