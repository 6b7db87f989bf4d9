"""The C kernels of the decode step on torch CPU tensors: the few-row matmul
(:mod:`.torch_linear`, re-exported here), one-token attention over a contiguous or
paged KV cache, and RoPE writing the cache slot. The ``*_bound`` forms pack a call's arguments once for a plan that
reuses its tensors. These kernels split their work over the C pool; callers park
torch's own pool meanwhile (:func:`.threads.parked_torch_threads`).
"""

from __future__ import annotations

import math
import struct
from typing import Callable

import torch

from atbcore.errors import DtypeError, ShapeError

from . import bindings, native
from . import torch_checks as chk
from .threads import pool_threads
from .torch_cache_int8 import int8_scales as _int8_scales
from .torch_linear import (LINEAR_WEIGHT_DTYPES, PANEL, linear_rows, linear_rows_bound,
                           pack_panels)
from .torch_ops import (DTYPE_CODES, MAX_ROTARY_DIM, _ROPE, _check, _deliver, _fn,
                        _rope_fields, _rope_status, _rows, _unit_last)

__all__ = ["linear_rows", "linear_rows_bound", "pack_panels", "PANEL", "LINEAR_WEIGHT_DTYPES",
           "decode_attention", "decode_attention_bound",
           "paged_decode_attention", "paged_decode_attention_bound", "rope_cache_bound", "rope_bound", "reshape_and_cache",
           "reshape_and_cache_bound", "argmax_rows"]

_ATTN = struct.Struct("<32qd2q")
_ATTN_I8 = struct.Struct("<32qd2q9q")  # DecAttnArgs with an int8 cache's scale fields
_I8_CODE = 4  # ATB_I8 (common.h)
_CACHE = native.CACHE
_ARGMAX = struct.Struct("<7q")


def _attention_dtypes(op: str, named: tuple) -> None:
    """q, keys, values (name, tensor) in the kernel's dtypes, the caches alike."""
    for name, t in named:
        if t.dtype not in DTYPE_CODES:
            raise DtypeError(op, name, "float32, bfloat16 or float16", str(t.dtype))
    (_, k), (vname, v) = named[1], named[2]
    if v.dtype != k.dtype:
        raise DtypeError(op, vname, f"the key cache's dtype {k.dtype}", str(v.dtype))


