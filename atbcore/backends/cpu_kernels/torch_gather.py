"""The C row gather (``atb_gather_rows``, csrc/cache.c) on torch CPU tensors: rows of a
contiguous 2-D table picked by int32/int64 ids into a fixed output, every id checked
against the table before anything is written. A decode step's Embedding lookup and its
last-token Gather are one row each: as torch ops each is a dispatch whose code and data
the step's matmuls have evicted from the caches, which costs more than the row; the C
call touches the rows only."""

from __future__ import annotations

import struct
from typing import Callable

import torch

from .torch_ops import _fn

__all__ = ["gather_rows_into", "GATHER_OUT_OF_RANGE"]

_GATHER = struct.Struct("<8q")  # GatherArgs (cache.c)
GATHER_OUT_OF_RANGE = -3        # ATB_ERR_CACHE_OVERFLOW: an id outside the table


def gather_rows_into(out: torch.Tensor, dtype: torch.dtype
                     ) -> Callable[[torch.Tensor, torch.Tensor], int] | None:
    """``call(table, ids) -> status`` writing ``table[ids]`` into ``out`` (contiguous CPU,
    as rows ``[-1, out.shape[-1]]``, one per id) for a contiguous 2-D ``table`` of
    ``dtype`` and ``out``'s width. Status 0; :data:`GATHER_OUT_OF_RANGE` when an id is
    outside the table (nothing written: the caller reports it); 1 when these tensors
    are not the kernel's case (the caller's torch op runs). The addresses are packed
    per call (the ids and the table may be new tensors each run). None where ``out``
    cannot take the C kernel's rows."""
    if (out.device.type != "cpu" or not out.is_contiguous() or out.dtype != dtype
            or out.dim() < 1 or out.element_size() not in (1, 2, 4, 8) or out.numel() == 0):
        return None
    width = int(out.shape[-1])
    count = out.numel() // width
    fn, pack, esz, optr = _fn("gather_rows"), _GATHER.pack, out.element_size(), out.data_ptr()

    def call(table: torch.Tensor, ids: torch.Tensor) -> int:
        if (table.dtype != dtype or table.dim() != 2 or table.shape[1] != width
                or not table.is_contiguous() or ids.numel() != count
                or ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous()
                or table.device.type != "cpu" or ids.device.type != "cpu"):
            return 1
        return fn(pack(table.data_ptr(), ids.data_ptr(), optr, int(ids.dtype == torch.int32),
                       esz, count, width, table.shape[0]))
    call.keep = out  # type: ignore[attr-defined]
    return call
