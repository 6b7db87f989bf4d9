"""Checks of the in-place cache form's call arguments (rows, tokens per row, positions,
kept tokens), shared by the feeder of :mod:`.graph_op_feed` and the paged steps of
:mod:`.graph_op_paged`: each raises ``InputError`` / ``ShapeError`` naming the block."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError, ShapeError
from ..tensor import convert

__all__: list[str] = []


def _rows(name: str, rows: Any, b: int, max_batch: int) -> tuple[int, ...]:
    if rows is None:
        return tuple(range(b))
    try:
        r = tuple(int(v) for v in np.asarray(rows).reshape(-1))
    except (TypeError, ValueError):
        raise InputError(name, "rows", "one cache row per batch row", repr(rows)) from None
    if len(r) != b or len(set(r)) != b or not all(0 <= v < max_batch for v in r):
        raise InputError(name, "rows", f"{b} distinct cache rows in 0..{max_batch - 1}",
                         list(r))
    return r


def _q_lens(name: str, q_lens: Any, x_shape: tuple, max_batch: int) -> tuple[int, ...]:
    try:
        q = tuple(int(v) for v in np.asarray(q_lens).reshape(-1))
    except (TypeError, ValueError):
        raise InputError(name, "q_lens", "one token count per row", repr(q_lens)) from None
    if not 1 <= len(q) <= max_batch or min(q) < 1:
        raise InputError(name, "q_lens", f"1..{max_batch} counts >= 1 (the cache's max_batch "
                         "rows)", list(q))
    if len(x_shape) < 1 or sum(q) != x_shape[0]:
        raise ShapeError(name, "packed tokens with q_lens", f"[{sum(q)}, ...] (sum of q_lens)",
                         list(x_shape))
    return q


def _ints(name: str, what: str, v: Any, n: int | None, lo: int, hi: int | None
          ) -> np.ndarray | None:
    """``v`` as int64 [n] (any length when n is None) with values in [lo, hi)."""
    if v is None:
        return None
    try:
        a = np.asarray(convert(v, "numpy") if not isinstance(v, (list, tuple)) else v)
    except Exception:  # noqa: BLE001 - anything not array-like
        raise InputError(name, what, "integers", type(v).__name__) from None
    a = a.reshape(-1)
    if a.dtype.kind not in "iu" or (n is not None and a.size != n) or a.size == 0:
        raise InputError(name, what, f"{n if n is not None else 'some'} integers",
                         f"{a.size} of {a.dtype}")
    if int(a.min()) < lo or (hi is not None and int(a.max()) >= hi):
        raise InputError(name, what, f"values in [{lo}, {hi if hi is not None else 'inf'})",
                         f"[{int(a.min())}, {int(a.max())}]")
    return a.astype(np.int64)
