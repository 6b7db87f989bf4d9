"""The quantizing KV cache write of an int8 cache (``ReshapeAndCacheInt8``) as one C
call on torch CPU tensors (``atb_reshape_and_cache_i8`` in ``csrc/cache.c``), and the
checks of an int8 cache's scales for the decode attention kernel."""

from __future__ import annotations

import struct
from typing import Callable

import torch

from atbcore.errors import DtypeError, ShapeError

from . import torch_checks as chk
from .torch_ops import DTYPE_CODES, _check, _fn

__all__ = ["reshape_and_cache_int8_bound", "int8_scales"]

_QCACHE = struct.Struct("<25q")  # QCacheArgs (cache.c)


def reshape_and_cache_int8_bound(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                 value_cache: torch.Tensor, key_scale: torch.Tensor,
                                 value_scale: torch.Tensor, slot_mapping: torch.Tensor
                                 ) -> Callable[[], None] | None:
    """The quantizing cache write (``ReshapeAndCacheInt8``) packed once: ``call()``
    quantizes each token's heads of ``key``/``value`` ([T, KV, D] float, rows
    contiguous) into the int8 caches [blocks, block_size, KV, D] and their scales
    [blocks, block_size, KV] at ``slot_mapping`` (-1: not stored), in float64 as the
    NumPy reference. None when the layout is not one it takes (the torch path runs)."""
    t = slot_mapping.numel()
    nb, bs, kv, d = key_cache.shape
    ok = (key.dtype in DTYPE_CODES and value.dtype == key.dtype and
          key_cache.dtype == value_cache.dtype == torch.int8 and
          key_scale.dtype in DTYPE_CODES and value_scale.dtype == key_scale.dtype and
          all(x.is_cpu for x in (key, value, key_cache, value_cache, key_scale, value_scale,
                                 slot_mapping)) and
          slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.is_contiguous() and
          key.dim() == 3 and tuple(key.shape) == (t, kv, d) and value.shape == key.shape and
          value_cache.shape == key_cache.shape and nb > 0 and
          tuple(key_scale.shape) == tuple(value_scale.shape) == (nb, bs, kv))
    if not ok or (t and not (key[0].is_contiguous() and value[0].is_contiguous() and
                             key_cache[0, 0].is_contiguous()
                             and value_cache[0, 0].is_contiguous()
                             and key_scale.stride(2) == 1 and value_scale.stride(2) == 1)):
        return None
    if t == 0:
        return lambda: None
    args = _QCACHE.pack(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(),
                        value_cache.data_ptr(), key_scale.data_ptr(), value_scale.data_ptr(),
                        slot_mapping.data_ptr(), int(slot_mapping.dtype == torch.int32),
                        DTYPE_CODES[key.dtype], DTYPE_CODES[key_scale.dtype], t, kv, d,
                        key.stride(0), value.stride(0), bs, nb, *key_cache.stride()[:2],
                        *value_cache.stride()[:2], *key_scale.stride()[:2],
                        *value_scale.stride()[:2])
    fn = _fn("reshape_and_cache_i8")
    keep = (key, value, key_cache, value_cache, key_scale, value_scale, slot_mapping)

    def call() -> None:
        status = fn(args)
        if status == -3:
            raise ShapeError("ReshapeAndCacheInt8", "slot_mapping", f"-1 or 0 <= slot < "
                             f"{nb * bs}", keep[6].tolist())
        _check(status, "reshape_and_cache_i8")
    return call


def int8_scales(op: str, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                 ks: torch.Tensor | None, vs: torch.Tensor | None) -> tuple[tuple, tuple]:
    """Checks of an int8 cache call; (the scales' packed fields, the scales)."""
    if q.dtype not in DTYPE_CODES:
        raise DtypeError(op, "q", "float32, bfloat16 or float16", str(q.dtype))
    for name, t in (("key_cache", kc), ("value_cache", vc)):
        if t.dtype != torch.int8:
            raise DtypeError(op, f"{name} (with scales)", "int8", str(t.dtype))
    for name, t in (("key_scale", ks), ("value_scale", vs)):
        if t is None or t.dim() != 3 or tuple(t.shape) != tuple(kc.shape[:3]):
            raise ShapeError(op, name, f"the int8 cache's scales {list(kc.shape[:3])}",
                             None if t is None else list(t.shape))
        chk.tensor(op, name, t, tuple(DTYPE_CODES), dims=(3,))
    if ks.dtype != vs.dtype:
        raise DtypeError(op, "value_scale", f"the key scales' dtype {ks.dtype}", str(vs.dtype))
    return (ks.data_ptr(), vs.data_ptr(), DTYPE_CODES[ks.dtype], *ks.stride(),
            *vs.stride()), (ks, vs)
