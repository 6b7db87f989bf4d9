"""The int8 KV cache ops: ``ReshapeAndCacheInt8`` quantizes new keys/values into int8
block caches with one scale per token and KV head; ``PagedAttentionInt8`` attends
over such caches, dequantizing the rows it reads.

Quantization (symmetric, per token and KV head, over the head's ``D`` values):
``s = absmax / 127`` stored in the scale cache's dtype (fp16 for atb's caches),
``q = clip(round(x / s), -127, 127)`` with the stored ``s`` (0 where ``s`` is 0 or
not finite); a read is ``q * s``. ``D + 2`` bytes per token and head against bf16's
``2 D``.

Caches: ``key_cache``/``value_cache`` int8 ``[num_blocks, block_size, Hkv, D]``,
``key_scale``/``value_scale`` ``[num_blocks, block_size, Hkv]`` (a float dtype);
slots and block tables as :mod:`.paged`.

    kc, vc, ks, vs = ReshapeAndCacheInt8.execute([k, v, kc, vc, ks, vs, slots])
    out, = PagedAttentionInt8.execute([q, kc, vc, ks, vs, block_tables, context_lens])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..tensor import TensorDesc
from .attention import INT_DTYPES, host_ints
from .base import (FLOAT_DTYPES, OpDef, expect_dim, expect_dtype, expect_param_dtype,
                   expect_rank, expect_same_dtype, expect_shape)
from .paged import (PagedAttentionParams, ReshapeAndCache, ReshapeAndCacheParams, _paged_check,
                    paged_check_values, paged_reference)
from .registry import register_op

__all__ = ["SCALE_DTYPE", "quantize_int8_np", "dequantize_int8_np"]

SCALE_DTYPE = Dtype.FP16  # the scale dtype of atb's int8 KV caches
QMAX = 127.0


def quantize_int8_np(x: np.ndarray, scale_dtype: Any = np.float16) -> tuple[np.ndarray, np.ndarray]:
    """``x`` ``[..., D]`` -> (int8 ``[..., D]``, scales ``[...]`` in ``scale_dtype``),
    computed in float64 (the module docstring's rule)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = (np.abs(x).max(axis=-1) / QMAX).astype(scale_dtype)
        sf = s.astype(np.float64)
        ok = np.isfinite(sf) & (sf > 0)
        r = np.where(ok[..., None], x / np.where(ok, sf, 1.0)[..., None], 0.0)
        q = np.clip(np.nan_to_num(np.round(r), nan=0.0), -QMAX, QMAX).astype(np.int8)
    return q, s


def dequantize_int8_np(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """int8 ``q`` ``[..., D]`` times scales ``s`` ``[...]`` in float64."""
    return np.asarray(q, dtype=np.float64) * np.asarray(s, dtype=np.float64)[..., None]


def _check_scales(op: str, kc: TensorDesc, ks: TensorDesc, vs: TensorDesc) -> None:
    for name, d in (("key_scale", ks), ("value_scale", vs)):
        expect_dtype(op, name, d, FLOAT_DTYPES)
        expect_shape(op, name, d, kc.shape[:3])
    expect_same_dtype(op, "key_scale", ks, "value_scale", vs)


@register_op
class ReshapeAndCacheInt8(OpDef):
    """Quantize key/value ``[T, Hkv, D]`` (float) into the int8 caches and their scale
    caches at ``slot_mapping`` (in place; slot -1: not stored)."""

    name = "ReshapeAndCacheInt8"
    Params = ReshapeAndCacheParams
    inputs = ("key", "value", "key_cache", "value_cache", "key_scale", "value_scale",
              "slot_mapping")
    outputs = ("key_cache", "value_cache", "key_scale", "value_scale")
    inplace = {0: 2, 1: 3, 2: 4, 3: 5}

    def infer_shape(self, p, ins):
        k, v, kc, vc, ks, vs, slots = (ins[n] for n in self.input_names)
        for name, d in (("key", k), ("value", v)):
            expect_dtype(self.name, name, d, FLOAT_DTYPES)
            expect_param_dtype(self.name, p, name, d)
            expect_rank(self.name, name, d, 3)
        expect_same_dtype(self.name, "key", k, "value", v)
        for name, d in (("key_cache", kc), ("value_cache", vc)):
            expect_dtype(self.name, name, d, {Dtype.INT8})
            expect_rank(self.name, name, d, 4)
        t, hkv, dim = k.shape
        expect_dim(self.name, "value", v, 0, t, "tokens")
        expect_shape(self.name, "value", v, (t, hkv, dim))
        expect_shape(self.name, "key_cache", kc, (kc.shape[0], kc.shape[1], hkv, dim))
        expect_shape(self.name, "value_cache", vc, kc.shape)
        _check_scales(self.name, kc, ks, vs)
        expect_dtype(self.name, "slot_mapping", slots, INT_DTYPES)
        expect_shape(self.name, "slot_mapping", slots, (t,))
        return [kc, vc, ks, vs]

    def check_values(self, p, ins):
        ReshapeAndCache.check_values(self, p, ins)

    def reference(self, p, ins):
        kc, vc, ks, vs = (ins[n] for n in ("key_cache", "value_cache", "key_scale",
                                             "value_scale"))
        slots = host_ints(ins["slot_mapping"])
        keep = slots >= 0
        blk, off = slots[keep] // kc.shape[1], slots[keep] % kc.shape[1]
        for x, cache, scale in ((ins["key"], kc, ks), (ins["value"], vc, vs)):
            q, s = quantize_int8_np(np.asarray(x)[keep], scale.dtype)
            cache[blk, off], scale[blk, off] = q, s   # the caller's arrays: in place
        return [kc, vc, ks, vs]


@register_op
class PagedAttentionInt8(OpDef):
    """:class:`~.paged.PagedAttention` over int8 caches with per-token, per-head scales
    (``q * s`` read for every key/value row). Same params, same semantics."""

    name = "PagedAttentionInt8"
    Params = PagedAttentionParams
    inputs = ("query", "key_cache", "value_cache", "key_scale", "value_scale", "block_tables",
              "context_lens", "q_seq_lens?")
    outputs = ("out",)

    def _check(self, p: Any, ins: Any) -> None:
        q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
        for name, d in (("key_cache", kc), ("value_cache", vc)):
            expect_dtype(self.name, name, d, {Dtype.INT8})
        as_float = {n: (d.replace(dtype=q.dtype) if n in ("key_cache", "value_cache") else d)
                    for n, d in ins.items() if d is not None}
        _paged_check(self.name, p, {**dict.fromkeys(("q_seq_lens",)), **as_float})
        _check_scales(self.name, kc, ins["key_scale"], ins["value_scale"])

    def infer_shape(self, p, ins):
        self._check(p, ins)
        return [ins["query"]]

    def check_values(self, p, ins):
        descs = {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()}
        self._check(p, descs)
        paged_check_values(self.name, descs, ins)

    def reference(self, p, ins):
        self._check(p, {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()})
        kd = dequantize_int8_np(ins["key_cache"], ins["key_scale"])
        vd = dequantize_int8_np(ins["value_cache"], ins["value_scale"])
        return [paged_reference(p, ins, kd, vd)]

