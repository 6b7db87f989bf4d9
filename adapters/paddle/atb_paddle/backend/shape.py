"""Paddle kernels for the shape and index ops: Transpose, Reshape (a view), Split,
Concat, Slice, Gather, Embedding.

Paddle 3.3's transpose, slicing and split can return views; only Reshape may alias
its input (the memory planner relies on it), so the others return fresh copies.
Index ops move data only, and go through :func:`.common.take` (fp16 as bf16 bits).
Index ranges were checked by the ops' ``check_values`` before these run.
"""

from __future__ import annotations

from typing import Any

import paddle

from atbcore.log import logger
from atbcore.runtime.binding import view_binder
from atbcore.ops.shape import resolve_shape, slice_bounds, split_sizes
from atbcore.tensor import describe

from . import kernel
from .common import fresh, take

__all__: list[str] = []


@kernel("Transpose", impl="paddle.transpose + copy")
def transpose(p, ins):
    return [fresh(paddle.transpose(ins["x"], list(p.perm)))]


# the Paddle view of a planned buffer made once (readers bind to it), per run for a slot
_bind_reshape = view_binder(lambda p, ins: reshape(p, ins))


@kernel("Reshape", impl="paddle.Tensor.view (zero-copy); made once for a planned buffer",
        launches=0, bind=_bind_reshape)
def reshape(p, ins):
    x = ins["x"]
    shape = list(resolve_shape("Reshape", p.shape, tuple(x.shape)))
    try:
        return [x.view(shape)]
    except (RuntimeError, ValueError) as e:
        # strides no view can express (a transposed input): copy once
        logger.info("Reshape: input allows no view (%s); copying", str(e).splitlines()[0])
        return [paddle.reshape(x.contiguous(), shape)]


@kernel("Split", impl="paddle.split + copies")
def split(p, ins):
    x = ins["x"]
    dim, sizes = split_sizes("Split", p, describe(x))
    return [fresh(t) for t in paddle.split(x, list(sizes), axis=dim)]


@kernel("Concat", impl="paddle.concat")
def concat(p, ins):
    xs = [ins[f"x{i}"] for i in range(len(ins)) if ins.get(f"x{i}") is not None]
    if len(xs) == 1:
        return [fresh(xs[0])]
    return [paddle.concat(xs, axis=p.dim)]


@kernel("Slice", impl="paddle slicing + copy")
def slice_(p, ins):
    x = ins["x"]
    idx = tuple(slice(a, b) for a, b in slice_bounds("Slice", p, tuple(x.shape)))
    return [fresh(x[idx])]


@kernel("Gather", impl="paddle.gather (fp16 as bf16 bits)")
def gather(p, ins):
    x, idx = ins["x"], ins["indices"]
    return [take(x, idx, p.axis % x.ndim)]


@kernel("Embedding", impl="paddle.gather of table rows (fp16 as bf16 bits)")
def embedding(p, ins):
    return [take(ins["weight"], ins["ids"], 0)]