def decode_attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                           key_mask: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> Callable[[int, int], torch.Tensor]:
    """Bind one-token attention over a KV cache; returns ``call(lo, n) -> out``.

    ``q`` [B, H, D]; ``k``/``v`` caches [B, cap, KV, D] (H a multiple of KV; any
    strides with D unit-stride); ``key_mask`` bool [B, cap] (keys attended where
    True); ``out`` [B, H, D] (a new one in q's dtype when None). ``call(lo, n)``
    attends to cache positions ``lo <= s < n`` and writes ``out``: fp32 scores and
    softmax, one rounding; a row with every key masked gives zeros. The tensors are
    bound (their addresses packed once): they must stay alive and in place."""
    op = "decode_attention"
    chk.tensor(op, "q", q, dims=(3,))
    chk.tensor(op, "k", k, dims=(4,))
    chk.tensor(op, "v", v, dims=(4,))
    scale = chk.real(op, "scale", scale, finite=False)
    if out is not None:
        chk.output(op, "out", out, q.shape)
    if key_mask is not None:
        chk.tensor(op, "key_mask", key_mask, (torch.bool,))
    if v.shape != k.shape:
        raise ShapeError(op, "q / k / v shapes", "q [B, H, D], k and v [B, cap, KV, D]",
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, d = q.shape
    kv = k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or kv == 0 or h % kv or d > 512:
        raise ShapeError(op, "q against the cache", "the same batch and head_dim (<= 512), "
                         "query heads a multiple of KV heads", f"q {tuple(q.shape)}, cache "
                         f"{tuple(k.shape)}")
    _attention_dtypes(op, (("q", q), ("k", k), ("v", v)))
    if out is None:
        out = torch.empty(b, h, d, dtype=q.dtype)
    if out.shape != q.shape or out.dtype not in DTYPE_CODES:
        raise ShapeError(op, "out", f"{tuple(q.shape)} fp32/bf16/fp16",
                         f"{tuple(out.shape)} {out.dtype}")
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.dim() != 2 or
                                 key_mask.shape[0] != b or key_mask.shape[1] < k.shape[1]):
        raise ShapeError(op, "key_mask", f"bool [{b}, >= {k.shape[1]}]",
                         f"{key_mask.dtype} {tuple(key_mask.shape)}")
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()  # one call each
    for name, st in (("q", qs), ("k", ks), ("v", vs), ("out", os_)):
        if st[-1] != 1:
            raise ShapeError(op, name, "a unit-stride last dim", f"strides {st}")
    cap = k.shape[1]
    m = key_mask
    ms = (0, 0) if m is None else m.stride()
    pre = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
           0 if m is None else m.data_ptr(), DTYPE_CODES[q.dtype], DTYPE_CODES[k.dtype],
           DTYPE_CODES[out.dtype], b, h, kv, d, qs[0], qs[1], ks[0], ks[1], ks[2],
           vs[0], vs[1], vs[2], os_[0], os_[1], ms[0], ms[1], 0, 0, 0, 0, 0, 0, 0)
    fn, pack = _fn("decode_attention"), _ATTN.pack
    keep = (q, k, v, out, m)  # the packed addresses stay valid while the call lives
    empty = q.numel() == 0    # no rows or heads: nothing to attend

    def call(lo: int, n: int) -> torch.Tensor:
        if type(lo) is not int or type(n) is not int:
            lo, n = chk.integer(op, "lo", lo), chk.integer(op, "n", n)
        if not 0 <= lo < n <= cap:
            raise ShapeError(op, "key range", f"0 <= lo < n <= {cap}", f"[{lo}, {n})")
        if empty:
            return keep[3]
        th = pool_threads()
        _check(fn(pack(*pre, th, scale, lo, n)), "decode_attention")
        return keep[3]
    return call


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                           scale: float, window: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """PagedAttention for one query token per sequence, reading the blocks in place.

    ``q`` [B, H, D]; caches [num_blocks, block_size, KV, D] (D unit-stride);
    ``block_tables`` int32/int64 [B, max_blocks]; ``context_lens`` int32/int64 [B]
    (the keys of row b are its first ``context_lens[b]`` positions, the last
    ``window`` of them with a sliding window). fp32 scores and softmax, one
    rounding into ``out`` [B, H, D] (new when None); a row with no key gives zeros.
    The block ids each row reads are checked against the cache (once per change of
    the tables: :func:`.torch_checks.check_block_tables`)."""
    return paged_decode_attention_bound(q, key_cache, value_cache, block_tables, context_lens,
                                        scale=scale, window=window, out=out)()


