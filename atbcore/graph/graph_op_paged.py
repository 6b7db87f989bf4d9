"""The index tensors of an in-place cache form graph for one step over a paged cache
(:class:`atbcore.memory.PagedKVCache`; :meth:`.graph_op_feed.CacheFeeder.prepare_paged`).

The step is a :class:`~atbcore.memory.paged.PagedBatch`: the packed new tokens of
several sequences (prefill chunks and decode tokens mixed), their cache slots,
the sequences' block tables, context and new-token lengths and the tokens'
positions, all made by the block manager (which also counts the tokens). They are
checked against the cache and copied into index tensors kept per step shape, so a
decode step feeds the very tensors its bound program packed:

* ``block_tables`` is padded to a power-of-two width (few shapes, few programs);
* ``cache.last_rows`` picks each sequence's last new token (``[B]``), or every
  token (``[T]``, ``all_logits``: speculative verification reads them all).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError, ShapeError
from ..tensor import framework_of
from .graph_op_checks import _ints
from .graph_op_feed import _MAX_INDEX_SETS, _on, _shares, cache_state

__all__ = ["paged_index"]


class _PagedIndexSet:
    """The index tensors of paged steps of one shape (framework, device, B, T, block
    table width, logit rows): kept, and refilled in place from each step's batch."""

    def __init__(self, x: Any, b: int, t: int, width: int, out_rows: int) -> None:
        i32, i64 = np.int32, np.int64
        self.arrays = [np.zeros(t, i32), np.zeros((b, width), i32), np.zeros(b, i32),
                       np.zeros(b, i32), np.zeros(t, i64), np.zeros(out_rows, i64)]
        self.where = (framework_of(x), getattr(x, "device", None))
        self.tensors = [_on(*self.where, a) for a in self.arrays]
        self.shared = all(_shares(t_, a) for t_, a in zip(self.tensors, self.arrays))

    def fill(self, slots: np.ndarray, tables: np.ndarray, ctx: np.ndarray, q: np.ndarray,
             pos: np.ndarray, last: np.ndarray) -> list:
        a = self.arrays
        a[0][:], a[2][:], a[3][:], a[4][:], a[5][:] = slots, ctx, q, pos, last
        a[1][:, :tables.shape[1]] = tables
        a[1][:, tables.shape[1]:] = 0
        if not self.shared:
            self.tensors = [_on(*self.where, arr) for arr in a]
        return self.tensors


def paged_index(name: str, x: Any, cache: Any, batch: Any, all_logits: bool) -> list:
    """The index tensors (slots, block tables, context lengths, new-token lengths,
    positions, last rows) of ``batch`` for the packed tokens ``x`` ``[T, ...]`` of
    graph ``name``; raises naming the field that does not fit ``cache``."""
    nb, bs = cache.num_blocks, cache.block_size
    q = _ints(name, "PagedBatch.q_seq_lens", batch.q_seq_lens, None, 1, None)
    b, t = len(q), int(q.sum())
    ctx = _ints(name, "PagedBatch.context_lens", batch.context_lens, b, 1, None)
    if (ctx < q).any():
        raise InputError(name, "PagedBatch.context_lens", "context_lens >= q_seq_lens",
                         (ctx.tolist(), q.tolist()))
    shape = tuple(x.shape)
    if len(shape) < 1 or shape[0] != t:
        raise ShapeError(name, "packed new tokens of a PagedBatch",
                         f"[{t}, ...] (sum of q_seq_lens)", list(shape))
    slots = _ints(name, "PagedBatch.slot_mapping", batch.slot_mapping, t, 0, nb * bs)
    pos = _ints(name, "PagedBatch.positions", batch.positions, t, 0, None)
    tables = _ints(name, "PagedBatch.block_tables", batch.block_tables, None, 0, nb)
    width = tables.size // b
    if width * b != tables.size or (ctx > width * bs).any():
        raise InputError(name, "PagedBatch.block_tables", f"[{b}, >= ceil(context / {bs})] "
                         "blocks", tables.size)
    tables = tables.reshape(b, width)
    _, index = cache_state(cache)
    padded = 1 << max(width - 1, 0).bit_length()
    out_rows = t if all_logits else b
    key = ("paged", framework_of(x), str(getattr(x, "device", "cpu")), b, t, padded, out_rows)
    got = index.get(key)
    if got is None:
        if len(index) >= _MAX_INDEX_SETS:
            index.pop(next(iter(index)))
        got = index[key] = _PagedIndexSet(x, b, t, padded, out_rows)
    last = np.arange(t) if all_logits else np.cumsum(q) - 1
    return got.fill(slots, tables, ctx, q, pos, last)
