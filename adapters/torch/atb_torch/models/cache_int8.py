"""An int8 KV cache for compiled models (``compile(model, kv_cache_dtype="int8")``).

:class:`Int8KVCache` keeps keys and values as int8 with one fp16 scale per token and
KV head (``x ~ q * s``, ``s = absmax / 127`` over the head's ``D`` values, ``q =
round(x / s)``): ``D + 2`` bytes per token and head against bf16's ``2 D`` (0.52x at
D = 64, 0.51x at D = 128). Reads (:meth:`view`, :meth:`keys`, :meth:`values`)
dequantize into the compute dtype, so attention runs as it does over a float cache;
the prebuilt decode plan, which binds kernels to the float cache's storage, is not
built for it (decode steps take the general path).

    cache = Int8KVCache(num_layers=2, batch=1, capacity=256, num_kv_heads=2,
                        head_dim=16, dtype=torch.float32)
    cache.write(layer, k, v, start)      # k, v: [B, T, Hkv*D], quantized on the way in
    k_all, v_all = cache.view(layer, n)  # [B, n, Hkv*D] in the compute dtype (copies)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from atbcore.errors import CapabilityError, ShapeError

from .cache import ContiguousKVCache, _alloc, _release

__all__ = ["Int8KVCache", "KV_CACHE_DTYPES"]

KV_CACHE_DTYPES = (None, "int8")  # compile()'s kv_cache_dtype values
_OP = "Int8KVCache"


def _release_all(*blocks: Any) -> None:
    for b in blocks:
        _release(b)


class Int8KVCache(ContiguousKVCache):
    """int8 keys/values with a per-token, per-head fp16 scale; see the module docstring."""

    quantized = True

    def _storage(self, batch: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        shape = (self.num_layers, 2, batch, capacity, self.num_kv_heads, self.head_dim)
        q, qb = _alloc(shape, torch.int8, self.device)
        s, sb = _alloc(shape[:-1], torch.float16, self.device)             # [L, 2, B, cap, Hkv]
        return q, s, (qb, sb)

    def _adopt(self, q: torch.Tensor, s: torch.Tensor, blocks: Any) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._kv, self._scale = q, s
        self._finalizer = weakref.finalize(self, _release_all, *blocks)
        self.version += 1

    def _allocate(self, capacity: int) -> None:
        q, s, blocks = self._storage(self.batch, capacity)
        if self._kv is not None and self.length:
            q[:, :, :, :self.length] = self._kv[:, :, :, :self.length]
            s[:, :, :, :self.length] = self._scale[:, :, :, :self.length]
        if self.key_mask is not None:
            m = torch.ones(self.batch, capacity, dtype=torch.bool, device=self.device)
            m[:, :self.key_mask.shape[1]] = self.key_mask[:, :capacity]
            self.key_mask = m
        self.capacity = capacity
        self._adopt(q, s, blocks)

    def _dequant(self, layer: int, which: int, end: int) -> torch.Tensor:
        q = self._kv[layer, which, :, :end]                                # [B, end, Hkv, D]
        s = self._scale[layer, which, :, :end, :, None]
        return (q.to(torch.float32) * s.to(torch.float32)).to(self.dtype)

    def keys(self, layer: int) -> torch.Tensor:
        """Keys of ``layer`` dequantized, ``[B, capacity, Hkv, D]`` (a copy: write
        through :meth:`write`)."""
        return self._dequant(layer, 0, self.capacity)

    def values(self, layer: int) -> torch.Tensor:
        """Values of ``layer`` dequantized, ``[B, capacity, Hkv, D]`` (a copy)."""
        return self._dequant(layer, 1, self.capacity)

    def layer(self, layer: int) -> torch.Tensor:
        raise CapabilityError(_OP, "layer() storage view (a float decode plan's)",
                              "a float KV cache", "int8 storage")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Quantize ``k``/``v`` ``[B, T, Hkv*D]`` (or ``[B, T, Hkv, D]``) into slots
        ``start .. start+T-1`` of ``layer``."""
        b, t = k.shape[0], k.shape[1]
        if start + t > self.capacity or b != self.batch:
            raise ShapeError(_OP, "write past the cache", f"batch {self.batch}, "
                             f"slots <= {self.capacity}", f"batch {b}, slots {start + t}")
        for which, x in ((0, k), (1, v)):
            x = x.reshape(b, t, self.num_kv_heads, self.head_dim).to(torch.float32)
            scale = (x.abs().amax(dim=-1) / 127.0).to(torch.float16)        # [B, T, Hkv]
            sf = scale.to(torch.float32)
            inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
            q = torch.round(x * inv[..., None]).clamp_(-127, 127).to(torch.int8)
            self._kv[layer, which, :, start:start + t] = q
            self._scale[layer, which, :, start:start + t] = scale

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``0 .. end-1`` dequantized: ``[B, end, Hkv*D]``."""
        shape = (self.batch, end, self.num_kv_heads * self.head_dim)
        return (self._dequant(layer, 0, end).reshape(shape),
                self._dequant(layer, 1, end).reshape(shape))

    def select(self, index: torch.Tensor) -> None:
        """Keep / reorder / repeat batch rows: row ``i`` becomes old row ``index[i]``."""
        index = index.to(self.device).long()
        n = int(index.numel())
        q, s, blocks = self._storage(n, self.capacity)
        q[:, :, :, :self.length] = self._kv[:, :, index, :self.length]
        s[:, :, :, :self.length] = self._scale[:, :, index, :self.length]
        if self.key_mask is not None:
            self.key_mask = self.key_mask[index].clone()
        self.batch = n
        self._adopt(q, s, blocks)

    def free(self) -> None:
        super().free()
        self._scale = None

    @property
    def nbytes(self) -> int:
        if self._kv is None:
            return 0
        return self._kv.numel() + self._scale.numel() * self._scale.element_size()

    def __repr__(self) -> str:
        return super().__repr__().replace("ContiguousKVCache(", "Int8KVCache(", 1).replace(
            f", {self.dtype},", f", int8 storage, {self.dtype} reads,")