def paged_decode_attention_bound(q: torch.Tensor, key_cache: torch.Tensor,
                                 value_cache: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, *, scale: float,
                                 window: int | None = None, out: torch.Tensor | None = None,
                                 check_tables: bool = True, key_scale: torch.Tensor | None = None,
                                 value_scale: torch.Tensor | None = None
                                 ) -> Callable[[], torch.Tensor]:
    """:func:`paged_decode_attention` with its arguments packed once: ``call()``
    attends with the tables' and lengths' values then current (checked again per
    call unless ``check_tables`` is False: values atb itself made). The tensors must
    stay alive and in place while the call lives; q, tables and lengths contiguous
    for the packed form to read what the caller writes (else they are copied now).
    int8 caches take ``key_scale``/``value_scale`` ``[num_blocks, block_size, KV]``
    (fp32/bf16/fp16): row ``c`` of the cache reads as ``c * scale``, dequantized as
    the kernel reads it; ``call()`` returns None when a scale it read is inf/NaN
    (the caller then attends over the dequantized rows, where ``0 * inf`` is NaN)."""
    op = "paged_decode_attention"
    quantized = key_scale is not None or value_scale is not None
    cache_dtypes = (torch.int8,) if quantized else chk.FLOATS
    chk.tensor(op, "q", q, dims=(3,))
    chk.tensor(op, "key_cache", key_cache, cache_dtypes, dims=(4,))
    chk.tensor(op, "value_cache", value_cache, cache_dtypes, dims=(4,))
    chk.tensor(op, "block_tables", block_tables, chk.INTS, dims=(2,))
    chk.tensor(op, "context_lens", context_lens, chk.INTS, dims=(1,))
    scale = chk.real(op, "scale", scale, finite=False)
    if window is not None:
        window = min(chk.integer(op, "window", window, 0), 1 << 62)
    chk.output(op, "out", out, q.shape)
    b, h, d = q.shape
    nb, bs, kv, dk = key_cache.shape
    if (value_cache.shape != key_cache.shape or dk != d or kv == 0 or h % kv or d > 512
            or bs == 0):
        raise ShapeError(op, "q against the caches", "caches [blocks, block_size, KV, D] "
                         "with q's D (<= 512), query heads a multiple of KV heads",
                         f"q {tuple(q.shape)}, caches {tuple(key_cache.shape)}, "
                         f"{tuple(value_cache.shape)}")
    if quantized:
        extra = _int8_scales(op, q, key_cache, value_cache, key_scale, value_scale)
    else:
        _attention_dtypes(op, (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)))
    ints = (torch.int32, torch.int64)
    if (block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype not in ints
            or context_lens.shape != (b,) or context_lens.dtype not in ints):
        raise ShapeError(op, "block_tables / context_lens", f"int32/int64 [{b}, *] and [{b}]",
                         f"{block_tables.dtype} {tuple(block_tables.shape)}, "
                         f"{context_lens.dtype} {tuple(context_lens.shape)}")
    q = _unit_last(q)
    bt, cl = block_tables.contiguous(), context_lens.contiguous()
    n = bt.shape[1] * bs                  # the tables' reach
    chk.check_block_tables(op, bt, cl, nb, bs)
    y = out if (out is not None and out.shape == q.shape and out.dtype in DTYPE_CODES
                and out.stride(-1) == 1) else torch.empty(b, h, d, dtype=q.dtype)
    if q.numel() == 0:
        return lambda: _deliver(out, y)
    if n == 0:
        return lambda: _deliver(out, y.zero_())
    kc, vc = _unit_last(key_cache), _unit_last(value_cache)
    pre = (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), y.data_ptr(), 0, DTYPE_CODES[q.dtype],
           _I8_CODE if quantized else DTYPE_CODES[kc.dtype], DTYPE_CODES[y.dtype], b, h, kv, d,
           q.stride(0), q.stride(1),
           kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
           y.stride(0), y.stride(1), 0, 0, cl.data_ptr(), int(cl.dtype == torch.int32),
           int(window or 0), bt.data_ptr(), int(bt.dtype == torch.int32), bt.stride(0), bs)
    scale = float(scale)
    if quantized:  # the scales' fields after (lo, n)
        fn, pack, tail = _fn("decode_attention_i8"), _ATTN_I8.pack, (0, n, *extra[0])
    else:
        fn, pack, tail = _fn("decode_attention"), _ATTN.pack, (0, n)
    # the packed addresses stay valid while the call lives
    keep = (q, kc, vc, bt, cl, extra[1] if quantized else None)
    packed: dict[int, bytes] = {}  # per thread count: the whole argument block
    not_native = bindings.not_native

    def call() -> torch.Tensor:
        if check_tables or y is not out:  # more than the C call
            not_native()
        if check_tables:
            chk.check_block_tables(op, bt, cl, nb, bs)
        th = pool_threads()
        args = packed.get(th)
        if args is None:
            args = packed[th] = pack(*pre, th, scale, *tail)
        status = fn(args)
        if status == -5 and quantized:  # an inf/NaN scale: the caller dequantizes instead
            return None
        if status == -3:
            raise ShapeError(op, "context_lens", f"0 <= length <= {n} (the block table's reach)",
                             keep[4].tolist())
        _check(status, "decode_attention")
        return _deliver(out, y)
    return call


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, n: int, lo: int = 0,
                     scale: float, key_mask: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One-token attention of ``q`` [B, H, D] over cache positions ``[lo, n)`` of
    ``k``/``v`` [B, cap, KV, D]; see :func:`decode_attention_bound`."""
    for name, t, dims in (("q", q, 3), ("k", k, 4), ("v", v, 4)):
        chk.tensor("decode_attention", name, t, dims=(dims,))
    chk.output("decode_attention", "out", out, q.shape)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    y = None if out is None or out.stride(-1) != 1 else out
    res = decode_attention_bound(q, k, v, scale=scale, key_mask=key_mask, out=y)(lo, n)
    return _deliver(out, res)


def _rope_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, *,
                head_dim: int, rotary_dim: int, op: str) -> Callable[[int], None]:
    chk.tensor(op, "q", q, dims=(2,))
    chk.tensor(op, "k", k, (q.dtype,), dims=(2,))
    head_dim = chk.integer(op, "head_dim", head_dim, 1)
    b = q.shape[0]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and (t.shape[-1] % head_dim or t.shape[0] != b):
            raise ShapeError(op, f"'{name}' shape", f"[{b}, heads * {head_dim}]", list(t.shape))
    if v is not None:
        chk.tensor(op, "v", v, (q.dtype,), dims=(2,))
    hq, hk = q.shape[-1] // head_dim, k.shape[-1] // head_dim
    if k_cache is not None:
        chk.tensor(op, "k_cache", k_cache, (q.dtype,), dims=(4,))
        chk.tensor(op, "v_cache", v_cache, (q.dtype,), dims=(4,))
        if k_cache.shape[0] != b or k_cache.shape[2:] != (hk, head_dim) or (
                v_cache.shape != k_cache.shape) or (v is not None and v.shape != k.shape):
            raise ShapeError(op, "k/v caches", f"[{b}, cap, {hk}, {head_dim}] both (v as k)",
                             f"{list(k_cache.shape)}, {list(v_cache.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):  # q/k rotate in place: no copies
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ShapeError(op, f"'{name}' strides", "a unit-stride last dim", list(t.stride()))
    q3, k3 = q.view(b, 1, -1), k.view(b, 1, -1)
    v3 = None if v is None else v.view(b, 1, -1)
    cap = 0 if k_cache is None else k_cache.shape[1]
    chk.check_rope(op, q3, k3, cos, sin, layout="BSH", head_dim=head_dim, rotary_dim=rotary_dim,
                   q_heads=hq, k_heads=hk, batch=b, seq=1, table_len=1, pos=None, tab_offset=0,
                   q_out=None, k_out=k3 if k_cache is None else k_cache, v=v3, v_out=v_cache,
                   cache_len=cap, cache_offset=0, max_rotary_dim=MAX_ROTARY_DIM)
    fields, keep = _rope_fields(q3, k3, cos, sin, layout="BSH", head_dim=head_dim,
                                rotary_dim=rotary_dim, q_heads=hq, k_heads=hk, interleave=False,
                                batch=b, seq=1, table_len=1,
                                k_out=k3 if k_cache is None else k_cache, v=v3, v_out=v_cache,
                                cache_len=cap)
    if keep[0] is not q3 or keep[2] is not k3 or keep[4] is not v3 or keep[6] is not cos:
        raise ShapeError(op, "q/k/v/cos/sin", "unit-stride last dims", "a strided tensor")
    fn, pack = _fn("rope"), _ROPE.pack

    def call(slot: int = 0) -> None:
        if cap and (type(slot) is not int or not 0 <= slot < cap):
            raise chk.PositionError(op, "slot (the cache row)", f"an int in [0, cache length "
                                    f"{cap})", repr(slot))
        _rope_status(fn(pack(*fields, slot, 0, 0)), cap)
        return None
    call.keep = keep  # type: ignore[attr-defined]
    return call


def rope_cache_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                     head_dim: int, rotary_dim: int) -> Callable[[int], None]:
    """Bind the decode step's RoPE: ``q`` [B, Hq*D] rotated in place, ``k`` rotated and
    ``v`` copied into the caches [B, cap, Hk, D] at slot ``call(slot)``. ``cos``/``sin``
    are the step's per-row tables [B, 1, rd] (fp32). The tensors must stay alive and
    in place while the call is used (their addresses are packed once)."""
    return _rope_bound(q, k, v, cos, sin, k_cache, v_cache, head_dim=head_dim,
                       rotary_dim=rotary_dim, op="rope_cache_bound")


def rope_bound(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               head_dim: int, rotary_dim: int) -> Callable[[], None]:
    """Bind the decode step's RoPE of ``q`` [B, Hq*D] and ``k`` [B, Hk*D] in place
    (per-row fp32 tables [B, 1, rd]); ``call()`` rotates them. As
    :func:`rope_cache_bound`, without the cache write (a paged cache takes its rows
    through :func:`reshape_and_cache`)."""
    return _rope_bound(q, k, None, cos, sin, None, None, head_dim=head_dim,
                       rotary_dim=rotary_dim, op="rope_bound")


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Copy each token's ``key``/``value`` rows ([T, KV, D] or [T, KV*D]) into the paged
    caches [num_blocks, block_size, KV, D] at ``slot_mapping`` (int32/int64 [T], -1 =
    not stored), in place. Returns False (nothing written) when this layout is not
    one the C copy takes (dtypes differ, rows not unit-stride): the caller's torch
    path runs then. A slot past the cache raises ShapeError with nothing written."""
    call = reshape_and_cache_bound(key, value, key_cache, value_cache, slot_mapping)
    if call is None:
        return False
    call()
    return True


