"""KV caches of compiled models.

:class:`ContiguousKVCache` — one preallocated block ``[layers, 2, B, capacity, Hkv, D]``
taken from atb's memory pool (the layout of :class:`atbcore.memory.KVCache`), written
in place at the current length, read as views. Rows share one time axis, as Hugging
Face caches do: with left padding, row ``b``'s cache slot ``j`` holds token ``j`` of
the padded batch and ``key_mask[b, j]`` says whether it is a real token.

    cache = ContiguousKVCache(num_layers=2, batch=1, capacity=256, num_kv_heads=2,
                              head_dim=16, dtype=torch.float32)
    cache.write(layer, k, v, start)      # k, v: [B, T, Hkv*D] at slots start..start+T-1
    k_all, v_all = cache.view(layer, n)  # [B, n, Hkv*D] views of slots 0..n-1
    cache.length                         # slots filled (advanced by the runner)

The paged cache for continuous batching is :class:`atbcore.memory.PagedKVCache`
itself (see :meth:`.runner.ModelRunner.forward_paged`).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from atbcore.dtypes import Dtype
from atbcore.errors import ShapeError

__all__ = ["ContiguousKVCache"]

_OP = "ContiguousKVCache"


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, Any]:
    """A zeroed tensor from atb's pool (process-wide when on ``device``, else a
    private one) and the pool block backing it (None when no pool applies)."""
    from atbcore.memory.kv_cache import pool_for

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    dev = str(device) if device.type != "cpu" else "cpu"
    pool = pool_for(_OP, dev, max(nbytes, 64), None)
    if pool.backing.name != "torch":  # a NumPy-backed pool cannot hold torch tensors
        return torch.zeros(shape, dtype=dtype, device=device), None
    block = pool.alloc(max(nbytes, 64), pinned=True)  # pinned: views stay valid
    t = block.tensor(shape, Dtype.of(dtype))
    t.zero_()  # stale bytes could hold NaN, and 0 * NaN leaks through masked attention
    return t, block


def _release(block: Any) -> None:
    if block is not None and not block.freed:
        block.free()
        if getattr(block.pool, "private", False):
            block.pool.release()


class ContiguousKVCache:
    """Preallocated contiguous KV cache; see the module docstring."""

    def __init__(self, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: Any = "cpu") -> None:
        self.num_layers, self.batch = int(num_layers), int(batch)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.length = 0
        self.version = 0  # bumped when storage moves (plans bound to views rebuild)
        self._kv: torch.Tensor | None = None
        self._finalizer: Any = None
        self.capacity = 0
        self.key_mask: torch.Tensor | None = None  # bool [B, capacity]; None = all real
        self._allocate(max(int(capacity), 1))

    # ------------------------------------------------------------------ storage
    def _allocate(self, capacity: int) -> None:
        shape = (self.num_layers, 2, self.batch, capacity, self.num_kv_heads, self.head_dim)
        kv, block = _alloc(shape, self.dtype, self.device)
        if self._kv is not None and self.length:
            kv[:, :, :, :self.length] = self._kv[:, :, :, :self.length]
        if self.key_mask is not None:
            m = torch.ones(self.batch, capacity, dtype=torch.bool, device=self.device)
            m[:, :self.key_mask.shape[1]] = self.key_mask[:, :capacity]
            self.key_mask = m
        if self._finalizer is not None:
            self._finalizer()
        self._kv, self.capacity = kv, capacity
        self._finalizer = weakref.finalize(self, _release, block)
        self.version += 1

    def reserve(self, length: int) -> None:
        """Make room for ``length`` slots (doubling, so appends stay amortised)."""
        if length > self.capacity:
            self._allocate(max(int(length), 2 * self.capacity))

    def keys(self, layer: int) -> torch.Tensor:
        """The whole key buffer of ``layer``: ``[B, capacity, Hkv, D]``."""
        return self._kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        """The whole value buffer of ``layer``: ``[B, capacity, Hkv, D]``."""
        return self._kv[layer, 1]

    def layer(self, layer: int) -> torch.Tensor:
        """Keys and values of ``layer`` together: ``[2, B, capacity, Hkv, D]``."""
        return self._kv[layer]

    # ------------------------------------------------------------------ access
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store ``k``/``v`` ``[B, T, Hkv*D]`` (or ``[B, T, Hkv, D]``) at slots
        ``start .. start+T-1`` of ``layer`` (in place; capacity must suffice)."""
        b, t = k.shape[0], k.shape[1]
        if start + t > self.capacity or b != self.batch:
            raise ShapeError(_OP, "write past the cache", f"batch {self.batch}, "
                             f"slots <= {self.capacity}", f"batch {b}, slots {start + t}")
        kv = self._kv
        kv[layer, 0, :, start:start + t] = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        kv[layer, 1, :, start:start + t] = v.reshape(b, t, self.num_kv_heads, self.head_dim)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``0 .. end-1``: ``[B, end, Hkv*D]`` views."""
        kv = self._kv
        shape = (self.batch, end, self.num_kv_heads * self.head_dim)
        return kv[layer, 0, :, :end].reshape(shape), kv[layer, 1, :, :end].reshape(shape)

    def set_key_mask(self, start: int, mask: torch.Tensor | None) -> None:
        """Record which of slots ``start ..`` hold real tokens (``mask`` bool
        ``[B, T]``; None = all). Only materialised once some slot is padding."""
        if mask is None:
            if self.key_mask is not None:
                self.key_mask[:, start:] = True
            return
        if self.key_mask is None:
            if bool(mask.all()):
                return
            self.key_mask = torch.ones(self.batch, self.capacity, dtype=torch.bool,
                                       device=self.device)
        self.key_mask[:, start:start + mask.shape[1]] = mask

    def mask(self, end: int) -> torch.Tensor | None:
        """bool ``[B, end]`` of real slots (None when none is padding)."""
        return None if self.key_mask is None else self.key_mask[:, :end]

    # ------------------------------------------------------------------ editing
    def crop(self, length: int) -> None:
        """Forget slots past ``length`` (e.g. rejected speculative tokens)."""
        self.length = max(0, min(self.length, int(length)))

    def select(self, index: torch.Tensor) -> None:
        """Keep / reorder / repeat batch rows: row ``i`` becomes old row ``index[i]``."""
        index = index.to(self.device).long()
        n = int(index.numel())
        shape = (self.num_layers, 2, n, self.capacity, self.num_kv_heads, self.head_dim)
        kv, block = _alloc(shape, self.dtype, self.device)
        kv[:, :, :, :self.length] = self._kv[:, :, index, :self.length]
        if self.key_mask is not None:
            self.key_mask = self.key_mask[index].clone()
        self._finalizer()
        self.batch, self._kv = n, kv
        self._finalizer = weakref.finalize(self, _release, block)
        self.version += 1

    def reset(self) -> None:
        """Empty the cache (keeps its memory)."""
        self.length = 0
        self.key_mask = None

    def free(self) -> None:
        """Give the memory back to the pool now (the cache is unusable afterwards)."""
        if self._finalizer is not None:
            self._finalizer()
        self._kv = None

    @property
    def nbytes(self) -> int:
        return 0 if self._kv is None else self._kv.numel() * self._kv.element_size()

    def __repr__(self) -> str:
        return (f"ContiguousKVCache(layers={self.num_layers}, batch={self.batch}, "
                f"length={self.length}/{self.capacity}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, {self.dtype}, {self.device})")
