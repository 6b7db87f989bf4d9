"""Paged KV cache ops: ``ReshapeAndCache`` writes new keys/values into block caches
in place; ``PagedAttention`` attends over them through per-sequence block tables.

Cache layout: ``[num_blocks, block_size, kv_heads, head_dim]``. A token's slot is
``block * block_size + offset``; slot ``-1`` means "do not store" (padding).

    k_cache, v_cache = ReshapeAndCache.execute([k, v, k_cache, v_cache, slots])
    out, = PagedAttention.execute([q, k_cache, v_cache, block_tables, context_lens])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ShapeError
from ..tensor import TensorDesc
from .attention import INT_DTYPES, host_ints, ref_attention, validate_head_params
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dim, expect_dtype, expect_param_dtype,
                   expect_rank, expect_same_dtype, expect_shape)
from .registry import register_op

__all__ = ["ReshapeAndCacheParams", "PagedAttentionParams", "gather_blocks_np", "paged_reference",
           "paged_check_values"]

CACHE_DTYPES = FLOAT_DTYPES | {Dtype.INT8}


@dataclass(frozen=True)
class ReshapeAndCacheParams(Params):
    """No math parameters; optional ``dtype`` the key/value must have."""

    dtype: Dtype | None = None


def _descs(ins: Any) -> dict[str, TensorDesc | None]:
    return {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()}


@register_op
class ReshapeAndCache(OpDef):
    """Scatter key/value ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (in place;
    the outputs are the cache tensors themselves)."""

    name = "ReshapeAndCache"
    aliases = ("ReshapeAndCacheOperation",)
    Params = ReshapeAndCacheParams
    inputs = ("key", "value", "key_cache", "value_cache", "slot_mapping")
    outputs = ("key_cache", "value_cache")
    inplace = {0: 2, 1: 3}

    def infer_shape(self, p, ins):
        k, v, kc, vc, slots = (ins[n] for n in self.input_names)
        for name, d in (("key", k), ("value", v)):
            expect_dtype(self.name, name, d, CACHE_DTYPES)
            expect_param_dtype(self.name, p, name, d)
            expect_rank(self.name, name, d, 3)
        for name, d in (("key_cache", kc), ("value_cache", vc)):
            expect_rank(self.name, name, d, 4)
        expect_same_dtype(self.name, "key", k, "value", v)
        expect_same_dtype(self.name, "key", k, "key_cache", kc)
        expect_same_dtype(self.name, "value", v, "value_cache", vc)
        t, hkv, d = k.shape
        expect_dim(self.name, "value", v, 0, t, "tokens")
        expect_dim(self.name, "value", v, 1, hkv, "kv heads")
        expect_shape(self.name, "key_cache", kc, (kc.shape[0], kc.shape[1], hkv, d))
        expect_shape(self.name, "value_cache", vc, (kc.shape[0], kc.shape[1], hkv, v.shape[2]))
        expect_dtype(self.name, "slot_mapping", slots, INT_DTYPES)
        expect_shape(self.name, "slot_mapping", slots, (t,))
        return [kc, vc]

    def check_values(self, p, ins):
        kc, slots = ins["key_cache"], host_ints(ins["slot_mapping"])
        shape = TensorDesc.of(kc).shape
        n = shape[0] * shape[1]
        bad = (slots < -1) | (slots >= n)
        if bad.any():
            raise InputError(self.name, "input 'slot_mapping' values",
                             f"-1 (skip) or in 0..{n - 1} (num_blocks * block_size)",
                             f"{slots[bad][:8].tolist()} at tokens {np.nonzero(bad)[0][:8].tolist()}")

    def reference(self, p, ins):
        k, v, kc, vc = ins["key"], ins["value"], ins["key_cache"], ins["value_cache"]
        slots = host_ints(ins["slot_mapping"])
        keep = slots >= 0
        blk, off = slots[keep] // kc.shape[1], slots[keep] % kc.shape[1]
        kc[blk, off] = k[keep]  # writes the caller's arrays: the op is in place
        vc[blk, off] = v[keep]
        return [kc, vc]


@dataclass(frozen=True)
class PagedAttentionParams(Params):
    """``num_heads`` (head_num), ``num_kv_heads`` (kv_head_num), ``head_dim``
    (size_per_head) — each inferred from the inputs when None; ``scale`` (None =
    1/sqrt(head_dim)); ``causal`` for multi-token queries (aligned to the end of each
    context); ``window`` (sliding window, implies causal); optional ``dtype``."""

    ALIASES = {"sliding_window": "window", "qk_scale": "scale"}
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    scale: float | None = None
    causal: bool = True
    window: int | None = None
    dtype: Dtype | None = None

    def validate(self) -> None:
        validate_head_params(self)


def _paged_check(op: str, p: PagedAttentionParams, ins: dict) -> tuple[int, int, int]:
    """Validate a PagedAttention call; returns (heads, kv_heads, head_dim)."""
    q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
    bt, ctx, qsl = ins["block_tables"], ins["context_lens"], ins.get("q_seq_lens")
    expect_dtype(op, "query", q, FLOAT_DTYPES)
    expect_param_dtype(op, p, "query", q)
    expect_rank(op, "query", q, 3)
    expect_rank(op, "key_cache", kc, 4)
    expect_same_dtype(op, "query", q, "key_cache", kc)
    expect_same_dtype(op, "query", q, "value_cache", vc)
    expect_shape(op, "value_cache", vc, kc.shape)
    t, h, d = q.shape
    hkv = kc.shape[2]
    for name, want, got in (("num_heads", p.num_heads, h), ("head_dim", p.head_dim, d),
                            ("num_kv_heads", p.num_kv_heads, hkv)):
        if want is not None and want != got:
            raise ShapeError(op, f"{name} of the inputs (params {name})", want, got)
    expect_dim(op, "key_cache", kc, 3, d, "head_dim")
    if h % hkv:
        raise ShapeError(op, "kv heads must divide heads", f"a divisor of {h}", hkv)
    expect_dtype(op, "block_tables", bt, INT_DTYPES)
    expect_rank(op, "block_tables", bt, 2)
    b = bt.shape[0]
    for name, dd in (("context_lens", ctx), ("q_seq_lens", qsl)):
        if dd is not None:
            expect_dtype(op, name, dd, INT_DTYPES)
            expect_shape(op, name, dd, (b,))
    if qsl is None and t != b:
        raise ShapeError(op, "input 'query' tokens (one per sequence without q_seq_lens)", b, t)
    return h, hkv, d


@register_op
class PagedAttention(OpDef):
    """Attention of new query tokens over a paged KV cache (decode, or several query
    tokens per sequence with ``q_seq_lens``: each sequence's queries are its last
    ``q_seq_lens[b]`` positions)."""

    name = "PagedAttention"
    aliases = ("PagedAttentionOperation",)
    Params = PagedAttentionParams
    inputs = ("query", "key_cache", "value_cache", "block_tables", "context_lens", "q_seq_lens?")
    outputs = ("out",)

    def infer_shape(self, p, ins):
        _paged_check(self.name, p, ins)
        return [ins["query"]]

    def check_values(self, p, ins):
        d = _descs(ins)
        _paged_check(self.name, p, d)
        paged_check_values(self.name, d, ins)

    def reference(self, p, ins):
        _paged_check(self.name, p, _descs(ins))
        return [paged_reference(p, ins, ins["key_cache"], ins["value_cache"])]


def paged_check_values(op: str, d: dict, ins: Any) -> None:
    """The data checks of a paged attention call (``d``: the inputs' descriptors):
    context lengths, the block ids they use, query lengths."""
    nb, bs = d["key_cache"].shape[:2]
    bt = host_ints(ins["block_tables"])
    ctx = host_ints(ins["context_lens"])
    cap = bt.shape[1] * bs
    if ((ctx < 1) | (ctx > cap)).any():
        raise InputError(op, "input 'context_lens' values",
                         f"in 1..{cap} (max_blocks * block_size)", ctx.tolist())
    for b, n in enumerate(ctx):
        used = bt[b, :-(-int(n) // bs)]
        if ((used < 0) | (used >= nb)).any():
            raise InputError(op, f"input 'block_tables' row {b} values",
                             f"block ids in 0..{nb - 1} for its {n} tokens", used.tolist())
    qsl = ins.get("q_seq_lens")
    if qsl is not None:
        ql = host_ints(qsl)
        if ((ql < 1) | (ql > ctx)).any():
            raise InputError(op, "input 'q_seq_lens' values",
                             "in 1..context_lens[b]", ql.tolist())
        if int(ql.sum()) != d["query"].shape[0]:
            raise InputError(op, "sum of 'q_seq_lens' (query tokens)",
                             d["query"].shape[0], int(ql.sum()))


def paged_reference(p: PagedAttentionParams, ins: Any, kc: np.ndarray, vc: np.ndarray
                    ) -> np.ndarray:
    """The reference of a checked paged attention call over caches ``kc``/``vc``
    (any float dtype); the output in the query's dtype."""
    q = ins["query"]
    d = q.shape[2]
    ctx = host_ints(ins["context_lens"])
    qsl = ins.get("q_seq_lens")
    qlens = np.ones_like(ctx) if qsl is None else host_ints(qsl)
    bt = host_ints(ins["block_tables"])
    scale = p.scale if p.scale is not None else 1.0 / float(np.sqrt(d))
    out = np.zeros(q.shape)
    start = 0
    for b, (n, ql) in enumerate(zip(ctx, qlens)):
        k = gather_blocks_np(kc, bt[b], int(n))  # [n, Hkv, D]
        v = gather_blocks_np(vc, bt[b], int(n))
        qb = q[start:start + ql]  # [ql, H, D]
        o = ref_attention(qb.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                          v.transpose(1, 0, 2)[None], scale=scale, causal=p.causal,
                          window=p.window)
        out[start:start + ql] = o[0].transpose(1, 0, 2)  # [1, H, ql, D] -> [ql, H, D]
        start += ql
    return out.astype(q.dtype)


def gather_blocks_np(cache: np.ndarray, table: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` tokens of one sequence, ``[n, Hkv, D]``, from its block table."""
    bs = cache.shape[1]
    blocks = table[:-(-n // bs)]
    return cache[blocks].reshape(-1, *cache.shape[2:])[:n]
