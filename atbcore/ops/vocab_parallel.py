"""VocabParallelEmbedding: an embedding table split by rows over the ranks of a
group, looked up and all-reduced in one op (Megatron's vocab-parallel embedding).

Rank r holds rows ``[r * R, (r + 1) * R)`` of the table as ``weight [R, H]`` (the
last shard zero-padded when ``V`` does not split evenly). Each rank looks up the
ids that fall in its rows, writes zeros for the others, and the sum over ranks is
every id's row: ``y = all_reduce(sum_r mask_r(ids) * weight_r[ids - r * R])``.
``ids`` are full-vocab ids ``[0, N * R)`` (the same on every rank in a model).
``group`` and ``rank_size`` as every collective (:mod:`.collective`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import FLOAT_DTYPES, expect_dtype, expect_rank
from .collective import CollectiveOp, CollectiveParams
from .gather import INDEX_DTYPES, check_index_range
from .registry import register_op

__all__ = ["VocabParallelEmbeddingParams"]


@dataclass(frozen=True)
class VocabParallelEmbeddingParams(CollectiveParams):
    """``group``, ``rank_size`` (alias ``world_size``)."""

    ALIASES = {"world_size": "rank_size"}


@register_op
class VocabParallelEmbedding(CollectiveOp):
    """``y [*ids.shape, H]``: rows of a table split over the ranks (module docstring)."""

    name = "VocabParallelEmbedding"
    aliases = ("ParallelEmbedding",)
    Params = VocabParallelEmbeddingParams
    inputs = ("weight", "ids")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        self.ranks(p)
        w, ids = ins["weight"], ins["ids"]
        expect_rank(self.name, "weight", w, 2)
        expect_dtype(self.name, "weight", w, FLOAT_DTYPES)
        expect_dtype(self.name, "ids", ids, INDEX_DTYPES)
        return [w.replace(shape=ids.shape + (w.shape[1],))]

    def check_values(self, p, ins):
        v = int(ins["weight"].shape[0]) * self.ranks(p)
        check_index_range(self.name, "ids", ins["ids"], v,
                          f"the ranks' tables have {v} rows together")

    def reference_ranks(self, p, per_rank):
        rows = np.asarray(per_rank[0]["weight"]).shape[0]
        total = 0.0
        for r, ins in enumerate(per_rank):
            w = np.asarray(ins["weight"]).astype(np.float64)
            local = np.asarray(per_rank[r]["ids"]).astype(np.int64) - r * rows
            hit = (local >= 0) & (local < rows)
            total = total + np.where(hit[..., None], w[np.clip(local, 0, rows - 1)], 0.0)
        dtype = np.asarray(per_rank[0]["weight"]).dtype
        return [[np.asarray(total).astype(dtype)] for _ in per_rank]
