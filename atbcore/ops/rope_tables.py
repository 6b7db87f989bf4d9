"""RoPE cos/sin tables cached per key and grown on demand, one policy for every backend.

    TABLES = RopeTables(lambda key, size, *extra: (cos [size, rd], sin [size, rd]))
    cos, sin = TABLES.get(key, length)     # rows >= length; a longer ask at least doubles
    cos, sin = TABLES.get(key, length, place)   # ``extra`` arguments reach ``make``

Each backend keeps its own ``RopeTables`` (its tensor type, device and dtype are in its
``make``); the cache is thread-safe and counts builds and hits for diagnostics.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

import numpy as np

from ..errors import ParamsError

__all__ = ["RopeTables"]


class RopeTables:
    """``(cos, sin)`` per key with at least the rows asked for; see the module docstring."""

    def __init__(self, make: Callable[..., tuple[Any, Any]], min_rows: int = 0) -> None:
        self._make, self._min = make, int(min_rows)
        self._tables: dict[Hashable, tuple[Any, Any]] = {}
        self._lock = threading.Lock()
        self.builds = self.hits = 0

    def get(self, key: Hashable, length: int, *extra: Any) -> tuple[Any, Any]:
        """Tables of at least ``length`` rows for ``key`` (built or grown when shorter by
        ``make(key, rows, *extra)``)."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ParamsError("RoPE", "table length", "an int >= 0", repr(length))
        hit = self._tables.get(key)
        if hit is not None and hit[0].shape[0] >= length:
            self.hits += 1
            return hit
        with self._lock:
            hit = self._tables.get(key)
            if hit is not None and hit[0].shape[0] >= length:
                return hit
            size = max(int(length), 2 * hit[0].shape[0] if hit is not None else 0, self._min)
            hit = self._tables[key] = self._make(key, size, *extra)
            self.builds += 1
            return hit

    def clear(self) -> None:
        """Drop every table and reset the counters."""
        with self._lock:
            self._tables.clear()
            self.builds = self.hits = 0

    def sizes(self) -> dict[Hashable, int]:
        """Rows held per key."""
        return {k: int(v[0].shape[0]) for k, v in self._tables.items()}
