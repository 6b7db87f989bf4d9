"""Torch kernels for the reductions (fp32 compute for half types, one rounding)."""

from __future__ import annotations

import torch

from ...ops.reduce import reduce_dims
from . import kernel


def _dims(name, p, x):
    return list(reduce_dims(name, p, tuple(x.shape)))


@kernel("ReduceMean", impl="torch.mean (fp32 compute)")
def reduce_mean(p, ins):
    x = ins["x"]
    return [torch.mean(x.float(), dim=_dims("ReduceMean", p, x), keepdim=p.keepdim).to(x.dtype)]


@kernel("ReduceSum", impl="torch.sum (fp32 compute)")
def reduce_sum(p, ins):
    x = ins["x"]
    return [torch.sum(x.float(), dim=_dims("ReduceSum", p, x), keepdim=p.keepdim).to(x.dtype)]