def reshape_and_cache_bound(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> Callable[[], None] | None:
    """:func:`reshape_and_cache` with its arguments packed once, for a plan that writes
    the same buffers every step: ``call()`` copies (reading the slots then current);
    None when the layout is not one the C copy takes. The tensors must stay alive and
    in place while the call lives. Shapes that do not fit raise ShapeError."""
    op = "reshape_and_cache"
    chk.tensor(op, "key", key, None, dims=(2, 3))
    chk.tensor(op, "value", value, None, dims=(2, 3))
    chk.tensor(op, "key_cache", key_cache, None, dims=(4,))
    chk.tensor(op, "value_cache", value_cache, None, dims=(4,))
    chk.tensor(op, "slot_mapping", slot_mapping, chk.INTS, dims=(1,))
    t = slot_mapping.numel()
    nb, bs = key_cache.shape[0], key_cache.shape[1]
    row = key_cache.shape[2] * key_cache.shape[3]
    if value_cache.shape != key_cache.shape or bs == 0 or row == 0:
        raise ShapeError(op, "caches", "key and value caches of one shape [blocks, "
                         "block_size >= 1, KV, D]", f"{list(key_cache.shape)}, "
                         f"{list(value_cache.shape)}")
    for name, x in (("key", key), ("value", value)):
        if x.shape[0] != t or math.prod(x.shape[1:]) != row:
            raise ShapeError(op, f"'{name}' shape", f"[{t}, {key_cache.shape[2]}, "
                             f"{key_cache.shape[3]}] or [{t}, {row}]", list(x.shape))
    if key.element_size() not in (1, 2, 4, 8):
        return None
    k2, v2 = key.reshape(t, row), value.reshape(t, row)
    ok = (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype and nb and
          slot_mapping.is_contiguous() and
          (t == 0 or (k2.stride(1) == 1 and v2.stride(1) == 1)) and
          key_cache[0, 0].is_contiguous() and value_cache[0, 0].is_contiguous() and
          value_cache.shape == key_cache.shape)
    if not ok:
        return None
    if t == 0:  # no tokens (and no addresses to pack): nothing to copy
        return lambda: None
    args = _CACHE.pack(k2.data_ptr(), v2.data_ptr(), key_cache.data_ptr(),
                       value_cache.data_ptr(), slot_mapping.data_ptr(),
                       int(slot_mapping.dtype == torch.int32), key.element_size(), t, row,
                       k2.stride(0) if t else row, v2.stride(0) if t else row, bs, nb,
                       key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
                       value_cache.stride(1))
    fn = _fn("reshape_and_cache")
    keep = (k2, v2, key_cache, value_cache, slot_mapping)  # the packed addresses stay valid

    def call() -> None:
        status = fn(args)
        if status == -3:
            raise ShapeError("ReshapeAndCache", "slot_mapping", f"-1 or 0 <= slot < {nb * bs}",
                             keep[4].tolist())
        _check(status, "reshape_and_cache")
    return call


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for ``[R, V]`` CPU logits (fp32/bf16/fp16) as one C
    call: the first maximum, a NaN counting as the maximum (torch's rule); int64 [R].
    torch's own argmax runs ~4x slower on bf16 rows, and single-threaded in a parked
    decode step."""
    chk.tensor("argmax_rows", "logits", logits, dims=tuple(range(1, 65)))
    if logits.shape[-1] == 0:
        raise ShapeError("argmax_rows", "'logits' last dim (vocabulary)", ">= 1",
                         list(logits.shape))
    if logits.numel() == 0:
        return torch.empty(logits.shape[:-1], dtype=torch.long)
    v = logits.shape[-1]
    flat = logits.dim() == 2  # a decode step's [B, V] logits: no reshaping either way
    if flat and logits.is_contiguous():
        x2, rows, xs = logits, logits.shape[0], v
    else:
        x2, rows, xs = _rows(logits, v)
    out = torch.empty(rows, dtype=torch.long)
    status = _fn("argmax")(_ARGMAX.pack(x2.data_ptr(), out.data_ptr(), DTYPE_CODES[logits.dtype],
                                        rows, v, xs, pool_threads()))
    if status:
        _check(status, "argmax")
    return out if flat else out.view(logits.shape[:-1])
