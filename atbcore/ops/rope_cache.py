"""RopeKVCache: RoPE on q and k fused with the write of k and v into a KV cache.

``RopeKVCache(q, k, v, key_cache, value_cache, position_ids?, cos?, sin?)``
returns ``(q_out, key_cache, value_cache)``: ``q_out`` is q rotated as
:class:`~atbcore.ops.rope.RoPE` does it; the rotated k and v of token
``(b, s)`` are written into row ``pos[b, s]`` of the contiguous caches
``[B, S_max, Hkv, D]`` (``pos`` = ``position_ids``, else
``position_offset + s``), in place: the outputs are the cache tensors
themselves. Params are RoPE's. q/k/v follow RoPE's layouts (BSH, BSND, BNSD);
v has k's shape. Positions must lie in ``[0, S_max)``; within one batch entry
they should be distinct (a repeated position keeps its last token).

With ``slot_mapping`` (int32/int64 ``[B * S]``, the ReshapeAndCache convention) the
caches are paged blocks ``[num_blocks, block_size, Hkv, D]`` and token ``(b, s)``
goes to flat row ``slot_mapping[b * S + s]`` of ``[num_blocks * block_size, Hkv,
D]``; positions then only pick the rotation. This is what the ``rope_cache`` fusion
makes of a RoPE whose k is written by a ReshapeAndCache (an in-place cache block).

One decode step of a LLaMA layer is then ``RopeKVCache`` followed by attention
over ``key_cache[:, :len]`` — one kernel instead of RoPE's and two cache copies.

Example::

    op = Builder().build_operation("RopeKVCache", {"num_heads": 32, "num_kv_heads": 8})
    q_rot, k_cache, v_cache = op.execute([q, k, v, k_cache, v_cache, position_ids])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ShapeError
from ..tensor import TensorDesc
from .base import OpDef, expect_dtype, expect_rank, expect_same_dtype, expect_shape
from .gather import check_index_range
from .registry import get_op, register_op
from .rope import RoPEParams, check_positions, rope_geometry

__all__ = ["RopeKVCache", "cache_rows", "compose_rope_kv_cache"]


def cache_rows(p: RoPEParams, pos: Any, batch: int, seq: int) -> np.ndarray:
    """Cache row of every token, int64 ``[B, S]``."""
    if pos is None:
        return np.broadcast_to(np.arange(seq, dtype=np.int64) + int(p.position_offset),
                               (batch, seq))
    ids = np.asarray(pos).astype(np.int64)
    return np.broadcast_to(ids[None] if ids.ndim == 1 else ids, (batch, seq))


@register_op
class RopeKVCache(OpDef):
    """RoPE on q and k, then k and v written into the KV cache at their positions."""

    name = "RopeKVCache"
    aliases = ("RoPEKVCache", "RopeReshapeAndCache", "RopeCache")
    Params = RoPEParams
    inputs = ("q", "k", "v", "key_cache", "value_cache", "position_ids?", "cos?", "sin?",
              "slot_mapping?")
    outputs = ("q_out", "key_cache", "value_cache")
    inplace = {1: 3, 2: 4}

    def _geometry(self, p, ins):
        g = rope_geometry(self.name, p, {n: ins.get(n) for n in
                                         ("q", "k", "position_ids", "cos", "sin")})
        k, v, kc, vc = ins["k"], ins["v"], ins["key_cache"], ins["value_cache"]
        expect_same_dtype(self.name, "k", k, "v", v)
        expect_shape(self.name, "v", v, k.shape)
        for name, c in (("key_cache", kc), ("value_cache", vc)):
            expect_rank(self.name, name, c, 4)
            expect_same_dtype(self.name, "k", k, name, c)
        slots = ins.get("slot_mapping")
        if slots is not None:
            want = (kc.shape[0], kc.shape[1], g.k_heads, g.head_dim)
            if tuple(kc.shape) != want:
                raise ShapeError(self.name, "input 'key_cache' shape [blocks, block_size, "
                                 "kv_heads, head_dim]", list(want), list(kc.shape))
            expect_dtype(self.name, "slot_mapping", slots, {Dtype.INT32, Dtype.INT64})
            if tuple(slots.shape) != (g.batch * g.seq,):
                raise ShapeError(self.name, "input 'slot_mapping' shape (a row per token)",
                                 [g.batch * g.seq], list(slots.shape))
            expect_shape(self.name, "value_cache", vc, kc.shape)
            return g
        want = (g.batch, kc.shape[1], g.k_heads, g.head_dim)
        if tuple(kc.shape) != want:
            raise ShapeError(self.name, "input 'key_cache' shape [B, S_max, kv_heads, head_dim]",
                             list(want), list(kc.shape))
        expect_shape(self.name, "value_cache", vc, kc.shape)
        if ins.get("position_ids") is None and int(p.position_offset) + g.seq > kc.shape[1]:
            raise ShapeError(self.name, "position_offset + seq within the cache length",
                             f"<= {kc.shape[1]}", int(p.position_offset) + g.seq)
        return g

    def infer_shape(self, p, ins):
        self._geometry(p, ins)
        return [ins["q"], ins["key_cache"], ins["value_cache"]]

    def check_values(self, p, ins):
        check_positions(self.name, ins.get("position_ids"), ins.get("cos"))
        pos, slots = ins.get("position_ids"), ins.get("slot_mapping")
        if slots is not None:
            kd = TensorDesc.of(ins["key_cache"])
            check_index_range(self.name, "slot_mapping", slots, kd.shape[0] * kd.shape[1],
                              "rows of the paged KV cache")
            return
        if pos is not None and len(pos.shape) and int(np.prod(tuple(pos.shape))):
            hi, n = int(pos.max()), TensorDesc.of(ins["key_cache"]).shape[1]
            if hi >= n:
                raise InputError(self.name, "position_ids values (rows of the KV cache)",
                                 f"< {n} (S_max)", f"max {hi}")

    def reference(self, p, ins):
        descs = {n: None if x is None else TensorDesc(np.shape(x), Dtype.of(np.asarray(x).dtype))
                 for n, x in ins.items()}
        g = self._geometry(p, descs)
        self.check_values(p, ins)
        q_out, k_rot = get_op("RoPE").reference(p, {n: ins.get(n) for n in
                                                    ("q", "k", "position_ids", "cos", "sin")})
        kc, vc = ins["key_cache"], ins["value_cache"]
        slots = ins.get("slot_mapping")
        if slots is not None:  # flat rows of the paged blocks
            rows = np.asarray(slots).astype(np.int64).reshape(1, -1)
        else:
            rows = cache_rows(p, ins.get("position_ids"), g.batch, g.seq)

        def heads(x):  # -> [B, S, Hkv, D]
            x = np.asarray(x)
            if g.layout == "BSH":
                return x.reshape(g.batch, g.seq, g.k_heads, g.head_dim)
            return x if g.layout == "BSND" else x.transpose(0, 2, 1, 3)

        kh, vh = heads(k_rot), heads(ins["v"])
        for b in range(g.batch):  # in token order: a repeated position keeps the last
            for s in range(g.seq):
                cb, r = (divmod(int(rows[0, b * g.seq + s]), kc.shape[1]) if slots is not None
                         else (b, rows[b, s]))
                kc[cb, r] = kh[b, s]  # the caller's arrays: the op is in place
                vc[cb, r] = vh[b, s]
        return [q_out, kc, vc]


def compose_rope_kv_cache(p: RoPEParams, ins: dict, rope: Any, write: Any, token_rows: Any,
                          native: Any) -> list:
    """RopeKVCache from a backend's own RoPE and ReshapeAndCache kernels (``rope(p,
    ins)``, ``write(params, ins)``), for backends without a fused kernel.
    ``token_rows(x, layout, heads, head_dim)`` makes a q/k/v-layout tensor ``[B*S, H,
    D]`` rows in token order; ``native(np_array)`` a framework tensor. The position
    form writes at slot ``b * S_max + row``, the paged form at its ``slot_mapping``."""
    descs = {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()}
    g = get_op("RopeKVCache")._geometry(p, descs)
    q_rot, k_rot = rope(p, {n: ins.get(n) for n in ("q", "k", "position_ids", "cos", "sin")})
    slots = ins.get("slot_mapping")
    if slots is None:
        from ..tensor import to_numpy

        pos = ins.get("position_ids")
        rows = cache_rows(p, None if pos is None else to_numpy(pos), g.batch, g.seq)
        cap = descs["key_cache"].shape[1]
        slots = native((np.arange(g.batch)[:, None] * cap + rows).reshape(-1).astype(np.int64))
    kc, vc = write(get_op("ReshapeAndCache").make_params({}), {
        "key": token_rows(k_rot, g.layout, g.k_heads, g.head_dim),
        "value": token_rows(ins["v"], g.layout, g.k_heads, g.head_dim),
        "key_cache": ins["key_cache"], "value_cache": ins["value_cache"], "slot_mapping": slots})
    return [q_rot, kc, vc]
