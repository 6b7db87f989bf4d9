"""Torch kernel for AllReduce: ``torch.distributed.all_reduce`` on a copy of the
input when a process group is initialised, the copy alone otherwise. Only the
single-process path is exercised by the tests (see :mod:`atbcore.ops.collective`)."""

from __future__ import annotations

import torch.distributed as dist

from . import kernel

__all__ = ["all_reduce"]


def _reduce_op(name: str):
    return {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN}[name]


@kernel("AllReduce", impl="torch.distributed.all_reduce (identity copy without a group)")
def all_reduce(p, ins):
    y = ins["x"].clone()  # the caller's input is never reduced in place
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(y, op=_reduce_op(p.op))
    return [y]
