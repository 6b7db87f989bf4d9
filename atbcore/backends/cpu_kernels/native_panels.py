"""Weights in 32-output panels for the C matmul on framework-free views (what
``atbcore.backends.torch.weight_layout`` does for torch tensors): ``[N, K]`` becomes
``[ceil(N / 32), K, 32]`` (``p[i, k, j] = w[32 i + j, k]``, zeros past N), which the
C matmul streams without horizontal sums at any row count. The panels are packed once
per weight (kept while the weight lives), on 2 MiB huge pages where the OS allows, so
a decode step that streams every weight takes few TLB misses.

``ATB_PANELS=0`` keeps the ``[N, K]`` layout."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

from ...dtypes import Dtype
from .native import PANEL, WEIGHT_CODES, NativeView
from .native_ops import Ref

__all__ = ["panel_view", "pack_panels_np", "pack_panels_raw"]

_LOCK = threading.Lock()
# id(weight owner) -> (weakref to the owner, address, shape, dtype, panels array)
_CACHE: dict[int, tuple[Any, int, tuple, Dtype, np.ndarray]] = {}
_HUGE = 2 << 20
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _enabled() -> bool:
    return os.environ.get("ATB_PANELS", "1").strip().lower() not in ("0", "off", "false", "no")


def _huge_empty(nbytes: int) -> np.ndarray:
    """Uninitialised bytes, 2 MiB-aligned on huge pages where the OS allows."""
    from ...memory.hugepages import available

    if nbytes < _HUGE or available() is not None:
        return np.empty(nbytes, np.uint8)
    m = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):  # plain pages: still correct
        pass
    raw = np.frombuffer(m, np.uint8)  # keeps the mapping alive
    skip = -raw.ctypes.data % _HUGE
    return raw[skip:skip + nbytes]


def _weight_bytes(nbytes: int) -> np.ndarray:
    """Uninitialised bytes for a packed weight: in the binding GraphOp's weight arena
    when one is in scope (weights side by side on huge pages), else on their own."""
    from ...memory.hugepages import _ARENA

    if _ARENA.get() is not None:
        try:  # the arena is torch storage; a front-end without torch packs on its own
            import torch
        except ImportError:
            return _huge_empty(nbytes)
        from ...memory.hugepages import weight_empty

        return weight_empty((nbytes,), torch.uint8).numpy()  # keeps the storage alive
    return _huge_empty(nbytes)


def pack_panels_raw(w: np.ndarray) -> np.ndarray:
    """The panels of a contiguous ``[N, K]`` NumPy weight, as raw elements
    (``[P, K, 32]`` of an unsigned type of the weight's width)."""
    n, k = w.shape
    size = w.dtype.itemsize
    src = np.ascontiguousarray(w).view(_UINT[size]).reshape(n, k)
    p = -(-n // PANEL)
    out = _weight_bytes(p * k * PANEL * size).view(_UINT[size]).reshape(p, k, PANEL)
    full = n // PANEL
    out[:full] = src[:full * PANEL].reshape(full, PANEL, k).transpose(0, 2, 1)
    if n % PANEL:
        out[full] = 0
        out[full, :, :n % PANEL] = src[full * PANEL:].T
    return out


def pack_panels_np(w: NativeView) -> np.ndarray:
    """The panels of a contiguous ``[N, K]`` weight view, as raw elements
    (``[P, K, 32]`` of an unsigned type of the weight's width)."""
    n, k = w.shape
    size = w.dtype.itemsize
    src = np.ctypeslib.as_array((ctypes.c_uint8 * (n * k * size)).from_address(int(w.address)))
    return pack_panels_raw(src.view(_UINT[size]).reshape(n, k))


def panel_view(w: NativeView) -> NativeView | None:
    """The panels of weight ``w`` (a fixed, contiguous ``[N, K]`` view of a C matmul
    dtype), packed once and kept while ``w``'s owner lives; None when ``w`` is not
    such a weight or panels are off. A layout pass's packed weight
    (:func:`.native_layout.packed_view`) gives its own panels."""
    from .native_layout import packed_panels

    if w.owner is not None and type(w.owner).__name__ == "PackedWeight":
        return packed_panels(w)
    if (type(w.address) is Ref or not _enabled() or len(w.shape) != 2 or not w.contiguous
            or w.dtype not in WEIGHT_CODES or w.owner is None or 0 in w.shape):
        return None
    key = id(w.owner)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0]() is w.owner and hit[1:4] == (w.address, w.shape,
                                                                     w.dtype):
            return _as_view(hit[4], w.dtype)
    try:
        ref = weakref.ref(w.owner, lambda _: _forget(key))
    except TypeError:  # an owner that takes no weak reference: no cache, no panels
        return None
    panels = pack_panels_np(w)
    with _LOCK:
        _CACHE[key] = (ref, w.address, w.shape, w.dtype, panels)
    return _as_view(panels, w.dtype)


def _forget(key: int) -> None:
    with _LOCK:
        _CACHE.pop(key, None)


def _as_view(panels: np.ndarray, dtype: Dtype) -> NativeView:
    """The raw panel elements seen as ``dtype`` (same width)."""
    return NativeView(panels.ctypes.data, panels.shape,
                      tuple(st // panels.itemsize for st in panels.strides), dtype, panels)
