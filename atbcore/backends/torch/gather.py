"""Torch kernels for Gather (index_select) and Embedding (F.embedding). Index
ranges were checked by the op's ``check_values`` before these run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernel

__all__ = ["gather", "embedding"]


@kernel("Gather", impl="torch.index_select")
def gather(p, ins):
    x, idx = ins["x"], ins["indices"]
    axis = p.axis % x.dim()
    # index_select takes 1-D indices; reshape restores idx's shape in place of axis.
    y = torch.index_select(x, axis, idx.reshape(-1).long())
    return [y.reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1:])]


@kernel("Embedding", impl="torch.nn.functional.embedding")
def embedding(p, ins):
    return [F.embedding(ins["ids"].long(), ins["weight"])]
