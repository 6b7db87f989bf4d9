"""The decode-time attention ops on framework-free views: ``PagedAttention`` with one
query token per sequence (``atb_decode_attention`` reading the cache blocks in place)
and ``RopeKVCache`` into a paged cache (``atb_rope`` rotating q and k and writing k
and v at their slots, in one call). With them a decode step of a lowered decoder runs
on the C kernels from MindSpore or Paddle tensors as it does from torch tensors.

Values (block ids, context lengths, slots) are checked by the ops' ``check_values``
before a call from user code; the kernels also refuse a context length past the
block table's reach and a slot past the cache (nothing written)."""

from __future__ import annotations

import math
import struct
from typing import Any, Mapping

from ...dtypes import Dtype
from ...ops.rope import rope_geometry
from .native import DTYPE_CODES, NativeView
from .native_ops import THREADS, Step
from .native_rope import MAX_TABLE_LEN, RopeSpec, _bshd, _desc

__all__ = ["PagedDecodeSpec", "RopeKVCacheSpec"]

ATTN = struct.Struct("<32qd2q")  # DecAttnArgs (attn.h)
MAX_HEAD_DIM = 512               # ATB_ATTN_MAX_D in attn.h
_INTS = (Dtype.INT32, Dtype.INT64)


class PagedDecodeSpec:
    """PagedAttention with one query token per sequence (decode); several tokens per
    sequence (a prefill) are left to the framework's kernel."""

    entry = "decode_attention"
    has_workspace = False
    launches = 1

    def workspace(self, p: Any, shapes: Mapping[str, tuple]) -> int:
        return 0

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        q, kc, vc = views["query"], views["key_cache"], views["value_cache"]
        bt, cl = views["block_tables"], views["context_lens"]
        if any(not v.contiguous for v in views.values()):
            return "a tensor is not contiguous"
        if q.dtype not in DTYPE_CODES or kc.dtype not in DTYPE_CODES or vc.dtype != kc.dtype:
            return "q or caches not fp32/bf16/fp16 (caches of one dtype)"
        if bt.dtype not in _INTS or cl.dtype not in _INTS:
            return "block_tables / context_lens not int32/int64"
        if len(q.shape) != 3 or len(kc.shape) != 4 or q.shape[0] != bt.shape[0]:
            return "several query tokens per sequence (a prefill; the C kernel decodes)"
        if q.shape[2] > MAX_HEAD_DIM or kc.shape[1] == 0:
            return f"head_dim past {MAX_HEAD_DIM} or an empty cache block"
        return None

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        q = views["query"]
        return [(q.shape, q.dtype)]

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        q, kc, vc = views["query"], views["key_cache"], views["value_cache"]
        bt, cl, y = views["block_tables"], views["context_lens"], outs[0]
        b, h, d = q.shape
        bs, kv = kc.shape[1], kc.shape[2]
        if b == 0:
            return []
        scale = float(p.scale) if p.scale is not None else 1.0 / math.sqrt(d)
        window = min(int(p.window), 1 << 62) if p.window else 0
        fields = (q.address, kc.address, vc.address, y.address, 0, DTYPE_CODES[q.dtype],
                  DTYPE_CODES[kc.dtype], DTYPE_CODES[y.dtype], b, h, kv, d,
                  q.strides[0], q.strides[1], *kc.strides[:3], *vc.strides[:3],
                  y.strides[0], y.strides[1], 0, 0, cl.address, int(cl.dtype == Dtype.INT32),
                  window, bt.address, int(bt.dtype == Dtype.INT32), bt.strides[0], bs,
                  THREADS, scale, 0, bt.shape[1] * bs)
        return [Step("decode_attention", ATTN, fields)]


class RopeKVCacheSpec(RopeSpec):
    """RopeKVCache with ``slot_mapping`` (the paged form a lowered decoder uses): q
    rotated into a new output, k rotated and v copied into the caches at their slots,
    in one ``atb_rope`` call. Its outputs are q_out and the caches themselves (named
    by :meth:`outputs`: a bound call hands the input tensors on as those outputs)."""

    in_place_outputs = True
    max_table_len = MAX_TABLE_LEN

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        sl = views.get("slot_mapping")
        if sl is None:
            return "no slot_mapping (the contiguous-cache form)"
        k, v, kc, vc = (views[n] for n in ("k", "v", "key_cache", "value_cache"))
        if not (k.dtype == v.dtype == kc.dtype == vc.dtype == views["q"].dtype):
            return "q, k, v and caches of different dtypes"
        if any(not t.contiguous for t in (v, kc, vc, sl)) or sl.dtype not in _INTS:
            return "v, caches or slot_mapping not contiguous (or slots not int32/int64)"
        return super().why_not(p, {n: views[n] for n in ("q", "k", "position_ids", "cos",
                                                            "sin") if n in views})

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list:
        q = views["q"]
        return [(q.shape, q.dtype), "key_cache", "value_cache"]

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list,
              table_len: int = 0) -> list:
        rope = {n: views[n] for n in ("q", "k", "position_ids", "cos", "sin") if n in views}
        k, v, kc, vc, sl = (views[n] for n in ("k", "v", "key_cache", "value_cache",
                                               "slot_mapping"))
        steps = super().steps(p, rope, [outs[0], k], table_len=table_len)
        if not steps:
            return []
        f = list(steps[0].fields)
        hk, hd = f[18], f[15]
        row = hk * hd  # a cache row [Hk, D], rows flat over [blocks * block_size]
        layout = rope_geometry("RoPE", p, {n: _desc(x) for n, x in rope.items()}).layout
        f[3], f[4], f[5] = kc.address, v.address, vc.address
        f[28:31] = (0, row, hd)
        f[31:34] = _bshd(v, layout, hd)
        f[34:37] = (0, row, hd)
        f[42], f[43] = kc.shape[0] * kc.shape[1], 0
        f[44], f[45] = sl.address, int(sl.dtype == Dtype.INT32)
        return [Step("rope", steps[0].layout, tuple(f), keep=steps[0].keep)]
