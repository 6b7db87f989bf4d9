"""Index ops: Gather (``np.take`` along an axis) and Embedding (``weight[ids]``).

Indices are checked before anything is written: one out of ``[0, n)`` raises
:class:`InputError` naming the offending value, never wraps around or reads
past the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ShapeError
from .base import OpDef, Params, expect_dtype, expect_rank
from .registry import register_op
from .shape import norm_dim

__all__ = ["GatherParams", "EmbeddingParams", "INDEX_DTYPES", "check_index_range", "numel"]

INDEX_DTYPES = frozenset({Dtype.INT32, Dtype.INT64})


def numel(t: Any) -> int:
    """Element count of a NumPy array or a torch tensor."""
    n = t.numel() if callable(getattr(t, "numel", None)) else np.asarray(t).size
    return int(n)


def check_index_range(op: str, name: str, idx: Any, n: int, what: str) -> None:
    """Raise InputError unless every value of ``idx`` is in ``[0, n)``."""
    if numel(idx) == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        raise InputError(op, f"input {name!r} value out of range ({what})", f"values in [0, {n})",
                         bad)


@dataclass(frozen=True)
class GatherParams(Params):
    """``axis`` (alias ``dim``) of ``x`` the indices select along; default 0."""

    ALIASES = {"dim": "axis"}
    axis: int = 0


@register_op
class Gather(OpDef):
    """``y = take(x, indices, axis)``: shape ``x[:axis] + indices.shape + x[axis+1:]``."""

    name = "Gather"
    aliases = ("GatherOperation", "IndexSelect")
    Params = GatherParams
    inputs = ("x", "indices")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x, idx = ins["x"], ins["indices"]
        expect_dtype(self.name, "indices", idx, INDEX_DTYPES)
        if x.rank == 0:
            raise ShapeError(self.name, "input 'x' rank", "rank >= 1", "a scalar")
        axis = norm_dim(self.name, "axis", p.axis, x.rank, x.shape)
        return [x.replace(shape=x.shape[:axis] + idx.shape + x.shape[axis + 1:])]

    def check_values(self, p, ins):
        x = ins["x"]
        axis = p.axis % x.ndim
        check_index_range(self.name, "indices", ins["indices"], int(x.shape[axis]),
                          f"x has {int(x.shape[axis])} entries along axis {axis}")

    def reference(self, p, ins):
        x, idx = ins["x"], np.asarray(ins["indices"])
        return [np.take(x, idx.astype(np.int64), axis=p.axis % x.ndim)]


@dataclass(frozen=True)
class EmbeddingParams(Params):
    """``num_embeddings`` (alias ``vocab_size``) and ``embedding_dim`` (alias
    ``hidden_size``), both optional checks of the table's shape."""

    ALIASES = {"vocab_size": "num_embeddings", "hidden_size": "embedding_dim"}
    num_embeddings: int | None = None
    embedding_dim: int | None = None


@register_op
class Embedding(OpDef):
    """``y = weight[ids]``: weight ``[V, H]``, ids any shape -> ``[*ids.shape, H]``."""

    name = "Embedding"
    aliases = ("EmbeddingOperation", "WordEmbedding")
    Params = EmbeddingParams
    inputs = ("weight", "ids")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        w, ids = ins["weight"], ins["ids"]
        expect_rank(self.name, "weight", w, 2)
        expect_dtype(self.name, "ids", ids, INDEX_DTYPES)
        for axis, want, label in ((0, p.num_embeddings, "rows (num_embeddings)"),
                                  (1, p.embedding_dim, "columns (embedding_dim)")):
            if want is not None and w.shape[axis] != want:
                raise ShapeError(self.name, f"input 'weight' {label}", want,
                                 f"{w.shape[axis]} (shape {list(w.shape)})")
        return [w.replace(shape=ids.shape + (w.shape[1],))]

    def check_values(self, p, ins):
        v = int(ins["weight"].shape[0])
        check_index_range(self.name, "ids", ins["ids"], v, f"the table has {v} rows")

    def reference(self, p, ins):
        w, ids = ins["weight"], np.asarray(ins["ids"])
        return [np.asarray(w)[ids.astype(np.int64)]]
