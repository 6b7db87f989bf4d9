"""Torch kernels for the shape ops. Reshape returns a view of its input; the
others return fresh contiguous tensors (the memory planner treats only Reshape
as an alias of its input)."""

from __future__ import annotations

import torch

from ...log import logger
from ...ops.shape import resolve_shape, slice_bounds, split_sizes
from ...tensor import describe
from . import kernel

__all__ = ["transpose", "reshape", "split", "concat", "slice_"]


def _fresh(t: torch.Tensor) -> torch.Tensor:
    # clone, not contiguous(): contiguous() returns the input itself when it
    # already is contiguous (identity perm, a split along dim 0).
    return t.clone(memory_format=torch.contiguous_format)


@kernel("Transpose", impl="torch.permute + contiguous copy")
def transpose(p, ins):
    return [_fresh(ins["x"].permute(*p.perm))]


@kernel("Reshape", impl="torch.Tensor.view (zero-copy)", launches=0)
def reshape(p, ins):
    x = ins["x"]
    shape = resolve_shape("Reshape", p.shape, tuple(x.shape))
    try:
        return [x.view(shape)]
    except RuntimeError as e:
        # Strides that no view can express (e.g. a transposed input): copy once.
        logger.info("Reshape: input strides %s allow no view (%s); copying", x.stride(), e)
        return [x.reshape(shape)]


@kernel("Split", impl="torch.split + contiguous copies (one per part)", launches=2)
def split(p, ins):
    x = ins["x"]
    dim, sizes = split_sizes("Split", p, describe(x))
    return [_fresh(t) for t in torch.split(x, list(sizes), dim=dim)]


@kernel("Concat", impl="torch.cat")
def concat(p, ins):
    xs = [ins[f"x{i}"] for i in range(len(ins)) if ins.get(f"x{i}") is not None]
    return [torch.cat(xs, dim=p.dim)]


@kernel("Slice", impl="torch slicing + contiguous copy")
def slice_(p, ins):
    x = ins["x"]
    idx = tuple(slice(a, b) for a, b in slice_bounds("Slice", p, tuple(x.shape)))
    return [_fresh(x[idx])]
