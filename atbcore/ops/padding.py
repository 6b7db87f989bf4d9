"""Unpad and Pad: drop the padding of a ``[B, S, ...]`` batch into packed tokens
``[T, ...]`` (T = sum(seq_lens)) and put it back.

With right padding the valid tokens of row ``b`` are ``x[b, :len_b]``; with left
padding they are ``x[b, S - len_b:]``. Tokens are packed batch-major, in order,
and ``cu_seqlens = [0, len_0, len_0 + len_1, ...]`` (int32) marks where each
sequence starts, as variable-length attention kernels expect.

T depends on the data, so ``infer_shape`` reports it as ``-1``; so does Pad's
sequence dim when ``max_seq_len`` is not given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ShapeError
from .base import OpDef, Params, expect_dtype, expect_rank
from .gather import INDEX_DTYPES, numel
from .registry import register_op

__all__ = ["UnpadParams", "PadParams", "PADDING_SIDES", "valid_mask"]

PADDING_SIDES = ("right", "left")


def _check_side(p: Params) -> None:
    if p.padding_side not in PADDING_SIDES:
        p.fail("padding_side", " or ".join(PADDING_SIDES), repr(p.padding_side))


def valid_mask(lens: np.ndarray, s: int, side: str) -> np.ndarray:
    """Bool ``[B, S]``: True where a token is real (not padding)."""
    pos = np.arange(s)[None, :]
    lens = np.asarray(lens).astype(np.int64)[:, None]
    return pos < lens if side == "right" else pos >= s - lens


def _lens_range(op: str, lens: Any, hi: int | None, what: str) -> None:
    if numel(lens) == 0:
        return
    lo, top = int(lens.min()), int(lens.max())
    if lo < 0:
        raise InputError(op, "input 'seq_lens' value out of range", "lengths >= 0", lo)
    if hi is not None and top > hi:
        raise InputError(op, f"input 'seq_lens' value out of range ({what})", f"lengths <= {hi}",
                         top)


@dataclass(frozen=True)
class UnpadParams(Params):
    """``padding_side``: "right" (default) or "left"."""

    padding_side: str = "right"

    def validate(self) -> None:
        _check_side(self)


@register_op
class Unpad(OpDef):
    """``x [B, S, ...], seq_lens [B] -> packed [T, ...], cu_seqlens int32 [B + 1]``."""

    name = "Unpad"
    aliases = ("UnpadOperation", "RemovePadding")
    Params = UnpadParams
    inputs = ("x", "seq_lens")
    outputs = ("packed", "cu_seqlens")

    def infer_shape(self, p, ins):
        x, lens = ins["x"], ins["seq_lens"]
        if x.rank < 2:
            raise _rank_error(self.name, x, "x", 2)
        expect_rank(self.name, "seq_lens", lens, 1)
        expect_dtype(self.name, "seq_lens", lens, INDEX_DTYPES)
        _same_batch(self.name, "x", x.shape[0], lens.shape[0])
        return [x.replace(shape=(-1,) + x.shape[2:]),
                lens.replace(shape=(lens.shape[0] + 1,), dtype=Dtype.INT32)]

    def check_values(self, p, ins):
        s = int(ins["x"].shape[1])
        _lens_range(self.name, ins["seq_lens"], s, f"x holds {s} positions per row")

    def reference(self, p, ins):
        x, lens = ins["x"], np.asarray(ins["seq_lens"]).astype(np.int64)
        packed = x[valid_mask(lens, x.shape[1], p.padding_side)]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        return [packed, cu]


@dataclass(frozen=True)
class PadParams(Params):
    """``max_seq_len`` (None = max(seq_lens), known only at run time),
    ``padding_side`` "right"|"left", ``pad_value`` written into padding."""

    ALIASES = {"max_len": "max_seq_len", "padding_value": "pad_value"}
    max_seq_len: int | None = None
    padding_side: str = "right"
    pad_value: float = 0.0

    def validate(self) -> None:
        _check_side(self)
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, (int, np.integer))
                                             or self.max_seq_len < 0):
            self.fail("max_seq_len", "an integer >= 0 or None", repr(self.max_seq_len))


@register_op
class Pad(OpDef):
    """``packed [T, ...], seq_lens [B] -> [B, max_seq_len or max(seq_lens), ...]``."""

    name = "Pad"
    aliases = ("PadOperation", "RestorePadding")
    Params = PadParams
    inputs = ("packed", "seq_lens")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x, lens = ins["packed"], ins["seq_lens"]
        if x.rank < 1:
            raise _rank_error(self.name, x, "packed", 1)
        expect_rank(self.name, "seq_lens", lens, 1)
        expect_dtype(self.name, "seq_lens", lens, INDEX_DTYPES)
        s = -1 if p.max_seq_len is None else p.max_seq_len
        return [x.replace(shape=(lens.shape[0], s) + x.shape[1:])]

    def check_values(self, p, ins):
        x, lens = ins["packed"], ins["seq_lens"]
        _lens_range(self.name, lens, p.max_seq_len, "max_seq_len")
        total = int(lens.sum()) if numel(lens) else 0
        if total != int(x.shape[0]):
            raise InputError(self.name, "sum of 'seq_lens' must equal the packed token count",
                             int(x.shape[0]), total)

    def reference(self, p, ins):
        x, lens = ins["packed"], np.asarray(ins["seq_lens"]).astype(np.int64)
        s = p.max_seq_len if p.max_seq_len is not None else (int(lens.max()) if lens.size else 0)
        y = np.full((lens.shape[0], s) + x.shape[1:], p.pad_value, dtype=np.float64)
        y = y.astype(x.dtype)
        y[valid_mask(lens, s, p.padding_side)] = x
        return [y]



def _same_batch(op: str, name: str, b: int, nb: int) -> None:
    if b != nb:
        raise ShapeError(op, f"input 'seq_lens' length must equal the batch of {name!r}", b, nb)


def _rank_error(op: str, d: Any, name: str, rank: int) -> ShapeError:
    """The rank error of the data input (``[B, S, ...]`` or ``[T, ...]``)."""
    return ShapeError(op, f"input {name!r} rank", f"rank >= {rank}", f"shape {list(d.shape)}")
