"""What the contiguous :class:`~.kv_cache.KVCache` and the paged
:class:`~.paged.PagedKVCache` share: argument checks, the pool a cache draws from (and
gives its blocks back to), and host values as tensors of the cache's backing."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import DeviceError, ParamsError
from ..tensor import convert
from .backing import make_backing
from .block import free_when_unviewed
from .config import MemoryPoolConfig
from .global_pool import get_memory_pool
from .pool import Block, MemoryPool

__all__ = ["pool_for", "check_positive_ints", "to_backing", "native_ints"]


def check_positive_ints(op: str, **values: Any) -> None:
    """ParamsError unless every value is an int >= 1."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ParamsError(op, name, "an int >= 1", repr(v))


def pool_for(op: str, device: str, nbytes: int, pool: MemoryPool | None) -> MemoryPool:
    """The pool a cache on ``device`` draws from: ``pool`` if given (its device must
    match), the process-wide pool when it lives on ``device``, else a private pool of
    exactly ``nbytes`` on ``device``."""
    if pool is not None:
        want = make_backing(device)
        if (want.name, want.device) != (pool.backing.name, pool.device):
            raise DeviceError(op, "pool device", f"{want.device} ({want.name})",
                              f"{pool.device} ({pool.backing.name})")
        return pool
    shared = get_memory_pool()
    want = make_backing(device)
    if (want.name, want.device) == (shared.backing.name, shared.device):
        return shared
    align = shared.config.alignment
    private = MemoryPool(MemoryPoolConfig(max_size=max(-(-nbytes // align) * align, align),
                                          device=device))
    private.private = True  # its owner releases the arena when it frees its block
    return private


def to_backing(x: Any, backing_name: str, like: Any) -> Any:
    """``x`` as a tensor of the backing's framework on ``like``'s device (no dtype cast)."""
    t = convert(x, backing_name)
    if backing_name == "torch" and t.device != like.device:
        t = t.to(like.device)
    return t


def native_ints(values: Sequence[int] | np.ndarray, backing_name: str, like: Any,
                dtype: Any = np.int32) -> Any:
    """An int32 host array as the backing's tensor type, on ``like``'s device."""
    arr = np.ascontiguousarray(np.asarray(values, dtype=dtype))
    if backing_name == "torch":
        import torch

        return torch.from_numpy(arr).to(like.device)
    return arr


def _free_held(held: list[Block | None], pool: MemoryPool) -> None:
    """A collected cache's blocks back to the pool once no view of them is alive (a
    private pool's arena with them: it releases what is empty after each free)."""
    then = pool.release if getattr(pool, "private", False) else None
    for b in held:
        if b is not None and not b.freed:
            free_when_unviewed(b, then)
