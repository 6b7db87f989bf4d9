"""Paddle kernels for ReduceMean / ReduceSum (fp32 compute for half types, one
rounding) and AllReduce (a copy in one process; ``paddle.distributed.all_reduce``
when a Paddle process group is running)."""

from __future__ import annotations

import paddle

from atbcore.ops.reduce import reduce_dims

from . import kernel
from .common import HALF, f32, to_dtype

__all__: list[str] = []


def _dims(name, p, x) -> list[int]:
    return list(reduce_dims(name, p, tuple(x.shape)))


@kernel("ReduceMean", impl="paddle.mean (fp32 compute)")
def reduce_mean(p, ins):
    x = ins["x"]
    return [to_dtype(paddle.mean(f32(x), axis=_dims("ReduceMean", p, x), keepdim=p.keepdim), x.dtype)]


@kernel("ReduceSum", impl="paddle.sum (fp32 compute)")
def reduce_sum(p, ins):
    x = ins["x"]
    xs = f32(x) if x.dtype in HALF else x
    return [to_dtype(paddle.sum(xs, axis=_dims("ReduceSum", p, x), keepdim=p.keepdim), x.dtype)]


@kernel("AllReduce", impl="paddle.distributed.all_reduce (a copy without a process group)")
def all_reduce(p, ins):
    y = ins["x"].clone()                      # the caller's input is never reduced in place
    dist = paddle.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PROD, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}
        dist.all_reduce(y, op=ops[p.op])
    return [y]
