"""Embedding, Gather and Split on framework-free views: an Embedding lookup (and a
Gather along axis 0: a decoder's last-token pick) is one C row gather
(``atb_gather_rows``: every id checked against the table before anything is
written), a Split of a few rows is a few plain copies, or none at all where a plan
binds the parts as views of a planned buffer (:meth:`SplitSpec.parts_in_place`). With them, and the attention
ops of :mod:`.native_attention`, a decode step of a lowered decoder calls no
framework kernel at all from MindSpore or Paddle tensors (in MindSpore each
framework op is an asynchronous dispatch the next C call must wait for)."""

from __future__ import annotations

import struct
from typing import Any, Mapping

from ...dtypes import Dtype
from ...ops.shape import split_sizes
from ...tensor import TensorDesc
from .native import NativeView
from .native_ops import Step

__all__ = ["EmbeddingSpec", "GatherSpec", "SplitSpec", "MAX_COPIES"]

GATHER = struct.Struct("<8q")  # GatherArgs (cache.c)
MAX_COPIES = 64                # a Split needing more row copies is left to the framework


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class EmbeddingSpec:
    """``y = weight[ids]`` for a contiguous ``[V, H]`` table and int32/int64 ids."""

    entry = "gather_rows"
    has_workspace = False
    launches = 1

    def workspace(self, p: Any, shapes: Mapping[str, tuple]) -> int:
        return 0

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        w, ids = views["weight"], views["ids"]
        if not (w.contiguous and ids.contiguous) or len(w.shape) != 2:
            return "a non-contiguous table or ids"
        if ids.dtype not in (Dtype.INT32, Dtype.INT64) or w.dtype.itemsize not in (1, 2, 4, 8):
            return f"ids {ids.dtype.value} / table {w.dtype.value}"
        return None

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        w, ids = views["weight"], views["ids"]
        return [((*ids.shape, w.shape[1]), w.dtype)]

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        w, ids = views["weight"], views["ids"]
        n = _prod(ids.shape)
        if n == 0:
            return []
        return [Step("gather_rows", GATHER, (
            w.address, ids.address, outs[0].address, int(ids.dtype == Dtype.INT32),
            w.dtype.itemsize, n, w.shape[1], w.shape[0]))]


class GatherSpec(EmbeddingSpec):
    """``y = x[indices]`` along axis 0 of a contiguous ``x`` (rows of any width),
    int32/int64 indices: the Embedding's row gather with ``x`` as the table."""

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        x, ids = views["x"], views["indices"]
        if not x.shape or p.axis % len(x.shape) != 0:
            return f"axis {p.axis} (the C gather takes rows: axis 0)"
        if not (x.contiguous and ids.contiguous):
            return "a non-contiguous x or indices"
        if ids.dtype not in (Dtype.INT32, Dtype.INT64) or x.dtype.itemsize not in (1, 2, 4, 8):
            return f"indices {ids.dtype.value} / x {x.dtype.value}"
        return None

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        x, ids = views["x"], views["indices"]
        return [((*ids.shape, *x.shape[1:]), x.dtype)]

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        x, ids = views["x"], views["indices"]
        n = _prod(ids.shape)
        if n == 0:
            return []
        return [Step("gather_rows", GATHER, (
            x.address, ids.address, outs[0].address, int(ids.dtype == Dtype.INT32),
            x.dtype.itemsize, n, _prod(x.shape[1:]), x.shape[0]))]


class SplitSpec:
    """A contiguous ``x`` cut along one dim: per piece and per outer row, one copy
    (at most :data:`MAX_COPIES` of them)."""

    entry = "memmove"
    has_workspace = False
    launches = 1

    def workspace(self, p: Any, shapes: Mapping[str, tuple]) -> int:
        return 0

    def _cut(self, p: Any, x: NativeView) -> tuple[int, tuple[int, ...]]:
        return split_sizes("Split", p, TensorDesc(x.shape, x.dtype))

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        x = views["x"]
        if not x.contiguous:
            return "a non-contiguous x"
        dim, sizes = self._cut(p, x)
        copies = _prod(x.shape[:dim]) * len(sizes)
        if copies > MAX_COPIES:
            return f"{copies} row copies > {MAX_COPIES} (the framework's split)"
        return None

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        x = views["x"]
        dim, sizes = self._cut(p, x)
        return [((*x.shape[:dim], s, *x.shape[dim + 1:]), x.dtype) for s in sizes]

    def parts_in_place(self, p: Any, x: NativeView) -> list[tuple[int, tuple]] | None:
        """``(byte offset, shape)`` of each part inside a contiguous ``x`` when every
        part is itself contiguous there (nothing before the split dim but size 1:
        a decode step's one row), else None."""
        if not x.contiguous:
            return None
        dim, sizes = self._cut(p, x)
        if _prod(x.shape[:dim]) != 1:
            return None
        inner, out, off = _prod(x.shape[dim + 1:]) * x.dtype.itemsize, [], 0
        for size in sizes:
            out.append((off, (*x.shape[:dim], size, *x.shape[dim + 1:])))
            off += size * inner
        return out

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        x = views["x"]
        dim, sizes = self._cut(p, x)
        outer, inner, es = _prod(x.shape[:dim]), _prod(x.shape[dim + 1:]), x.dtype.itemsize
        row = x.shape[dim] * inner * es  # bytes of one outer row of x
        steps, off = [], 0
        for size, out in zip(sizes, outs):
            piece = size * inner * es
            if piece:
                for r in range(outer):
                    steps.append(Step("memmove", None, (out.address + r * piece,
                                                        x.address + r * row + off, piece)))
            off += piece
        return steps
